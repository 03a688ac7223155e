"""bench/gpu_session.sh: sections in priority order under one deadline; a section that would not finish in the time
left is skipped with one line, a hung one is stopped at its cap, and the summary, results and state say so."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_session.py"


@pytest.fixture
def gs(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("gpu_session", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_session", module)  # its dataclasses look their module up while defined
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "CACHE", tmp_path / "cache")
    return module


def _section(gs, name, code, estimate, part="first"):
    """A section whose smoke command runs `code` in Python, {json} its JSON path."""
    cmd = (sys.executable, "-c", code, "{json}")
    return gs.Section(name, f"test section {name}", cmd, cmd, estimate, estimate, part)


WRITE = "import json, sys; json.dump({'value': 7}, open(sys.argv[1], 'w'))"


def test_deadlines_skip_and_stop(gs, tmp_path):
    out = tmp_path / "out"
    state = tmp_path / "cache" / "state.json"
    session = gs.Session(out, budget=gs.MARGIN + 8, smoke=True, part="first", state_path=state)
    sections = [
        _section(gs, "quick", WRITE, 1),
        _section(gs, "broken", "import sys; print('boom'); sys.exit(3)", 1),
        _section(gs, "big", WRITE, 60),  # would not finish: skipped, never started
        _section(gs, "hangs", "import time; time.sleep(60)", 0.5),  # cap 2 x 0.5 + 30 s > time left: stops at the left
    ]
    results = [session.run(s) for s in sections]
    assert [r.status for r in results] == ["ran", "failed", "skipped", "failed"]
    assert results[1].why == "exit status 3"
    assert results[2].why.startswith("needs ~60 s, ") and results[2].seconds == 0
    assert results[3].why.startswith("stopped at its cap")
    assert results[3].seconds < 10  # stopped at the deadline, not after its minute of sleep

    summary = (out / "summary.txt").read_text().splitlines()
    assert summary[0].startswith("part first (smoke): 4 sections")
    assert [line.split()[:2] for line in summary[1:]] == [["quick", "ran"], ["broken", "failed"],
                                                          ["big", "skipped"], ["hangs", "failed"]]
    results_json = json.loads((out / "results.json").read_text())
    assert results_json["results"] == {"quick": {"value": 7}}  # the JSON each section wrote, by section
    assert json.loads((out / "state.json").read_text())["big"]["status"] == "skipped"
    log = (out / "session.log").read_text()
    assert "===== broken" in log and "boom" in log

    # the second part runs what the first skipped (and nothing it ran or saw fail), from the state it left
    second = gs.Session(out, budget=60, smoke=True, part="second", state_path=state)
    second.state["sections"] = {"env": {"status": "ran"}, "qwen35": {"status": "ran"}, "tests": {"status": "failed"},
                                "suite": {"status": "skipped"}}
    planned = [s.name for s in gs.plan("second", None, second.state)]
    assert planned[0] == "suite" and "env" not in planned and "tests" not in planned
    assert planned == [s.name for s in gs.SECTIONS][3:]
    # without a state (a fresh machine): the sections of part "second", then the "later" ones
    assert [s.name for s in gs.plan("second", None, {})] == [s.name for s in gs.SECTIONS if s.part != "first"]
    assert [s.name for s in gs.plan("first", ["loss", "env"], {})] == ["loss", "env"]


def test_priority_order_and_estimates(gs):
    """Issue 42's order: Qwen3.5 and the GPU tests, the suite with its failures named, decoding (the first
    command); the loss head, fp8, attention by length (the second); the sections measured before only after them.
    Each command's sections fit its budget by their estimates, which fit the 8- and 5-minute commands."""
    names = [s.name for s in gs.SECTIONS]
    assert names[:8] == ["env", "qwen35", "tests", "suite", "decode", "loss", "fp8", "attnlen"]
    parts = [s.part for s in gs.SECTIONS]
    assert parts[:5] == ["first"] * 5 and parts[5:8] == ["second"] * 3 and set(parts[8:]) == {"later"}
    for part in ("first", "second"):
        assert sum(s.estimate for s in gs.SECTIONS if s.part == part) <= gs.BUDGET[part] - gs.MARGIN, part
    assert gs.BUDGET["first"] <= 8 * 60 and gs.BUDGET["second"] <= 5 * 60
    # the suite and the tests name their failures and bound each test; the smoke commands never ask for CUDA
    for name in ("qwen35", "tests", "suite"):
        gpu = gs.BY_NAME[name].gpu
        assert gpu[:4] == (gs.PY, "-m", "pytest", "-v") and "-rf" in gpu
    assert "tests/test_qwen3_5_gpu.py" in gs.BY_NAME["qwen35"].gpu
    assert "--ignore" in gs.BY_NAME["tests"].gpu and "not gpu" in gs.BY_NAME["suite"].gpu
    assert "1,8,32" in gs.BY_NAME["decode"].gpu
    for section in gs.SECTIONS:
        assert "cuda" not in section.smoke, section.name
        assert section.smoke_estimate < section.estimate or section.name == "moe", section.name


def test_pytest_flags_follow_the_plugins(gs, monkeypatch):
    """--timeout and -n only where pytest-timeout and xdist import (else pytest would refuse the flags)."""
    have: set[str] = set()
    monkeypatch.setattr(gs.importlib.util, "find_spec", lambda name: object() if name in have else None)
    bare = gs._pytest("tests", timeout=90, workers=3, dist="loadfile")
    assert "--timeout" not in bare and "-n" not in bare and bare[-1] == "tests"
    have |= {"pytest_timeout", "xdist"}
    full = gs._pytest("tests", timeout=90, workers=3, dist="loadfile")
    assert full[full.index("--timeout") + 1] == "90" and full[full.index("-n") + 1] == "3"
    assert full[full.index("--dist") + 1] == "loadfile"


def test_smoke_through_the_shell_script(tmp_path):
    """The real entry point on CPU: two sections through bash, one skipped for want of time."""
    out = tmp_path / "out"
    run = subprocess.run(["bash", str(ROOT / "bench" / "gpu_session.sh"), "first", "env,decode", "--smoke",
                          "--budget", "40", "--estimate", "decode=500"],
                         capture_output=True, text=True, env={**_env(), "OUT": str(out)}, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = (out / "summary.txt").read_text().splitlines()
    assert lines[1].split()[:2] == ["env", "ran"]
    assert lines[2].split()[:2] == ["decode", "skipped"] and "needs ~500 s" in lines[2]
    env = json.loads((out / "results.json").read_text())["results"]["env"]["env"]
    assert env["matmul_peak_tflops"] > 0 and env["copy_tb_per_s"] > 0
    assert sorted(p.name for p in out.iterdir()) == ["results.json", "session.log", "state.json", "summary.txt"]


def _env():
    import os

    return {k: v for k, v in os.environ.items() if k != "OUT"}


def test_gpt_oss_sections_smoke(monkeypatch, tmp_path):
    """The gpt-oss and sinks sections' smoke commands, in this process (torch and transformers imported once): zoo's
    loss equals transformers' on every variant before timing, every row is timed, and sinks and softcap are rows."""
    spec = importlib.util.spec_from_file_location("gpu_session", SCRIPT)
    gs = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_session", gs)
    spec.loader.exec_module(gs)
    bench_path = ROOT / "bench" / "bench_gpt_oss.py"
    bspec = importlib.util.spec_from_file_location("bench_gpt_oss", bench_path)
    bench = importlib.util.module_from_spec(bspec)
    monkeypatch.syspath_prepend(str(bench_path.parent))
    bspec.loader.exec_module(bench)
    results = {}
    threads = torch.get_num_threads()  # the bench sets its own: later tests' bit-exact runs assume the suite's
    try:
        for name in ("gpt-oss", "sinks"):
            smoke = gs.BY_NAME[name].smoke
            assert smoke[1] == "bench/bench_gpt_oss.py" and "cuda" not in smoke
            out = tmp_path / f"{name}.json"
            assert bench.main([str(out) if a == "{json}" else a for a in smoke[2:]]) == 0
            results[name] = json.loads(out.read_text())
    finally:
        torch.set_num_threads(threads)
        bench.moe.pick_kernel = bench.PICK_KERNEL
    for part in ("layer", "step"):
        rows = results["gpt-oss"][part]["rows"]
        assert set(rows) == {"zoo_sdpa", "zoo_padded", "hf_eager_eager", "hf_eager_grouped_mm"}, part
        losses = [r["loss"] for r in rows.values()]
        assert max(losses) - min(losses) < 1e-4 * max(1.0, abs(losses[0])) and all(r["ms"] > 0 for r in rows.values())
    assert "sdpa" in results["gpt-oss"]["hf_attention_refused"]
    sinks = results["sinks"]["sinks"]["rows"]
    assert set(sinks) == {"eager", "sdpa"}
    for row in sinks.values():
        assert {"plain", "sinks", "softcap"} <= set(row) and all(row[m]["ms"] > 0 for m in ("sinks", "softcap"))
