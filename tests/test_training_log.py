"""What training shows besides the loss: sample generations every --sample-every steps (recipes/report/sample.py), and
Weights & Biases logging with --wandb (recipes/engine/metrics.py)."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch

import zoo
from recipes import pretrain
from recipes.report.sample import PRETRAIN_PROMPTS
from zoo.errors import ZooError
from zoo.generate import generate
from zoo.io.tokenizer import Tokenizer

RUN = ["--steps", "2", "--seq-len", "64", "--batch-tokens", "128", "--warmup", "1", "--no-progress"]


def rows_of(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_samples_every_step_equal_generate_on_the_exported_model(tmp_path, capsys):
    out = tmp_path / "run"
    pretrain.main([*RUN, "--out", str(out), "--sample-every", "1", "--sample-tokens", "6"])
    rows = rows_of(out)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert [s["prompt"] for s in r["samples"]] == list(PRETRAIN_PROMPTS)
        assert all(isinstance(s["text"], str) for s in r["samples"])
    printed = capsys.readouterr().out
    assert "step 2 samples:" in printed and repr(PRETRAIN_PROMPTS[0]) in printed

    # step 2's weights are the exported ones; its tokenizer encodes a prompt as the pretraining data starts (bos)
    model, tok = zoo.load(str(out / "model")), Tokenizer(out / "model")
    for prompt, sample in zip(PRETRAIN_PROMPTS, rows[-1]["samples"], strict=True):
        ids = tok.encode(prompt, add_special_tokens=True)
        assert ids[0] == tok.bos_id
        new = generate(model, [torch.tensor(ids)], max_new_tokens=6, stop=[tok.eos_id])[0].tolist()
        assert sample["text"] == tok.decode(new[: -1] if new[-1:] == [tok.eos_id] else new)


def test_samples_under_fsdp_and_sequence_parallel_equal_one_process(tmp_path):
    """Two processes, --sp 2: FSDP shards the model over both (the root's weights gathered around generation) and
    the sequence-parallel attention is set aside for the plain one; the samples are one process's."""
    import os
    import subprocess

    args = ["--steps", "1", "--seq-len", "64", "--batch-tokens", "128", "--no-progress", "--device", "cpu",
            "--save-every", "0", "--sample-every", "1", "--sample-tokens", "4"]
    pretrain.main([*args, "--out", str(tmp_path / "one")])
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root), OMP_NUM_THREADS="1")
    env.pop("WORLD_SIZE", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
           "recipes.pretrain", *args, "--sp", "2", "--sp-mode", "ring", "--out", str(tmp_path / "sp2")]
    run = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert rows_of(tmp_path / "sp2")[0]["samples"] == rows_of(tmp_path / "one")[0]["samples"]
    assert run.stdout.count("step 1 samples:") == 1  # rank 0 prints


def test_sample_prompts_file_and_the_off_default(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Once upon\n\nA list\n")
    out = tmp_path / "run"
    pretrain.main([*RUN, "--out", str(out), "--sample-every", "5", "--sample-tokens", "2",
                   "--sample-prompts", str(prompts)])
    rows = rows_of(out)
    assert "samples" not in rows[0]  # step 1 is not a multiple of 5; the last step always samples
    assert [s["prompt"] for s in rows[1]["samples"]] == ["Once upon", "A list"]
    with pytest.raises(ZooError, match="--sample-prompts"):
        pretrain.main([*RUN, "--out", str(tmp_path / "bad"), "--sample-every", "1",
                       "--sample-prompts", str(tmp_path / "missing.txt")])


def test_wandb_refused_without_the_package(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError, installed or not
    with pytest.raises(ZooError, match="pip install wandb") as e:
        pretrain.main([*RUN, "--steps", "1", "--out", str(tmp_path / "run"), "--wandb"])
    assert "\n" not in str(e.value)


def test_wandb_gets_the_tensorboard_scalars(tmp_path, monkeypatch):
    logged: list[tuple[dict[str, float], int]] = []
    calls: dict[str, Any] = {}

    class Run:
        def log(self, data: dict[str, float], step: int) -> None:
            logged.append((dict(data), step))

        def finish(self) -> None:
            calls["finished"] = True

    def init(**kwargs: Any) -> Run:
        calls["init"] = kwargs
        return Run()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    out = tmp_path / "run"
    eval_data = tmp_path / "eval.jsonl"
    eval_data.write_text(json.dumps({"text": "Some held-out text to evaluate on. " * 8}) + "\n")
    pretrain.main([*RUN, "--out", str(out), "--wandb", "--wandb-project", "tiny", "--eval-data", str(eval_data)])
    assert calls["init"]["project"] == "tiny" and calls["finished"]
    rows = rows_of(out)
    assert [step for _, step in logged] == [1, 2]
    for (data, _), row in zip(logged, rows, strict=True):
        assert data["train/loss"] == row["loss"] and data["train/lr"] == row["lr"]
        assert data["train/grad_norm"] == row["grad_norm"]
    assert logged[-1][0]["eval/loss"] == rows[-1]["eval_loss"]


def assert_chat_samples(out: Path, max_new: int) -> None:
    """The samples of `out`'s last row: the greedy answers of its exported model to each prompt as a user turn."""
    from zoo.io.tokenizer import render

    samples = rows_of(out)[-1]["samples"]
    assert len(samples) == 2
    model, tok = zoo.load(str(out / "model")), Tokenizer(out / "model")
    stop = tok.stop_ids()
    for sample in samples:
        text = render([{"role": "user", "content": sample["prompt"]}], "auto", tok, add_generation_prompt=True).text
        assert text.count("<|im_start|>user") == 1 and text.endswith("<|im_start|>assistant\n")
        ids = tok.encode(text, add_special_tokens=False)  # the template writes its special tokens
        new = generate(model, [torch.tensor(ids)], max_new_tokens=max_new, stop=stop)[0].tolist()
        assert sample["text"] == tok.decode(new[:-1] if new[-1:] and new[-1] in stop else new)


def test_sft_and_dpo_sample_a_user_turn_through_the_chat_template(tmp_path):
    """sft renders the prompts through the chat template; dpo too, generating with the plain attention under its
    shared-prompt wrapper."""
    from recipes import dpo, sft

    chat = ["--steps", "1", "--seq-len", "256", "--batch-tokens", "512", "--no-progress", "--sample-every", "1",
            "--sample-tokens", "5"]
    sft.main([*chat, "--model", "debug", "--out", str(tmp_path / "sft")])
    assert_chat_samples(tmp_path / "sft", 5)
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": p, "chosen": c, "rejected": r}) + "\n" for p, c, r in
                             [("What is 2+2?", "4", "5"), ("Name a colour.", "Blue.", "No.")]))
    dpo.main([*chat, "--model", str(tmp_path / "sft" / "model"), "--data", str(pairs), "--out", str(tmp_path / "dpo")])
    assert_chat_samples(tmp_path / "dpo", 5)
