"""bench/bench_generate.py --smoke: zoo.generate's greedy tokens equal transformers' (batched and one prompt at a
time) and every timing row is sane."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "bench_generate.py"


def _bench(monkeypatch):
    # in this process rather than a fresh one: torch and transformers are imported once, the run takes seconds
    spec = importlib.util.spec_from_file_location("bench_generate", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_generate", bench)  # its dataclasses look their module up while defined
    spec.loader.exec_module(bench)
    return bench


def test_smoke_run(tmp_path, monkeypatch):
    bench = _bench(monkeypatch)
    out = tmp_path / "smoke.json"
    threads = torch.get_num_threads()
    assert bench.main(["--smoke", "--device", "cpu", "--threads", "1", "--out", str(out)]) == 0
    assert torch.get_num_threads() == threads  # the run gives the thread count back
    res = json.loads(out.read_text())
    new, lens = res["shape"]["new_tokens"], res["shape"]["prompt_lens"]
    tokens = res["tokens"]
    assert tokens["zoo_equal"] and tokens["all_equal"] and not res["failed"]
    for name in ("zoo", "transformers batched", "transformers static", "zoo vs transformers batched"):
        assert tokens[name] == [new] * len(lens), (name, tokens[name])
    for name, row in res["rows"].items():
        assert row["s"] > 0 and row["new_tokens_per_s"] > 0 and row["prefill_ms"] > 0, (name, row)
        assert row["x_transformers"] > 0 and "hbm_fraction" not in row, (name, row)  # no bandwidth bound on CPU
    assert res["rows"]["transformers batched"]["x_transformers"] == 1.0
    assert res["rows"]["transformers static"]["x_transformers_static"] == 1.0
    assert res["rows"]["transformers 1 by 1"]["decode_steps"] == len(lens) * (new - 1)
    assert "zoo compiled" not in res["rows"]


def test_smoke_run_compiled(tmp_path, monkeypatch):
    """--compile adds a "zoo compiled" row, its tokens checked like zoo's (aot_eager here: the same whole graph as
    inductor's, without its C++ build)."""
    monkeypatch.setattr(importlib.import_module("zoo.generate"), "COMPILE_BACKEND", "aot_eager")
    bench = _bench(monkeypatch)
    out = tmp_path / "smoke.json"
    assert bench.main(["--smoke", "--compile", "--device", "cpu", "--threads", "1", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    n = len(res["shape"]["prompt_lens"])
    new = res["shape"]["new_tokens"]
    assert res["tokens"]["zoo compiled"] == res["tokens"]["zoo compiled vs zoo"] == [new] * n
    assert res["tokens"]["zoo compiled 1 by 1"] == [new] * n  # batch 1, each prompt alone, compiled
    assert res["tokens"]["zoo_equal"] and not res["failed"]
    row = res["rows"]["zoo compiled"]
    assert row["s"] > 0 and row["x_transformers"] > 0 and row["decode_steps"] == new - 1
    single = res["rows"]["zoo compiled 1 by 1"]
    assert single["decode_steps"] == n * (new - 1) and single["x_transformers"] > 0


def test_smoke_batches(tmp_path, monkeypatch):
    """--batches: per batch size the fused path's greedy tokens equal the unfused path's (fp32), every row timed
    against transformers' static-cache decode; no HBM bound on CPU."""
    bench = _bench(monkeypatch)
    out = tmp_path / "dec.json"
    assert bench.main(["--smoke", "--device", "cpu", "--threads", "1", "--batches", "1,3", "--out", str(out)]) == 0
    res = json.loads(out.read_text())["decode"]
    new = res["new_tokens"]
    assert set(res["batches"]) == {"1", "3"} and not res["failed"]
    for b, part in res["batches"].items():
        assert part["fused_vs_unfused_equal"] == [new] * int(b)
        assert part["fused_vs_transformers"] == [new] * int(b)  # fp32: transformers' tokens too
        assert set(part["rows"]) == {"zoo fused", "zoo", "transformers static"}
        for row in part["rows"].values():
            assert row["decode_step_ms"] > 0 and row["decode_tokens_per_s"] > 0 and "hbm_fraction" not in row
        assert part["rows"]["transformers static"]["x_transformers_static"] == 1.0
    with pytest.raises(SystemExit):
        bench.main(["--smoke", "--batches", "0,x"])
