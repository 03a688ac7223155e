"""A startup error under torchrun: one `error:` line per node (its first rank's), every rank out at once with exit code 2, and the
message as the root cause that torchrun's closing report ends with (recipes.engine.command.exit_with_error)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from recipes.engine.command import exit_with_error

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("local_rank,prints", [(None, True), ("0", True), ("1", False)])
def test_each_nodes_first_rank_alone_prints_and_every_rank_writes_the_error_file(tmp_path, monkeypatch, capsys,
                                                                                 local_rank, prints):
    """The line once per node (LOCAL_RANK 0, global rank 1 here: the first rank of a second node), none from the
    node's other ranks, and once from a process torchrun did not start."""
    monkeypatch.setenv("RANK", "1")
    if local_rank is None:
        monkeypatch.delenv("LOCAL_RANK", raising=False)
    else:
        monkeypatch.setenv("LOCAL_RANK", local_rank)
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
    with pytest.raises(SystemExit) as stop:
        exit_with_error("--lr must be a number, got 'abc'")
    assert stop.value.code == 2
    assert capsys.readouterr().err == ("error: --lr must be a number, got 'abc'\n" if prints else "")
    record = json.loads((tmp_path / "error.json").read_text())["message"]  # the layout torchrun reads
    assert record["message"] == "error: --lr must be a number, got 'abc'" and int(record["extraInfo"]["timestamp"])


def test_a_missing_data_file_under_torchrun(tmp_path):
    """Two gloo processes that fail after joining the process group: the line once, no wait for a collective."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    env.pop("WORLD_SIZE", None)
    missing = tmp_path / "missing.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
           "recipes.sft", "--model", "debug", "--device", "cpu", "--data", str(missing), "--out", str(tmp_path / "o")]
    started = time.monotonic()
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode != 0 and time.monotonic() - started < 120, run.stderr[-3000:]
    lines = run.stderr.splitlines()
    ours = f"error: data {missing} does not exist"
    assert [line for line in lines if line.startswith("error:")] == [
        f"{ours}: expected a .jsonl file or a directory of them"], run.stderr[-3000:]
    assert "exitcode  : 2" in run.stderr  # rank 0 exited by itself, with the code for bad input
    report = [line for line in lines if line.strip()]
    assert report[-2].strip().startswith(f"traceback : {ours}") and set(report[-1]) == {"="}, run.stderr[-3000:]
