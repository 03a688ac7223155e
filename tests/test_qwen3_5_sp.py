"""Qwen3.5 under sequence parallelism: Ulysses sends each Gated DeltaNet layer's q/k/v channels, beta and g from
tokens to heads, so every rank runs the convolution and the delta rule over whole documents for its heads; at 2
and 4 ranks the loss and every gradient equal one process. Ring (state passed from rank to rank) is refused."""

from __future__ import annotations

import json

import _qwen3_5_sp_worker
import _sp_worker


def test_ulysses_equals_one_process_and_ring_is_refused(tmp_path):
    out = tmp_path / "report.json"
    _sp_worker.launch(_qwen3_5_sp_worker.main, 4, out)
    report = json.loads(out.read_text())
    assert "error" not in report, report["error"][1]
    assert sorted(report) == ["ring refused", "sp2/ulysses", "sp4/ulysses"], report
    failures = [f"{c}: {detail}" for c, (ok, detail) in report.items() if not ok]
    assert not failures, "\n".join(failures)
