"""The recipes from Python: `recipes.<recipe>.run(Config(...))` is the command line's path (its values checked
alike) and returns where the outputs are and the final metrics, in one process and under torchrun."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from recipes import pretrain, sft
from recipes.engine.metrics import Result
from recipes.engine.sections import DataSection, LogSection, LoRASection, OptimSection, ParallelSection, RunSection
from recipes.pretrain import PretrainConfig
from recipes.sft import SFTConfig
from zoo.errors import ZooError

ROOT = Path(__file__).resolve().parents[1]
FLAGS = ["--steps", "3", "--seq-len", "64", "--batch-tokens", "128", "--no-progress", "--device", "cpu"]


def small(out: Path, **sections) -> PretrainConfig:
    base = dict(run=RunSection(out=str(out), steps=3), data=DataSection(seq_len=64, batch_tokens=128),
                parallel=ParallelSection(device="cpu"), log=LogSection(progress=False))
    return PretrainConfig(**{**base, **sections})


def test_run_is_the_command_line(tmp_path):
    got = pretrain.run(small(tmp_path / "api"))
    assert isinstance(got, Result) and got.out == tmp_path / "api"
    assert got.model == tmp_path / "api" / "model" and (got.model / "config.json").is_file()
    assert got.model_hf is None and got.adapter is None and got.metrics.is_file()
    assert len(got.losses) == 3 and got.last["step"] == 3 and got.last["loss"] == got.losses[-1]
    assert pretrain.main([*FLAGS, "--out", str(tmp_path / "cli")]) == got.losses  # bit-exact on CPU


def test_sft_with_lora_from_python(tmp_path):
    pretrained = pretrain.run(small(tmp_path / "pt"))
    cfg = SFTConfig(run=RunSection(out=str(tmp_path / "sft"), steps=2), lora=LoRASection(rank=4),
                    parallel=ParallelSection(device="cpu"), log=LogSection(progress=False))
    cfg.model.name = str(pretrained.model)
    cfg.data.seq_len, cfg.data.batch_tokens = 128, 256
    got = sft.run(cfg)
    assert got.adapter == tmp_path / "sft" / "adapter" and (got.adapter / "adapter_config.json").is_file()
    assert len(got.losses) == 2 and cfg.model.name == str(pretrained.model)


@pytest.mark.parametrize("change,words", [
    (dict(optim=OptimSection(lr=-1.0)),
     "--lr must be a finite number above 0, or 0 to choose by what is trained, got -1.0"),
    (dict(optim=OptimSection(lr="5e-3")), "--lr must be a number, got '5e-3' (str)"),  # type: ignore[arg-type]
    (dict(log=LogSection(log_every=True)), "--log-every must be an integer, got True (bool)"),
])
def test_a_bad_value_from_python_is_named_by_its_flag(tmp_path, change, words):
    with pytest.raises(ZooError) as e:
        pretrain.run(small(tmp_path / "bad", **change))
    assert str(e.value) == words and not (tmp_path / "bad").exists()


def test_run_under_torchrun(tmp_path):
    """A script calling pretrain.run, started by torchrun on 2 processes (--dp 2): every process gets the Result,
    whose losses are one process's."""
    script = tmp_path / "train.py"
    script.write_text("""
import json, sys
from recipes import pretrain
from recipes.pretrain import PretrainConfig
from recipes.engine.sections import DataSection, LogSection, ParallelSection, RunSection
got = pretrain.run(PretrainConfig(run=RunSection(out=sys.argv[1], steps=3),
                                  data=DataSection(seq_len=64, batch_tokens=128),
                                  parallel=ParallelSection(device="cpu"), log=LogSection(progress=False)))
print("RESULT", json.dumps({"losses": got.losses, "model": str(got.model)}))
""")
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    env.pop("WORLD_SIZE", None)
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          str(script), str(tmp_path / "out")], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    results = [json.loads(line.split("RESULT ", 1)[1]) for line in run.stdout.splitlines() if "RESULT " in line]
    assert len(results) == 2 and results[0] == results[1]
    one = pretrain.run(small(tmp_path / "one"))
    assert results[0]["losses"] == pytest.approx(one.losses, abs=2e-5)
    assert results[0]["model"] == str(tmp_path / "out" / "model")


def test_dpo_from_python(tmp_path):
    """recipes.dpo.run over the bundled model's pretraining: the same Result, and the caller's config untouched."""
    from recipes import dpo

    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Question {i}:", "chosen": f" yes {i}", "rejected": f" no {i}"})
                            + "\n" for i in range(8)))
    pretrained = pretrain.run(small(tmp_path / "pt"))
    cfg = dpo.DPOConfig(run=RunSection(out=str(tmp_path / "dpo"), steps=2), parallel=ParallelSection(device="cpu"),
                        log=LogSection(progress=False))
    cfg.model.name, cfg.data.path = str(pretrained.model), str(data)
    cfg.data.seq_len, cfg.data.batch_tokens = 128, 256
    got = dpo.run(cfg)
    assert len(got.losses) == 2 and "rewards/accuracies" in got.last and got.model is not None


def test_eval_loss_comes_with_its_perplexity(tmp_path, capsys):
    import math

    held = tmp_path / "held.jsonl"
    held.write_text("".join(json.dumps({"text": f"held out document {i} " * 12}) + "\n" for i in range(6)))
    got = pretrain.run(small(tmp_path / "ev", data=DataSection(seq_len=64, batch_tokens=128, eval_data=str(held))))
    assert got.last["eval_ppl"] == pytest.approx(math.exp(got.last["eval_loss"]))
    assert f"(perplexity {got.last['eval_ppl']:.4g})" in capsys.readouterr().out


def test_after_resume_the_done_line_reports_the_whole_run(tmp_path, capsys):
    import shutil

    out = tmp_path / "r"
    pretrain.main([*FLAGS, "--out", str(out), "--save-every", "1"])
    shutil.rmtree(out / "checkpoints" / "step_00000003")
    shutil.rmtree(out / "model")
    capsys.readouterr()
    resumed = pretrain.main([*FLAGS, "--out", str(out), "--resume"])
    done = [line for line in capsys.readouterr().out.splitlines() if line.startswith("done:")][0]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert done.startswith("done: 1 step (3-3)") and len(resumed) == 1
    assert f"the whole run 1-3: loss {rows[0]['loss']:.4f} -> {rows[-1]['loss']:.4f}" in done, done
