"""LoRA in recipes.llava stage 2 (XTuner's llm_lora and visual_encoder_lora): OUT/model equals PEFT's merge_and_unload
of OUT/adapter over the llava-hf export of the base, the first loss is full stage 2's, the tower's adapters train
with --lora-vision, stage 1 refuses LoRA, and a resume continues bit for bit."""

import json
import shutil

import pytest
import torch

import zoo
from recipes import llava
from recipes.data.tokenizer_choice import ASSETS
from zoo.core.layers import init_weights
from zoo.errors import ZooError
from zoo.models.llava import Llava
from zoo.train.lora import LoRAConfig, lora_modules

TINY = ["--seq-len", "128", "--batch-tokens", "256", "--no-progress", "--device", "cpu"]
LORA = ["--stage", "2", "--lora-rank", "4", "--lora-alpha", "8", "--lora-targets", "all-linear"]
TOWER = ["--lora-vision", "--lora-vision-targets", "q_proj,o_proj,fc2"]


def losses(out):
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """debug-llava with random weights, saved as a checkpoint with the debug tokenizer."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Llava(llava.debug_llava(), attn="eager")
    model.to_empty(device="cpu")
    init_weights(model)
    path = tmp_path_factory.mktemp("llava") / "base"
    zoo.save(model, path, tokenizer_from=str(ASSETS))
    return path


def test_the_tower_option_wraps_its_blocks_and_the_projector_still_trains():
    model = Llava(llava.debug_llava(), attn="eager")
    lora = LoRAConfig(rank=2, targets=("q_proj", "v_proj"))
    wrapped = llava.add_lora(model, lora, ("q_proj", "fc1"), seed=0)
    # the tower's last block runs for no one (LLaVA reads hidden state -2): only block 0 is adapted
    assert wrapped[:3] == ["vision.layers.0.attn.q_proj", "vision.layers.0.mlp.fc1",
                           "language_model.layers.0.attn.q_proj"]
    assert len(wrapped) == 2 + 2 * len(model.language_model.layers)
    trains = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trains == {f"{w}.lora_{x}.weight" for w in wrapped for x in "AB"} | {
        n for n, _ in model.named_parameters() if n.startswith("projector.")}
    # the LM-only default: the tower stays plain and frozen
    plain = Llava(llava.debug_llava(), attn="eager")
    llava.add_lora(plain, lora, None, seed=0)
    assert not any(n.startswith("vision.") for n in lora_modules(plain))


def test_merged_equals_peft_and_the_tower_trains_and_resume_is_exact(base, tmp_path):
    """One LoRA stage-2 run with the tower adapted: OUT/model == PEFT's merge of OUT/adapter (weights and logits),
    the tower's adapted layers changed (the last block, past LLaVA's feature layer -2, never runs), then a resume
    from step 2 repeats step 3 and the export bit for bit."""
    peft = pytest.importorskip("peft")
    from transformers import LlavaForConditionalGeneration

    from convert.zoo_to_hf import main as zoo_to_hf

    out = tmp_path / "lora"
    args = ["--model", str(base), *LORA, *TOWER, "--steps", "3", "--lr", "1e-2", "--warmup", "1", "--save-every",
            "1", "--keep", "3", *TINY, "--out", str(out)]
    got = llava.main(args)
    assert len(got) == 3

    before, merged = zoo.load(str(base)).state_dict(), zoo.load(str(out / "model")).state_dict()
    assert set(before) == set(merged)
    for name, t in before.items():
        if name.startswith("projector."):
            changed = True
        elif name.startswith("vision.layers.0.") and name.endswith(".weight"):
            changed = name.split(".")[-2] in ("q_proj", "o_proj", "fc2")
        elif name.startswith("language_model.layers.") and name.endswith("_proj.weight"):
            changed = True
        else:
            changed = False
        assert torch.equal(t, merged[name]) != changed, name

    adapter = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert (adapter["r"], adapter["lora_alpha"], adapter["modules_to_save"]) == (4, 8, ["multi_modal_projector"])
    zoo_to_hf([str(base), str(tmp_path / "base-hf"), "--quiet"])
    zoo_to_hf([str(out / "model"), str(tmp_path / "merged-hf"), "--quiet"])
    hf = LlavaForConditionalGeneration.from_pretrained(tmp_path / "base-hf", dtype=torch.float32)
    hf = peft.PeftModel.from_pretrained(hf, out / "adapter")
    from safetensors import safe_open

    with safe_open(out / "adapter" / "adapter_model.safetensors", "pt") as f:
        saved = set(f.keys())
    adapted = {n for n, m in hf.named_modules() if hasattr(m, "lora_A") and "default" in m.lora_A}
    assert len(adapted) == sum(".lora_A." in k for k in saved)  # the pattern adapts exactly the saved modules
    assert "base_model.model.model.vision_tower.encoder.layers.0.self_attn.out_proj.lora_B.weight" in saved
    assert "base_model.model.model.multi_modal_projector.linear_2.bias" in saved
    hf = hf.merge_and_unload().eval()
    want = LlavaForConditionalGeneration.from_pretrained(tmp_path / "merged-hf", dtype=torch.float32).state_dict()
    have = hf.state_dict()
    assert set(have) == set(want)
    for name, t in want.items():
        assert torch.equal(have[name], t), name

    config = json.loads((tmp_path / "merged-hf" / "config.json").read_text())
    model = zoo.load(str(out / "model"), attn="eager")
    g = torch.Generator().manual_seed(1)
    P = model.config.image_tokens
    text = torch.randint(5, 2000, (20,), generator=g)
    ids = torch.cat([text[:4], torch.full((P,), model.config.image_token_id), text[4:]])
    pixels = torch.randn(1, 3, 32, 32, generator=g)
    with torch.no_grad():
        mine = model(zoo.pack([ids], images=[pixels]))
        hf_ids = ids.masked_fill(ids == model.config.image_token_id, config["image_token_index"])
        theirs = hf(input_ids=hf_ids[None], pixel_values=pixels).logits[0]
    assert (mine - theirs[:, : mine.shape[1]]).abs().max() < 1e-5

    shutil.rmtree(out / "checkpoints" / "step_00000003")
    resumed = llava.main([*args, "--resume"])
    assert resumed == got[2:]
    again = zoo.load(str(out / "model")).state_dict()
    assert all(torch.equal(again[n], merged[n]) for n in merged)


def test_first_loss_equals_full_stage_2(base, tmp_path):
    """B starts at zero: the first step of a LoRA stage 2 sees the base model, as full stage 2 does."""
    args = ["--model", str(base), "--stage", "2", "--steps", "1", "--save-every", "0", *TINY]
    full = llava.main([*args, "--out", str(tmp_path / "full")])
    lora = llava.main([*args, *LORA[2:], *TOWER, "--out", str(tmp_path / "lora")])
    assert lora == full


def test_stage_1_and_bad_tower_targets_are_refused(tmp_path):
    with pytest.raises(ZooError, match="--lora-rank with --stage 1: stage 1 trains only the projector"):
        llava.main(["--lora-rank", "4", "--out", str(tmp_path / "o"), *TINY])
    with pytest.raises(ZooError, match="--lora-vision-targets gate_proj: expected linear layers of a CLIP block"):
        llava.main([*LORA, "--lora-vision", "--lora-vision-targets", "q_proj,gate_proj", "--out", str(tmp_path / "o"),
                    *TINY])
    with pytest.raises(ZooError, match="--lora-vision .* give --lora-rank too"):
        llava.main(["--stage", "2", "--lora-vision", "--out", str(tmp_path / "o"), *TINY])
    assert not (tmp_path / "o").exists()
