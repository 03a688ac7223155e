"""Qwen3.5 under sequence parallelism. Ulysses sends each Gated DeltaNet layer's q/k/v channels, beta and g from
tokens to heads, so every rank runs the convolution and the delta rule over whole documents for its heads; ring
(and hybrid's ring across Ulysses groups) runs each rank's pieces of documents, continued from the earlier pieces'
last conv inputs and state maps (zoo.parallel.carry). Over 2, 3 and 4 ranks (hybrid 2 x 2) the loss and every
gradient equal one process, in one spawn of 4 ranks."""

from __future__ import annotations

import json

import _qwen3_5_sp_worker
import _sp_worker


def test_sequence_parallel_equals_one_process(tmp_path):
    out = tmp_path / "report.json"
    _sp_worker.launch(_qwen3_5_sp_worker.main, 4, out)
    report = json.loads(out.read_text())
    assert "error" not in report, report["error"][1]
    assert sorted(report) == sorted(_qwen3_5_sp_worker.case_names()), report
    failures = [f"{c}: {detail}" for c, (ok, detail) in report.items() if not ok]
    assert not failures, "\n".join(failures)
