"""QLoRA (4-bit NF4 base through torchao) and the LoRA base kept in the compute dtype: what the recipe builds, what
its checkpoints hold, what it exports."""

import importlib.util
import json
import shutil
import struct
import subprocess
import sys

import pytest
import torch

import zoo
from recipes import sft
from recipes.data.tokenizer_choice import ASSETS
from zoo.core.layers import init_weights
from zoo.errors import ZooError
from zoo.models import FAMILIES
from zoo.models.llama import LlamaConfig
from zoo.train.lora import LoRAConfig, adapter_state, apply_lora, merged_state

TINY = ["--seq-len", "64", "--batch-tokens", "256", "--no-progress", "--device", "cpu"]
LORA = ["--lora-rank", "4", "--lora-alpha", "8", "--lora-targets", "q_proj,v_proj,down_proj"]
# every block linear a multiple of NF4's 64 x 256 blocks, so all of them quantize
CONFIG = LlamaConfig(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=512, vocab_size=2048, max_seq_len=256)


def tensor_names(path):
    """The tensor names of every safetensors file under `path`, read from their headers."""
    names = set()
    for f in path.rglob("*.safetensors"):
        with f.open("rb") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            names |= set(json.loads(fh.read(n))) - {"__metadata__"}
    return names


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("qlora") / "base"
    model = FAMILIES["llama"].build(CONFIG, "eager")
    init_weights(model)
    zoo.save(model, path, tokenizer_from=str(ASSETS))
    return path


def test_nf4_layers_train_their_adapters_and_give_the_input_its_gradient():
    pytest.importorskip("torchao")
    from zoo.train.quant import dequantized, is_nf4, quantize_nf4

    model = FAMILIES["llama"].build(CONFIG, "eager")
    init_weights(model)
    apply_lora(model, LoRAConfig(rank=4, targets=("all-linear",)))
    before = model.layers[0].mlp.up_proj.base.weight.detach().clone()
    assert quantize_nf4(model) == (14, 14)
    w = model.layers[0].mlp.up_proj.base.weight
    assert is_nf4(w) and not w.requires_grad and w.dtype == torch.float32
    # NF4 keeps 16 levels per block scale: close to the weight, not equal
    err = (dequantized(w) - before).abs().mean() / before.abs().mean()
    assert 0.01 < err < 0.2
    ids = torch.randint(0, 2048, (40,), generator=torch.Generator().manual_seed(1))
    model(ids, torch.tensor([0, 15, 40], dtype=torch.int32)).logsumexp(-1).mean().backward()
    trainable = [p for p in model.parameters() if p.requires_grad]
    bs = [p for p in trainable if p.shape[1] == 4]  # every B (zero at first, so A's gradient is zero until it moves)
    assert len(bs) == 14 and all(p.grad is not None and p.grad.abs().sum() > 0 for p in bs)


def test_qlora_sft_exports_the_base_as_loaded_plus_the_adapter_and_resumes_exactly(base_dir, tmp_path, capsys):
    pytest.importorskip("torchao")
    args = ["--model", str(base_dir), "--steps", "3", "--lr", "1e-2", "--warmup", "1", *TINY, *LORA]
    full = sft.main([*args, "--steps", "1", "--save-every", "0", "--lora-rank", "0", "--out", str(tmp_path / "ft")])
    out = tmp_path / "q"
    got = sft.main([*args, "--qlora", "--save-every", "1", "--keep", "3", "--out", str(out)])
    said = capsys.readouterr().out
    assert "QLoRA: 14 of 14 linear layers of the blocks hold 4-bit NF4 weights" in said
    assert got[0] != full[0] and abs(got[0] - full[0]) < 0.05  # the same model, seen through 4 bits
    assert all(torch.isfinite(torch.tensor(got)))

    # checkpoints hold the adapters and their optimizer state, not the base
    names = tensor_names(out / "checkpoints" / "step_00000003")
    assert names and all("lora_" in n for n in names), sorted(names)[:5]

    # OUT/model: --model's own weights with the adapter merged in, not the 4-bit copy
    base = zoo.load(str(base_dir)).state_dict()
    merged = zoo.load(str(out / "model")).state_dict()
    adapted = ("q_proj", "v_proj", "down_proj")
    for name, t in base.items():
        assert torch.equal(t, merged[name]) != (name.rsplit(".", 2)[-2] in adapted), name
    from safetensors.torch import load_file

    adapter = load_file(out / "adapter" / "adapter_model.safetensors")
    a = adapter["base_model.model.model.layers.1.mlp.down_proj.lora_A.weight"]
    b = adapter["base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"]
    want = (base["layers.1.mlp.down_proj.weight"] + (b @ a) * 2.0).to(torch.float32)
    torch.testing.assert_close(merged["layers.1.mlp.down_proj.weight"], want, atol=1e-6, rtol=0)

    shutil.rmtree(out / "checkpoints" / "step_00000003")
    resumed = sft.main([*args, "--qlora", "--save-every", "1", "--keep", "3", "--out", str(out), "--resume"])
    assert resumed == got[2:]
    with pytest.raises(ZooError, match="different run.*qlora"):  # a 4-bit run's adapters fit its own base
        sft.main([*args, "--save-every", "1", "--out", str(out), "--resume"])


def test_lora_base_in_bf16_adapters_in_fp32(base_dir, tmp_path):
    """--dtype bfloat16 with LoRA: the frozen base is stored in bf16 (half the memory), A and B stay fp32."""
    from functools import partial

    from recipes.engine.build import add_adapters, build_model
    from recipes.engine.config import parse
    from recipes.engine.processes import distributed
    from recipes.sft import SFTConfig

    cfg = parse(SFTConfig, ["--model", str(base_dir), "--dtype", "bfloat16", *LORA, *TINY,
                            "--out", str(tmp_path / "o")])
    lora = cfg.lora.config()
    assert lora is not None
    with distributed(cfg.parallel) as d:
        model, _ = build_model(cfg.model, d, cfg.run.seed, lora=cfg.lora)
        add_adapters(model, d, cfg.model, lora, cfg.lora.qlora, partial(apply_lora, cfg=lora))
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    assert all((dt == torch.float32) == (".lora_" in n) for n, dt in dtypes.items()), dtypes
    assert dtypes["layers.0.attn.q_proj.base.weight"] == torch.bfloat16
    loss = sft.main(["--model", str(base_dir), "--dtype", "bfloat16", "--steps", "1", "--save-every", "0", *LORA,
                     *TINY, "--out", str(tmp_path / "run")])
    assert torch.isfinite(torch.tensor(loss)).all()


def test_qlora_needs_lora_and_torchao(monkeypatch, tmp_path):
    with pytest.raises(ZooError, match="--qlora .* needs --lora-rank"):
        sft.main(["--qlora", "--out", str(tmp_path / "o"), *TINY])
    from zoo.train.quant import require_nf4

    monkeypatch.setitem(sys.modules, "torchao.quantization", None)  # as if torchao were not installed
    with pytest.raises(ZooError, match=r"QLoRA needs torchao's NF4 tensor: pip install 'zoo\[qlora\]'"):
        require_nf4()


def test_fused_adapter_names_with_nf4_bases():
    """InternLM2's shared-A wqkv adapter over 4-bit bases: the adapter is the same tensors whatever the base holds."""
    pytest.importorskip("torchao")
    from zoo.models.internlm2 import InternLM2Config
    from zoo.train.quant import quantize_nf4

    config = InternLM2Config(dim=256, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=512, vocab_size=100)
    model = FAMILIES["internlm2"].build(config, "eager")
    apply_lora(model, LoRAConfig(rank=2, targets=("wqkv",)))
    quantize_nf4(model)
    plan = FAMILIES["internlm2"].plan_to_hf(config, list(FAMILIES["internlm2"].build(config, "auto").state_dict()))
    from zoo.train.lora import shared_a

    state = model.state_dict()
    tensors = adapter_state(state, plan, shared_a(model))
    assert tensors["base_model.model.model.layers.0.attention.wqkv.lora_B.weight"].shape == ((4 + 2 * 2) * 64, 2)
    merged = merged_state({n: t for n, t in state.items()}, 1.0, shared_a(model))
    assert merged["layers.0.attn.k_proj.weight"].shape == (128, 256)


def test_qlora_with_shared_a_under_fsdp_equals_one_process(tmp_path):
    """InternLM2, every linear layer adapted (q/k/v sharing one A, as PEFT's wqkv) over a 4-bit base: two FSDP
    processes (the NF4 tensors sharded and gathered) give one process's losses and the same merged model."""
    pytest.importorskip("torchao")
    import subprocess
    from pathlib import Path

    from zoo.models.internlm2 import InternLM2Config

    torch.manual_seed(0)
    config = InternLM2Config(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=512, vocab_size=2048)
    model = FAMILIES["internlm2"].build(config, "eager")
    init_weights(model)
    zoo.save(model, tmp_path / "base", tokenizer_from=str(ASSETS))
    args = ["--model", str(tmp_path / "base"), "--steps", "2", "--lr", "1e-2", "--save-every", "0", "--qlora",
            "--lora-rank", "4", "--lora-targets", "all-linear", *TINY]
    one = sft.main([*args, "--out", str(tmp_path / "one")])
    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "recipes.sft",
           *args, "--dp", "2", "--out", str(tmp_path / "dp2")]
    env = {k: v for k, v in __import__("os").environ.items() if k != "WORLD_SIZE"}
    run = subprocess.run(cmd, cwd=root, env={**env, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"},
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = {n: [json.loads(line) for line in (tmp_path / n / "metrics.jsonl").read_text().splitlines()]
            for n in ("one", "dp2")}
    assert [r["loss"] for r in rows["dp2"]] == pytest.approx(one, abs=2e-5)
    # the gradient scale too, which AdamW and clipping hide from the losses
    assert [r["grad_norm"] for r in rows["dp2"]] == pytest.approx([r["grad_norm"] for r in rows["one"]], rel=1e-4)
    assert "wqkv" in json.loads((tmp_path / "dp2" / "adapter" / "adapter_config.json").read_text())["target_modules"]
    want, have = (zoo.load(str(tmp_path / n / "model")).state_dict() for n in ("one", "dp2"))
    assert all(torch.allclose(have[n], want[n], atol=1e-5) for n in want)


def test_moving_and_casting_keep_tied_weights_tied():
    """A tied embedding/head (Llama 3.2, OpenELM) stays one parameter when the frozen base is cast to bf16 and when
    QLoRA moves the rest of the model to its device."""
    from recipes.engine.build import frozen_to
    from zoo.train.quant import to_device

    config = LlamaConfig(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=100,
                         tie_embeddings=True)
    model = FAMILIES["llama"].build(config, "eager")
    model.lm_head = torch.nn.Linear(64, 100, bias=False)
    model.lm_head.weight = model.embed.weight  # tied the way a module tree ties: one Parameter, two owners
    model.requires_grad_(False)
    frozen_to(model, torch.bfloat16)
    assert model.lm_head.weight is model.embed.weight and model.embed.weight.dtype == torch.bfloat16
    to_device(model, "meta")
    assert model.lm_head.weight is model.embed.weight and model.embed.weight.device.type == "meta"


@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="torchao is not installed")
def test_transformers_imported_after_import_torchao_prints_no_torchao_warnings():
    """The test extra installs torchao; transformers imports it, and its import warns once per compiled extension
    it cannot load (CUDA kernels under CPU torch). Tests and bench scripts import it first through
    zoo.train.quant.import_torchao, which holds those back; transformers' import then prints nothing of torchao's."""
    code = ("from zoo.train.quant import import_torchao; import_torchao(); "
            "import transformers; from transformers import LlamaForCausalLM; import peft")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "torchao" not in run.stderr and "register_constant" not in run.stderr, run.stderr[-2000:]
