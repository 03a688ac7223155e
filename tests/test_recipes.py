"""Recipes end to end: the default pretrain, SFT from its output, 2 processes (gloo) for --dp 2 and --sp 2 against
one process (every 2-process run made by one torchrun job: TwoProcesses), SIGKILL + --resume against an
uninterrupted run, the bad inputs, the --device choice, and (with CUDA) a bf16 step on the GPU. Runs that start more
processes than a machine may have GPUs, or compare exact numbers between runs, pass --device cpu, so they mean the
same with or without a GPU."""

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import _recipe_runs as recipe_runs
import pytest
import torch

import zoo
from recipes import llava, pretrain, sft, vlm
from recipes.data.tokenizer_choice import ASSETS
from recipes.engine import loop, processes
from recipes.engine.config import parse
from recipes.pretrain import PretrainConfig
from recipes.sft import SFTConfig
from zoo.errors import ZooError
from zoo.train.flops import matmul_params

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--seq-len", "64", "--batch-tokens", "256", "--no-progress"]
CPU = ["--device", "cpu"]


def losses(out):
    return [json.loads(line)["loss"] for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def grad_norms(out):
    """The gradient norm of every step (before clipping). Where N processes should equal one, this is the number
    that shows a wrong gradient scale: AdamW is blind to the scale and clipping rescales, so the losses are not."""
    return [json.loads(line)["grad_norm"] for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def assert_same_weights(out, want_out, atol=1e-5):
    """OUT/model of two runs: the same tensor names, each equal within atol."""
    have, want = (zoo.load(str(Path(o) / "model")).state_dict() for o in (out, want_out))
    assert have.keys() == want.keys()
    for name, t in want.items():
        torch.testing.assert_close(have[name], t, atol=atol, rtol=0, msg=lambda m, n=name: f"{out} {n}: {m}")


def eval_losses(out):
    return {r["step"]: r["eval_loss"] for r in map(json.loads, (Path(out) / "metrics.jsonl").read_text().splitlines())
            if "eval_loss" in r}


def env():
    e = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    e.pop("WORLD_SIZE", None)
    return e


LORA = ["--lora-rank", "4", "--lora-alpha", "8", "--lora-targets",
        "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"]
# the arguments of each run that 2 processes repeat (TwoProcesses); `root` holds the inputs they share
SP_ARGS = ["--steps", "3", "--save-every", "0", *TINY, *CPU]
BF16_RECIPES = [(pretrain, []), (llava, ["--stage", "2"])]
BF16_ARGS = ["--steps", "2", "--save-every", "0", "--dtype", "bfloat16", *TINY, *CPU]
LLAVA_SP_ARGS = ["--steps", "2", "--save-every", "0", "--no-progress", *CPU]
# recipes.vlm's built-in (Qwen2.5-VL) with its tower training too: a crossing image is encoded on both ranks
VLM_SP_ARGS = ["--steps", "2", "--save-every", "0", "--no-progress", "--train", "vision,merger,language", *CPU]
VLM_SP_MODES = ("ulysses", "ring")


def resume_args(root):
    return ["--model", str(root / "init"), "--steps", "4", "--save-every", "2", "--keep", "2", *TINY, *CPU]


def lora_args(root):
    return ["--model", str(root / "init"), "--steps", "2", "--save-every", "0", "--eval-data",
            str(root / "eval.jsonl"), *LORA, *TINY, *CPU]


class TwoProcesses:
    """Every 2-process run of this file, made by one torchrun job (tests/_recipe_runs.py: one start-up for all of
    them); each test compares its runs (`out(name)`, `said(name)`: rank 0's output) with one process."""

    def __init__(self, root: Path):
        self.root = root
        # the inputs: the debug model's initial weights (FSDP loads them sharded from rank 0), 7 chat samples (eval
        # packs that do not split evenly over 2 ranks), and for the resume test the step-2 checkpoint of one
        # uninterrupted process, which 2 processes resume (as if it had stopped after it)
        torch.manual_seed(0)
        zoo.save(zoo.load("debug"), root / "init", tokenizer_from=str(ASSETS))
        (root / "eval.jsonl").write_text("".join((ASSETS / "chat.jsonl").read_text().splitlines(keepends=True)[:7]))
        whole = root / "whole"
        pretrain.main([*resume_args(root), "--out", str(whole)])
        shutil.copytree(whole, root / "1-then-2")
        back_to_step_2(root / "1-then-2")
        runs = [("sp2", "recipes.pretrain", [*SP_ARGS, "--sp", "2", "--sp-mode", "ring"]),
                *[(f"bf16-{r.__name__.rsplit('.', 1)[-1]}", r.__name__, [*BF16_ARGS, *extra, "--dp", "2"])
                  for r, extra in BF16_RECIPES],
                ("llava-sp2", "recipes.llava", [*LLAVA_SP_ARGS, "--sp", "2", "--sp-mode", "ring"]),
                *[(f"vlm-sp2-{m}", "recipes.vlm", [*VLM_SP_ARGS, "--sp", "2", "--sp-mode", m]) for m in VLM_SP_MODES],
                ("2-then-1", "recipes.pretrain", [*resume_args(root), "--dp", "2"]),
                ("1-then-2", "recipes.pretrain", [*resume_args(root), "--dp", "2", "--resume"]),
                ("lora-dp2", "recipes.sft", [*lora_args(root), "--dp", "2"]),
                ("lora-sp2", "recipes.sft", [*lora_args(root), "--sp", "2", "--sp-mode", "ring"])]
        (root / "runs.json").write_text(json.dumps([[name, module, [*argv, "--out", str(self.out(name))]]
                                                    for name, module, argv in runs]))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(ROOT / "tests" / "_recipe_runs.py"), str(root / "runs.json")]
        run = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=1200)
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
        self.outputs = recipe_runs.outputs(run.stdout)
        assert list(self.outputs) == [name for name, _, _ in runs], run.stdout[-3000:]

    def out(self, name: str) -> Path:
        return self.root / name

    def said(self, name: str) -> str:
        return self.outputs[name]


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    return TwoProcesses(tmp_path_factory.mktemp("two_processes"))


def back_to_step_2(out: Path) -> None:
    """A 4-step run as if stopped after its step-2 checkpoint: step 4's checkpoint and the export removed."""
    shutil.rmtree(out / "checkpoints" / "step_00000004")
    shutil.rmtree(out / "model")  # the weights compared are the resumed run's export
    assert sorted(p.name for p in (out / "checkpoints").glob("step_*")) == ["step_00000002"]


def test_defaults_are_the_builtin_run():
    cfg = parse(PretrainConfig, [])
    assert (cfg.model.name, cfg.data.path, cfg.model.tokenizer, cfg.run.out) == ("debug", None, None, "out/pretrain")
    assert cfg.data.batch_tokens % cfg.data.seq_len == 0
    assert parse(SFTConfig, []).model.name == "auto"


def test_help_lists_every_option(capsys):
    with pytest.raises(SystemExit):
        parse(SFTConfig, ["--help"])
    text = capsys.readouterr().out
    for flag in ("--model", "--data", "--out", "--steps", "--seq-len", "--save-every", "--resume", "--dp", "--sp",
                 "--sp-mode", "--batch-tokens", "--overlong", "--chat-template", "--config", "--device",
                 "--lora-rank", "--lora-alpha", "--lora-targets", "--lora-dropout", "--lora-rslora", "--eval-data",
                 "--eval-every"):
        assert flag in text


def test_config_file_and_flag_override(tmp_path):
    (tmp_path / "c.toml").write_text('steps = 7\nseq-len = 32\nlr = 0.01\n')
    cfg = parse(PretrainConfig, ["--config", str(tmp_path / "c.toml"), "--steps", "9"])
    assert (cfg.run.steps, cfg.data.seq_len, cfg.optim.lr) == (9, 32, 0.01)
    (tmp_path / "s.toml").write_text('model = "debug"\n[optim]\nlr = 0.02\n[data]\nseq-len = 64\nbatch_tokens = 128\n')
    cfg = parse(PretrainConfig, ["--config", str(tmp_path / "s.toml")])  # the sectioned form sets the same options
    assert (cfg.model.name, cfg.optim.lr, cfg.data.seq_len, cfg.data.batch_tokens) == ("debug", 0.02, 64, 128)
    (tmp_path / "s.toml").write_text('[optim]\nlr = 0.02\nstepz = 3\n')
    with pytest.raises(ZooError, match="unknown options optim.stepz"):
        parse(PretrainConfig, ["--config", str(tmp_path / "s.toml")])
    (tmp_path / "c.yaml").write_text("stepz: 3\n")
    with pytest.raises(ZooError, match="unknown options stepz"):
        parse(PretrainConfig, ["--config", str(tmp_path / "c.yaml")])


def test_default_pretrain_then_sft(tmp_path):
    out = tmp_path / "pt"
    got = pretrain.main(["--steps", "8", "--lr", "1e-2", "--warmup", "2", "--out", str(out), "--export-hf", *TINY])
    assert len(got) == 8 and got[-1] < got[0] - 0.3, got  # the loss falls
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert {"step", "loss", "lr", "tokens", "tokens_per_s", "tflops", "mfu", "grad_norm"} <= set(rows[0])
    assert rows[-1]["tokens"] == 8 * 256
    # TFLOP/s counts zoo.train.flops' model FLOPs: per token, 6 x the matmul parameters plus attention
    per_token = [r["tflops"] * 1e12 / r["tokens_per_s"] for r in rows]
    six_p = 6 * matmul_params(zoo.load("debug", device="meta"))
    assert all(six_p < f < 1.2 * six_p for f in per_token), (per_token, six_p)
    if not torch.cuda.is_available():  # the default device: cuda where there is one, and MFU with it
        assert all(r["mfu"] is None for r in rows)  # no measured peak on CPU: no MFU (it once read 504.8%)
    assert loop.mfu(5e9, 1e10) == 0.5 and loop.mfu(2e10, 1e10) is None and loop.mfu(1e9, None) is None
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    hf_config = json.loads((out / "model-hf" / "config.json").read_text())
    assert hf_config["model_type"] == "llama"
    # the ids transformers generates with: <s>, </s> and the chat template's <|im_end|>, <pad>
    ids = {"bos_token_id": 0, "eos_token_id": [1, 4], "pad_token_id": 2}
    assert {k: hf_config[k] for k in ids} == ids
    # and the bundled generation_config.json's repetition_penalty, which transformers' generate applies as zoo's does
    assert json.loads((out / "model-hf" / "generation_config.json").read_text()) == {**ids, "repetition_penalty": 1.2}
    model = zoo.load(str(out / "model"))
    assert model.config == zoo.get_preset("debug").config  # the ids are not architecture: equal configs
    assert (model.config.bos_token_id, model.eos_token_ids, model.config.pad_token_id) == (0, (1, 4), 2)
    assert (out / "model" / "tokenizer.json").is_file()

    sft_out = tmp_path / "sft"
    got = sft.main(["--model", str(out / "model"), "--steps", "2", "--seq-len", "256", "--batch-tokens", "512",
                    "--out", str(sft_out), "--no-progress"])
    assert len(got) == 2 and all(0 < x < 10 for x in got)
    assert (sft_out / "model" / "config.json").is_file()

    # LLaVA stage 1 on the built-in synthetic images, its language model from the pretrain output: only the
    # projector may change
    llava_out = tmp_path / "llava"
    got = llava.main(["--language", str(out / "model"), "--steps", "2", "--seq-len", "128", "--batch-tokens", "256",
                      "--out", str(llava_out), "--no-progress", "--export-hf"])
    assert len(got) == 2 and all(0 < x < 10 for x in got)
    trained = zoo.load(str(llava_out / "model"))
    assert trained.family == "llava"
    # its placeholder, -200 in zoo, is the tokenizer's <image> in the export (added, one past the vocabulary)
    hf_config = json.loads((llava_out / "model-hf" / "config.json").read_text())
    assert (hf_config["image_token_index"], hf_config["text_config"]["vocab_size"]) == (2048, 2049)
    assert '"<image>"' in (llava_out / "model-hf" / "tokenizer.json").read_text()
    lm = zoo.load(str(out / "model")).state_dict()
    for name, t in trained.language_model.state_dict().items():
        assert torch.equal(t, lm[name]), name


def test_sequence_parallel_equals_one_process(tmp_path, two_processes):
    """--sp 2 (ring) against one process: every step's loss and gradient norm, and the final weights. (--dp 2 against
    one process is test_resume_with_a_different_number_of_processes' uninterrupted 2-process run.)"""
    one = pretrain.main([*SP_ARGS, "--out", str(tmp_path / "one")])
    sp2 = two_processes.out("sp2")
    assert losses(sp2) == pytest.approx(one, abs=2e-5)
    assert grad_norms(sp2) == pytest.approx(grad_norms(tmp_path / "one"), rel=1e-4)
    assert_same_weights(sp2, tmp_path / "one")


def test_fsdp_in_bf16_equals_one_process(tmp_path, two_processes):
    """bf16 under FSDP (its mixed precision: bf16 weights gathered, fp32 gradients reduced) against bf16 autocast in
    one process, for pretraining and LLaVA (the tower's pixels): the same losses up to bf16 rounding."""
    for recipe, extra in BF16_RECIPES:
        name = recipe.__name__.rsplit(".", 1)[-1]
        one = recipe.main([*BF16_ARGS, *extra, "--out", str(tmp_path / f"{name}1")])
        two = two_processes.out(f"bf16-{name}")
        assert losses(two) == pytest.approx(one, abs=1e-2), name
        assert grad_norms(two) == pytest.approx(grad_norms(tmp_path / f"{name}1"), rel=2e-2), name


def test_llava_sequence_parallel_equals_one_process(tmp_path, two_processes):
    """LLaVA stage 1 on the built-in images: --sp 2 (ring) gives the losses of one process (image targets and the
    global denominator are decided by the model's labels before the pack is cut)."""
    one = llava.main([*LLAVA_SP_ARGS, "--out", str(tmp_path / "one")])
    sp2 = two_processes.out("llava-sp2")
    assert losses(sp2) == pytest.approx(one, abs=2e-5)
    assert grad_norms(sp2) == pytest.approx(grad_norms(tmp_path / "one"), rel=1e-4)
    assert_same_weights(sp2, tmp_path / "one")


def test_vlm_sequence_parallel_equals_one_process(tmp_path, two_processes):
    """recipes.vlm's built-in Qwen2.5-VL, tower, merger and language model training: --sp 2 with Ulysses and with ring
    gives the losses, gradient norms and weights of one process (each rank encodes the images its placeholders show,
    M-RoPE positions and targets those of the whole pack)."""
    one = vlm.main([*VLM_SP_ARGS, "--out", str(tmp_path / "one")])
    for mode in VLM_SP_MODES:
        sp2 = two_processes.out(f"vlm-sp2-{mode}")
        assert losses(sp2) == pytest.approx(one, abs=2e-5), mode
        assert grad_norms(sp2) == pytest.approx(grad_norms(tmp_path / "one"), rel=1e-4), mode
        assert_same_weights(sp2, tmp_path / "one")


def kill_after_first_checkpoint(args: list[str], out: Path) -> None:
    """Start `recipes.pretrain ARGS --out OUT` and SIGKILL it once its first checkpoint exists."""
    proc = subprocess.Popen([sys.executable, "-m", "recipes.pretrain", *args, "--out", str(out)], cwd=ROOT,
                            env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not list((out / "checkpoints").glob("step_*")) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (out / "model").exists(), "the run finished before it could be killed"


def test_sigkill_then_resume_equals_uninterrupted(tmp_path):
    args = ["--steps", "40", "--save-every", "2", "--seq-len", "32", "--batch-tokens", "64", "--no-progress", *CPU]
    out = tmp_path / "killed"
    kill_after_first_checkpoint(args, out)
    # a save cut short leaves only a temporary directory, which resuming ignores
    partial = out / "checkpoints" / ".step_00000099.tmp"
    partial.mkdir(exist_ok=True)
    (partial / "trainer_state.json").write_text("{ cut short")
    resumed = pretrain.main([*args, "--out", str(out), "--resume"])
    assert 0 < len(resumed) < 40
    whole = pretrain.main([*args, "--out", str(tmp_path / "whole")])
    assert losses(out) == whole  # bit-exact on CPU
    assert resumed == whole[-len(resumed):]


def test_resume_with_a_different_number_of_processes(two_processes):
    """2 FSDP processes (--dp 2, the initial weights loaded sharded from rank 0) equal one process; the step-2
    checkpoint of the 2 processes resumed by one process, and one process's resumed by 2 (DCP reshards): every step's
    loss and gradient norm, and the final weights, are the uninterrupted run's."""
    args = resume_args(two_processes.root)
    whole = two_processes.out("whole")  # one process, uninterrupted (TwoProcesses ran it before the 2-process runs)
    two_then_one, one_then_two = two_processes.out("2-then-1"), two_processes.out("1-then-2")
    # uninterrupted, 2 processes are one
    assert losses(two_then_one) == pytest.approx(losses(whole), abs=2e-5)
    assert grad_norms(two_then_one) == pytest.approx(grad_norms(whole), rel=1e-4)
    assert_same_weights(two_then_one, whole)
    back_to_step_2(two_then_one)
    assert len(pretrain.main([*args, "--out", str(two_then_one), "--resume"])) == 2
    # one process's step-2 checkpoint (back_to_step_2 of a copy of `whole`), resumed by 2 processes
    said = two_processes.said("1-then-2")
    assert "resumed from" in said and "step_00000002" in said
    for out in (two_then_one, one_then_two):
        assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]
        assert losses(out) == pytest.approx(losses(whole), abs=2e-5), out.name
        assert grad_norms(out) == pytest.approx(grad_norms(whole), rel=1e-4), out.name
        assert_same_weights(out, whole)


def test_bad_inputs(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": f"document number {i} " * 20}) + "\n" for i in range(20)))
    base = ["--data", str(data), "--out", str(tmp_path / "o"), "--steps", "2", *TINY]
    with pytest.raises(ZooError, match="--seq-len 4096 is above"):
        pretrain.main([*base, "--seq-len", "4096", "--batch-tokens", "4096"])
    with pytest.raises(ZooError, match="must be a multiple"):
        pretrain.main([*base, "--batch-tokens", "100"])
    with pytest.raises(ZooError, match="processes"):
        pretrain.main([*base, "--dp", "2"])
    pretrain.main(base)
    other = tmp_path / "e.jsonl"
    other.write_text(data.read_text().replace("number", "numero"))
    with pytest.raises(ZooError, match="different run.*data"):
        pretrain.main([*base, "--steps", "3", "--resume", "--data", str(other)])
    other_model = tmp_path / "m"
    shutil.copytree(tmp_path / "o" / "model", other_model)
    config = json.loads((other_model / "config.json").read_text())
    config["config"]["rope_theta"] = 500000.0
    (other_model / "config.json").write_text(json.dumps(config))
    with pytest.raises(ZooError, match="different run.*model_config"):
        pretrain.main([*base, "--steps", "3", "--resume", "--model", str(other_model)])
    with pytest.raises(ZooError, match="--resume: --lr 0.005 -> 0.01: .*would keep them"):
        pretrain.main([*base, "--steps", "3", "--resume", "--lr", "0.01"])


def test_device_choice(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert processes.choose_device("auto", 1) == "cuda"
    assert processes.choose_device("cuda", 1) == "cuda"
    assert processes.choose_device("cpu", 2) == "cpu"  # gloo on CPU whatever the GPUs
    for choice in ("auto", "cuda"):
        with pytest.raises(ZooError, match="2 processes on this machine but 1 GPU, .*--device cpu"):
            processes.choose_device(choice, 2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert processes.choose_device("auto", 2) == "cpu"
    with pytest.raises(ZooError, match="CUDA is not available"):
        processes.choose_device("cuda", 1)
    assert parse(PretrainConfig, []).parallel.device == "auto"


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_device_cuda_without_cuda_is_a_clear_error(tmp_path):
    (tmp_path / "c.toml").write_text('device = "cuda"\n')
    assert parse(PretrainConfig, ["--config", str(tmp_path / "c.toml")]).parallel.device == "cuda"
    run = subprocess.run([sys.executable, "-m", "recipes.pretrain", "--device", "cuda", "--out", str(tmp_path / "o")],
                         cwd=ROOT, env=env(), capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr[-3000:]
    assert run.stderr.strip().splitlines()[-1].startswith("error: --device cuda, but CUDA is not available")
    assert not (tmp_path / "o").exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_one_bf16_step_on_gpu(tmp_path):
    """One step of the default debug run on one GPU: bf16 mixed precision (FSDP over a process group of one, as
    --dtype auto picks on GPU) with the auto attention backend (flash_varlen for bf16 on CUDA)."""
    out = tmp_path / "gpu"
    cmd = [sys.executable, "-m", "recipes.pretrain", "--device", "cuda", "--dtype", "bfloat16", "--steps", "1",
           "--no-progress", "--out", str(out)]
    run = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    got = losses(out)
    assert len(got) == 1 and torch.isfinite(torch.tensor(got[0])), got


def test_an_earlier_run_is_never_overwritten_silently(tmp_path, capsys):
    out = tmp_path / "o"
    args = ["--steps", "2", "--save-every", "1", *TINY, *CPU, "--out", str(out)]
    pretrain.main(args)
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ZooError, match=r"--out .* is not empty .*--resume continues its step_00000002.*--force"):
        pretrain.main(args)
    assert len(losses(out)) == 2 and (out / "checkpoints" / "step_00000002").is_dir()
    capsys.readouterr()
    pretrain.main([*args, "--force"])
    said = capsys.readouterr().out
    # tensorboard/ too where TensorBoard is installed
    assert re.search(r"--force: removing checkpoints, metrics.jsonl, loss.png, (tensorboard, )?model", said), said
    assert "step_00000002" in said
    assert (out / "notes.txt").read_text() == "mine"  # not a run output: left alone
    assert len(losses(out)) == 2
    # booleans, enums and numbers from a config file are checked, not read loosely
    (tmp_path / "c.toml").write_text('resume = "no"\n')
    with pytest.raises(ZooError, match="option resume must be true or false, got 'no'"):
        parse(PretrainConfig, ["--config", str(tmp_path / "c.toml")])
    (tmp_path / "c.toml").write_text('sp_mode = "zigzag"\n')
    with pytest.raises(ZooError, match="option sp_mode must be one of ulysses, ring, hybrid, got 'zigzag'"):
        parse(PretrainConfig, ["--config", str(tmp_path / "c.toml")])
    for flags, message in ((["--batch-tokens", "0"], "--batch-tokens must be at least 1, got 0"),
                           (["--lr", "nan"],
                            "--lr must be a finite number above 0, or 0 to choose by what is trained, got nan"),
                           (["--seq-len", "-3"], "--seq-len must be at least 1, got -3"),
                           (["--steps", "0"], "--steps must be at least 1, got 0")):
        with pytest.raises(ZooError, match=message):
            parse(PretrainConfig, flags)


def test_nonfinite_steps_stop_or_are_skipped_and_the_run_still_exports(tmp_path, capsys):
    # a learning rate this large overflows the weights at the first update: the second step's loss is not finite
    args = ["--steps", "4", "--lr", "1e30", "--warmup", "0", "--save-every", "0", *TINY, *CPU]
    out = tmp_path / "stop"
    stopped = pretrain.main([*args, "--out", str(out)])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    finite = [math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in rows]
    assert len(stopped) == 2 and finite == [True, False] and [r["skipped"] for r in rows] == [False, True]
    assert "step 2: loss" in capsys.readouterr().out
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step_00000001"]  # the weights before the bad step
    assert (out / "loss.png").is_file() and (out / "model" / "config.json").is_file()
    skipped = pretrain.main([*args, "--out", str(tmp_path / "skip"), "--nonfinite", "skip"])
    rows = [json.loads(line) for line in (tmp_path / "skip" / "metrics.jsonl").read_text().splitlines()]
    assert len(skipped) == 4 and [r["skipped"] for r in rows] == [False, True, True, True]
    assert (tmp_path / "skip" / "loss.png").is_file()


def test_resume_falls_back_past_a_damaged_checkpoint(tmp_path, capsys):
    out = tmp_path / "o"
    args = ["--steps", "3", "--save-every", "1", "--keep", "3", *TINY, *CPU, "--out", str(out)]
    whole = pretrain.main(args)
    newest = out / "checkpoints" / "step_00000003"
    for shard in newest.glob("*.safetensors"):
        shard.write_bytes(shard.read_bytes()[:100])  # truncated, as by a full disk
    with (out / "metrics.jsonl").open("a") as f:
        f.write('{"step": 4, "lo')  # a line cut short by a kill
    capsys.readouterr()
    resumed = pretrain.main([*args[:1], "4", *args[2:], "--resume"])
    said = capsys.readouterr().out
    assert "step_00000003 is damaged" in said and "resumed from" in said and "step_00000002" in said
    assert len(resumed) == 2 and resumed[0] == whole[2]  # step 3 again, bit-exact, then step 4
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]


def test_resume_and_force_never_remove_what_no_run_of_theirs_wrote(tmp_path):
    """--resume in a finished run whose checkpoints/ is gone keeps its exports (it once removed model/, metrics and
    the plot); --force removes a run's outputs only where a run left its metrics or checkpoints (a user's own
    adapter/ in --out stays)."""
    out = tmp_path / "o"
    args = ["--steps", "2", "--save-every", "0", *TINY, *CPU, "--out", str(out)]
    pretrain.main(args)
    shutil.rmtree(out / "checkpoints")
    exported = sorted(p.name for p in out.iterdir())
    with pytest.raises(ZooError, match=r"--resume: no checkpoint in .* to resume, and --out .* holds .*model.*--force"):
        pretrain.main([*args, "--resume"])
    assert sorted(p.name for p in out.iterdir()) == exported and (out / "model" / "config.json").is_file()
    mine = tmp_path / "mine"
    (mine / "adapter").mkdir(parents=True)
    (mine / "adapter" / "adapter_config.json").write_text("{}")
    with pytest.raises(ZooError, match=r"holds adapter but no earlier run's metrics.jsonl or checkpoints/"):
        pretrain.main([*args[:-1], str(mine), "--force"])
    assert (mine / "adapter" / "adapter_config.json").read_text() == "{}"


@pytest.mark.parametrize("bad_step", ["3", 1e12, -2, 2, True], ids=["string", "1e12", "negative", "another", "bool"])
def test_resume_treats_a_damaged_step_as_damage(tmp_path, capsys, bad_step):
    """trainer_state.json's step, when it is no step or not this checkpoint's, is damage: the one before is tried
    (resuming at -2 would overwrite every later checkpoint)."""
    out = tmp_path / "o"
    args = ["--steps", "3", "--save-every", "1", "--keep", "3", *TINY, *CPU, "--out", str(out)]
    whole = pretrain.main(args)
    state_file = out / "checkpoints" / "step_00000003" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    state["step"] = bad_step
    state_file.write_text(json.dumps(state))
    capsys.readouterr()
    resumed = pretrain.main([*args[:1], "4", *args[2:], "--resume"])
    said = capsys.readouterr().out
    assert "step_00000003 is damaged" in said and "step_00000002" in said
    assert len(resumed) == 2 and resumed[0] == whole[2]


def test_lora_sft_merges_as_peft_and_resumes_exactly(tmp_path):
    """LoRA SFT: the first loss is full fine-tuning's (B starts at zero); only the adapted matrices change; OUT/model
    equals PEFT's merge_and_unload of OUT/adapter over the HF export of the base; a resume is bit-exact."""
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    from convert.zoo_to_hf import main as zoo_to_hf

    torch.manual_seed(0)
    base_dir = tmp_path / "base"
    zoo.save(zoo.load("debug"), base_dir, tokenizer_from=str(ASSETS))
    args = ["--model", str(base_dir), "--steps", "3", "--lr", "1e-2", "--warmup", "1", *TINY, *CPU]
    full = sft.main([*args, "--steps", "1", "--save-every", "0", "--out", str(tmp_path / "full")])
    out = tmp_path / "lora"
    # rsLoRA: PEFT must read use_rslora from the adapter config (scale alpha / sqrt(r) = 4, not alpha / r = 2)
    got = sft.main([*args, *LORA, "--lora-rslora", "--save-every", "1", "--keep", "3", "--out", str(out)])
    assert got[0] == full[0] and len(got) == 3

    base, merged = zoo.load(str(base_dir)).state_dict(), zoo.load(str(out / "model")).state_dict()
    for name, t in base.items():
        adapted = name.rsplit(".", 2)[-2] in LORA[-1].split(",")
        assert torch.equal(t, merged[name]) != adapted, name

    adapter = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert (adapter["r"], adapter["lora_alpha"], adapter["use_rslora"], adapter["peft_type"]) == (4, 8, True, "LORA")
    zoo_to_hf([str(base_dir), str(tmp_path / "base-hf"), "--quiet"])
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "base-hf", dtype=torch.float32)
    hf = peft.PeftModel.from_pretrained(hf, out / "adapter").merge_and_unload().eval()
    ids = torch.randint(0, 2048, (1, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(ids).logits[0]
        have = zoo.load(str(out / "model"))(ids[0], torch.tensor([0, 48]))
    assert (have - want).abs().max() < 1e-5

    # resume from step 2: step 3's loss and the exported weights bit for bit
    shutil.rmtree(out / "checkpoints" / "step_00000003")
    with pytest.raises(ZooError, match="different run.*lora"):  # the adapter's shape and scale are the run's
        sft.main([*args, *LORA, "--save-every", "1", "--keep", "3", "--out", str(out), "--resume"])
    resumed = sft.main([*args, *LORA, "--lora-rslora", "--save-every", "1", "--keep", "3", "--out", str(out),
                        "--resume"])
    assert resumed == got[2:]
    again = zoo.load(str(out / "model")).state_dict()
    assert all(torch.equal(again[n], merged[n]) for n in merged)


def test_lora_bad_targets_and_values(tmp_path):
    with pytest.raises(ZooError, match="--lora-targets qkv: no such linear layer.*q_proj"):
        sft.main(["--model", "debug", "--lora-rank", "4", "--lora-targets", "qkv", "--out", str(tmp_path / "o"),
                  *TINY, *CPU])
    with pytest.raises(ZooError, match="LoRA dropout"):
        sft.main(["--lora-rank", "4", "--lora-dropout", "1.5", "--out", str(tmp_path / "o")])
    with pytest.raises(ZooError, match="--lora-rank must be at least 0"):
        parse(SFTConfig, ["--lora-rank", "-1"])


def test_lora_two_processes_equal_one(tmp_path, two_processes):
    """LoRA under FSDP (--dp 2: the base loaded sharded from rank 0, the adapters with it) and under --sp 2: the
    losses of one process, and the same adapter (the eval data: 7 samples, packs that do not split evenly over 2
    ranks)."""
    one = sft.main([*lora_args(two_processes.root), "--out", str(tmp_path / "one")])
    one_eval = eval_losses(tmp_path / "one")
    want = zoo.load(str(tmp_path / "one" / "model")).state_dict()
    for name in ("lora-dp2", "lora-sp2"):
        out = two_processes.out(name)
        assert losses(out) == pytest.approx(one, abs=2e-5), name
        assert grad_norms(out) == pytest.approx(grad_norms(tmp_path / "one"), rel=1e-4), name
        assert eval_losses(out) == pytest.approx(one_eval, abs=2e-5), name
        have = zoo.load(str(out / "model")).state_dict()
        assert all(torch.allclose(have[n], want[n], atol=1e-5) for n in want), name
        assert (out / "adapter" / "adapter_model.safetensors").is_file()


def test_eval_data_and_the_closing_summary(tmp_path, capsys):
    """--eval-data: eval_loss every --eval-every steps and at the end, the token mean over all of the eval data
    (what the exported model gives); the run ends with one summary line."""
    from recipes.data import SFTData
    from recipes.data.tokenizer_choice import find_tokenizer

    eval_data = tmp_path / "eval.jsonl"
    eval_data.write_text("".join((ASSETS / "chat.jsonl").read_text().splitlines(keepends=True)[:20]))
    out = tmp_path / "o"
    got = sft.main(["--model", "debug", "--steps", "5", "--eval-every", "2", "--eval-data", str(eval_data),
                    "--save-every", "0", "--out", str(out), *TINY, *CPU])
    evals = eval_losses(out)
    assert sorted(evals) == [2, 4, 5]
    model, tok = zoo.load(str(out / "model")), find_tokenizer(None, "debug")
    data = SFTData(str(eval_data), tok, 64, 0)
    with torch.no_grad():
        total = sum(model.loss(data.in_order(i)).item() * data.loss_tokens[i] for i in range(len(data)))
    assert evals[5] == pytest.approx(total / sum(data.loss_tokens), abs=1e-5)
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith(f"done: 5 steps (1-5), loss {got[0]:.4f} -> {got[-1]:.4f}, eval_loss {evals[5]:.4f}, ")
    assert "tokens/s" in last and f"model: {out / 'model'}" in last and f"plot: {out / 'loss.png'}" in last
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_logged_run_has_no_carriage_returns(tmp_path):
    """Output to a file (not a terminal): plain lines, no progress-bar redraws."""
    out = tmp_path / "o"
    run = subprocess.run([sys.executable, "-m", "recipes.pretrain", "--steps", "2", *TINY[:-1], *CPU, "--out",
                          str(out)], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "\r" not in run.stdout + run.stderr and "step      2  loss" in run.stdout


def test_pretrain_eval_data(tmp_path):
    """pretrain's --eval-data (JSONL here; a tokenized dataset takes the same path) gives eval_loss rows."""
    eval_data = tmp_path / "eval.jsonl"
    eval_data.write_text("".join((ASSETS / "corpus.jsonl").read_text().splitlines(keepends=True)[:5]))
    out = tmp_path / "o"
    pretrain.main(["--steps", "2", "--eval-every", "1", "--eval-data", str(eval_data), "--save-every", "0",
                   "--out", str(out), *TINY, *CPU])
    evals = eval_losses(out)
    assert sorted(evals) == [1, 2] and all(math.isfinite(v) and v > 0 for v in evals.values())


def test_llava_eval_data(tmp_path):
    """recipes.llava --eval-data: LLaVA-Instruct rows with their images beside them; eval_loss is the token mean of
    the exported model over all of it."""
    from PIL import Image

    from recipes.data import LlavaData
    from recipes.data.tokenizer_choice import find_tokenizer
    from recipes.llava import debug_llava

    colors = [(200, 30, 10), (10, 200, 30), (30, 10, 200)]
    rows = []
    for i, color in enumerate(colors):
        Image.new("RGB", (40, 24 + 8 * i), color).save(tmp_path / f"{i}.png")
        rows.append({"id": str(i), "image": f"{i}.png", "conversations": [
            {"from": "human", "value": "<image>\nWhat color is it?"}, {"from": "gpt", "value": f"Color {i}."}]})
    eval_data = tmp_path / "eval.jsonl"
    eval_data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "o"
    llava.main(["--steps", "2", "--eval-every", "1", "--eval-data", str(eval_data), "--save-every", "0",
                "--seq-len", "128", "--batch-tokens", "256", "--no-progress", *CPU, "--out", str(out)])
    evals = eval_losses(out)
    assert sorted(evals) == [1, 2] and evals[1] != evals[2]
    model, tok = zoo.load(str(out / "model")), find_tokenizer(None, "debug")
    data = LlavaData(str(eval_data), None, tok, 128, 0, debug_llava())
    with torch.no_grad():
        total = sum(model.loss(data.in_order(i)).item() * data.loss_tokens[i] for i in range(len(data)))
    assert evals[2] == pytest.approx(total / sum(data.loss_tokens), abs=1e-5)
