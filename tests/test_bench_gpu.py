"""bench/bench_gpu.py --smoke: every section runs at tiny shapes on CPU, and what it measures is sane."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "bench_gpu.py"


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """One --smoke run of every section both tests check (the default ones, then fp8 and attnlen), in this process
    rather than a fresh one: torch and transformers are imported once, and the loss section runs once for both."""
    spec = importlib.util.spec_from_file_location("bench_gpu", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "bench_gpu", bench)  # its dataclasses look their module up while defined
        spec.loader.exec_module(bench)
        out = tmp_path_factory.mktemp("bench_gpu") / "smoke.json"
        code = bench.main(["--smoke", "--device", "cpu", "--only", ",".join([*bench.DEFAULT, "fp8", "attnlen"]),
                           "--out", str(out)])
    res = json.loads(out.read_text())
    assert code == 0, {name: res[name]["error"] for name in res if isinstance(res[name], dict) and "error" in res[name]}
    return res


def test_smoke_run(smoke):
    res = smoke
    for section in ("env", "correct", "loss", "step", "long", "attn", "lora"):
        assert "error" not in res[section], (section, res[section].get("error"))
    assert res["env"]["matmul_peak_tflops"] > 0

    rows = res["correct"]["rows"]
    # transformers fed a pack through position_ids computes the same function as zoo: documents isolated
    assert rows["transformers fp64 packed"]["logits"] < 1e-6
    hf = rows["transformers bfloat16 packed sdpa"]
    zoo_rows = {k: v for k, v in rows.items() if k.startswith("zoo")}
    assert len(zoo_rows) == 2
    for row in zoo_rows.values():  # bf16 error: small, and no worse than transformers' by more than noise
        assert 1e-4 < row["logits"] < 3e-2 and 1e-4 < row["grads"] < 5e-2, row
        assert row["logits"] < 1.5 * hf["logits"] and row["grads"] < 1.5 * hf["grads"], (row, hf)

    loss_rows = res["loss"]["64"]["rows"]
    for name in ("zoo", "zoo eager softmax", "zoo compiled softmax", "naive", "naive compiled"):
        assert loss_rows[name]["loss_err"] < 1e-3 and loss_rows[name]["grad_w_err"] < 1e-2, (name, loss_rows[name])
    assert "skipped" in loss_rows["liger"] and "skipped" in loss_rows["cut cross-entropy"]

    steps = res["step"]["rows"]
    losses = {name: row["loss"] for name, row in steps.items()}
    assert len(losses) == 3 and max(losses.values()) - min(losses.values()) < 1e-2, losses
    for row in steps.values():
        assert row["ms"] > 0 and row["tflops"] > 0 and 0 < row["mfu"]
    assert res["step"]["flops"] > 0
    long_rows = res["long"]["rows"]
    assert abs(long_rows["zoo sdpa (= auto) packed"]["loss"]
               - long_rows["transformers one document at a time"]["loss"]) < 1e-2
    assert res["long"]["huge"]["fits"]
    for part in ("short", "long"):
        for row in res["attn"][part]["rows"].values():
            assert row["out_err"] < 1e-2 and row["ms"] > 0
    lora = res["lora"]["rows"]  # B starts at zero: every row computes the base model's loss
    qlora = {"zoo QLoRA, NF4 base"} if importlib.util.find_spec("torchao") else set()  # QLoRA needs torchao
    assert set(lora) == {"zoo LoRA, bf16 base", "transformers + PEFT LoRA packed sdpa"} | qlora
    assert abs(lora["zoo LoRA, bf16 base"]["loss"] - lora["transformers + PEFT LoRA packed sdpa"]["loss"]) < 1e-2
    assert all(row["ms"] > 0 and row["weights_gib"] > 0 for row in lora.values()), lora


def test_smoke_fp8_attnlen_loss_targets(smoke):
    """The sections the next GPU session adds, on CPU: fp8 refused in one line and its training path run with
    torchao's emulated fp8 products (losses close to bf16's); attnlen's packs and auto's choice; the loss targets
    (None where Liger and Cut Cross-Entropy cannot run)."""
    res = smoke
    for section in ("loss", "fp8", "attnlen"):
        assert "error" not in res[section], (section, res[section].get("error"))
    targets = res["loss"]["64"]["targets"]
    assert targets["three_gemms_ms"] > 0 and targets["ms_vs_liger"] is None and targets["extra_memory_vs_cce"] is None
    assert targets["met"] == {"faster_than_liger": None, "memory_within_2x_cce": None, "errors_within_liger": None}

    fp8 = res["fp8"]
    assert all(why.startswith("fp8 training needs a CUDA GPU") for why in fp8["refusals"].values())
    rows = fp8["rows"]
    if importlib.util.find_spec("torchao"):
        assert set(rows) == {"bf16", "fp8 tensorwise", "fp8 rowwise"}
        for name in ("fp8 tensorwise", "fp8 rowwise"):
            assert rows[name]["converted"] == [14, 15], rows[name]  # every block linear, not the head
            assert rows[name]["within_noise"] and rows[name]["speedup"] > 0
            for a, b in zip(rows[name]["losses"], rows["bf16"]["losses"]):
                assert abs(a - b) < 0.01 * b
    assert rows["bf16"]["losses"][-1] < rows["bf16"]["losses"][0]  # it learns

    packs = res["attnlen"]["packs"]
    assert set(packs) == {"32", "64", "256"}
    for row in packs.values():
        assert row["auto_picks"] == "sdpa" and row["faster"] in ("sdpa", "eager")  # CPU: auto is sdpa
        assert all(r["ms"] > 0 for r in row["rows"].values())
