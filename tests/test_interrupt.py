"""Ctrl-C and SIGTERM (a scheduler's notice before preemption) stop a run after its step with a checkpoint of it: exit
code 130 / 143, one line saying how to resume and no traceback; --resume then equals the uninterrupted run. Under
torchrun a signal to one worker stops both at the same step. A second signal stops at once."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import zoo
from recipes import pretrain
from recipes.data.tokenizer_choice import ASSETS

ROOT = Path(__file__).resolve().parents[1]
ARGS = ["--steps", "30", "--save-every", "0", "--seq-len", "32", "--batch-tokens", "64", "--no-progress",
        "--device", "cpu"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
RESUME_LINE = re.compile(r"interrupted at step (\d+) of \d+: checkpoint (\S+) written; resume with the same "
                         r"command and --resume")


def env():
    e = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    e.pop("WORLD_SIZE", None)
    return e


def losses(out):
    return [json.loads(line)["loss"] for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def signal_after_first_step(cmd, sig, target=None):
    """Run `cmd` and send `sig` to the process `target(proc)` picks (the process itself by default) once the first
    step's line is printed; returns (exit code, stdout, stderr)."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if line.startswith("step"):
            break
    else:
        proc.wait()
        pytest.fail(f"no step was printed: {''.join(seen)} {proc.stderr.read()[-3000:]}")
    pid = target(proc) if target else proc.pid
    os.kill(pid, sig)
    out, err = proc.communicate(timeout=120)
    return proc.returncode, "".join(seen) + out, err


def checkpoint_named(stdout, out):
    """The step and checkpoint the resume line names, checked to be the only checkpoint in OUT."""
    match = RESUME_LINE.search(stdout)
    assert match, stdout[-2000:]
    step, path = int(match[1]), Path(match[2])
    assert path == out / "checkpoints" / f"step_{step:08d}"
    assert sorted((out / "checkpoints").iterdir()) == [path]
    assert (path / "trainer_state.json").is_file()
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()][-1] == step
    assert not (out / "model").exists(), "an interrupted run is not exported"
    return step


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    out = tmp_path_factory.mktemp("whole")
    return pretrain.main([*ARGS, "--out", str(out)])


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_checkpoints_the_step_and_resume_equals_uninterrupted(tmp_path, whole, sig, code):
    out = tmp_path / "run"
    rc, stdout, stderr = signal_after_first_step([sys.executable, "-m", "recipes.pretrain", *ARGS, "--out",
                                                     str(out)], sig)
    assert rc == code, stderr[-3000:]
    assert "Traceback" not in stdout + stderr
    step = checkpoint_named(stdout, out)
    assert 1 <= step < 30
    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    resumed = pretrain.main([*ARGS, "--out", str(out), "--resume"])
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == handlers  # restored
    assert losses(out) == whole  # bit-exact on CPU
    assert resumed == whole[step:]


def rank_of(agent_pid, rank):
    """The pid of torchrun's worker of `rank`."""
    deadline = time.time() + 30
    while time.time() < deadline:
        for proc in Path("/proc").iterdir():
            try:
                if proc.name.isdigit() and int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1]) == agent_pid:
                    environ = dict(v.split("=", 1) for v in (proc / "environ").read_text().split("\0") if "=" in v)
                    if environ.get("RANK") == str(rank):
                        return int(proc.name)
            except (OSError, ValueError, IndexError):
                continue
        time.sleep(0.05)
    raise AssertionError(f"no worker of rank {rank} under torchrun {agent_pid}")


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds torchrun's workers through /proc")
def test_sigterm_to_one_worker_stops_both_ranks_at_one_step(tmp_path):
    """SIGTERM to rank 1's process only (not to torchrun): both ranks stop after the same step and write its one
    checkpoint together; torchrun --resume then gives the losses of one uninterrupted process."""
    torch.manual_seed(0)
    zoo.save(zoo.load("debug"), tmp_path / "init", tokenizer_from=str(ASSETS))
    args = [*ARGS, "--model", str(tmp_path / "init")]
    out = tmp_path / "dp2"
    cmd = [*TORCHRUN, "-m", "recipes.pretrain", *args, "--dp", "2", "--out", str(out)]
    rc, stdout, stderr = signal_after_first_step(cmd, signal.SIGTERM, lambda proc: rank_of(proc.pid, 1))
    assert rc != 0, stderr[-3000:]  # torchrun reports its workers' exit code 143 as a failure
    assert "SIGTERM: stopping after this step" in stderr
    step = checkpoint_named(stdout, out)
    ckpt = out / "checkpoints" / f"step_{step:08d}"
    assert sorted(p.name for p in ckpt.glob("rng_rank*.json")) == ["rng_rank0.json", "rng_rank1.json"]
    assert re.search(r"exitcode\s*:\s*143", stderr), stderr[-3000:]  # rank 1's, in torchrun's report
    run = subprocess.run([*cmd, "--resume"], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    one = pretrain.main([*args, "--out", str(tmp_path / "one")])
    assert losses(out) == pytest.approx(one, abs=2e-5)


def test_a_repeat_within_the_window_is_the_same_signal_and_a_later_one_stops_at_once(monkeypatch):
    """StopSignals' handler, driven directly with a clock of our own (a subprocess test of this would hang on the
    machine's load): the first signal asks for a stop, a repeat within REPEAT_S (a scheduler signals every process
    and torchrun forwards it again) is the same signal, a later one raises Interrupted at once."""
    from recipes.engine.processes import Interrupted, StopSignals

    now = [100.0]
    monkeypatch.setattr("recipes.engine.processes.time.monotonic", lambda: now[0])
    stop = StopSignals()
    stop._handle(signal.SIGTERM, None)
    assert stop.signum == signal.SIGTERM
    now[0] += StopSignals.REPEAT_S / 2
    stop._handle(signal.SIGTERM, None)  # the same notice, arriving twice: no exception
    now[0] += StopSignals.REPEAT_S
    with pytest.raises(Interrupted) as stopped:
        stop._handle(signal.SIGINT, None)
    assert stopped.value.code == 128 + signal.SIGINT
