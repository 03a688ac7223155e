"""recipes.dpo over processes (torchrun, gloo, --device cpu) against one process: --dp 2, --sp 2 (pairs cut across
shards), --dp 2 --sp 2 on 4 processes (FSDP over all, the reference sharded too), and --sp 4 in ring mode. Two
steps at a learning rate that moves the weights, so the second step's numbers check the first step's gradients."""

import json
import os
import sys
from pathlib import Path

import pytest
from test_dpo import hf_checkpoint, write_pairs  # noqa: E402

from recipes import dpo

ROOT = Path(__file__).resolve().parents[1]
COMPARED = ("loss", "grad_norm", "rewards/chosen", "rewards/margins", "rewards/accuracies", "logps/chosen",
            "logps/rejected", "logits/chosen")
EVAL = ("eval_loss", "eval_rewards/margins", "eval_logps/chosen")  # after the last step (--eval-data: the pairs)


def env():
    e = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    e.pop("WORLD_SIZE", None)
    return e


def rows(out):
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("dpo_parallel")
    policy, ref = hf_checkpoint(root / "policy", 0), hf_checkpoint(root / "ref", 1)
    data = write_pairs(root / "pairs.jsonl", n=12)
    return root, policy, ref, data


def args(policy, ref, data, *extra):
    return ["--model", str(policy), "--ref-model", str(ref), "--data", str(data), "--steps", "2", "--seq-len", "64",
            "--batch-tokens", "256", "--lr", "1e-2", "--warmup", "0", "--no-progress", "--device", "cpu",
            "--save-every", "0", "--eval-data", str(data), *extra]


def torchrun(n, argv, out):
    import subprocess

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(n), "-m",
           "recipes.dpo", *argv, "--out", str(out)]
    run = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stderr[-3000:]


def assert_rows_equal(have, want, where):
    assert [r["step"] for r in have] == [r["step"] for r in want]
    bad = [f"step {a['step']} {k}: {a[k]!r} vs one process {b[k]!r}" for a, b in zip(have, want) for k in COMPARED
           if abs(a[k] - b[k]) > 1e-5 * max(1.0, abs(b[k]))]
    assert not bad, f"{where}:\n" + "\n".join(bad)
    assert all(a["pairs"] == b["pairs"] for a, b in zip(have, want))
    bad = [f"{k}: {have[-1][k]!r} vs one process {want[-1][k]!r}" for k in EVAL
           if abs(have[-1][k] - want[-1][k]) > 1e-5 * max(1.0, abs(want[-1][k]))]
    assert not bad, f"{where}, evaluation:\n" + "\n".join(bad)


# --sp 2 alone is inside --dp 2 --sp 2 (two SP groups of 2); kept out for the suite's time
@pytest.mark.parametrize("procs, flags", [(2, ["--dp", "2"]), (4, ["--dp", "2", "--sp", "2"]),
                                          (4, ["--sp", "4", "--sp-mode", "ring"])],
                         ids=["dp2-shared", "dp2-sp2", "sp4-ring"])
def test_processes_equal_one(setup, procs, flags):
    """Under --sp the pairs are two documents each (the shared-prompt layout is off there): the one process they
    are held against lays them out alike, so the steps hold the same packs."""
    root, policy, ref, data = setup
    shared = "--sp" not in flags and "--no-share-prompt" not in flags
    one = root / ("one-shared" if shared else "one")
    if not (one / "metrics.jsonl").is_file():
        dpo.main([*args(policy, ref, data), "--share-prompt" if shared else "--no-share-prompt", "--out", str(one)])
    out = root / "-".join(flags).replace("--", "")
    torchrun(procs, args(policy, ref, data, *flags), out)
    assert_rows_equal(rows(out), rows(one), " ".join(flags))


def test_one_step_of_every_pair_over_processes(setup):
    """--batch-tokens past the data: one step holds every pair once, dealt over 2 data-parallel ranks (a rank short
    of packs runs one at weight 0); the same as one process, precomputed reference included."""
    root, policy, ref, data = setup
    many = ["--batch-tokens", "65536", "--steps", "1", "--precompute-ref"]
    one = root / "all-one"
    dpo.main([*args(policy, ref, data, *many), "--out", str(one)])
    assert rows(one)[0]["pairs"] == 12
    torchrun(2, args(policy, ref, data, *many, "--dp", "2"), root / "all-dp2")
    assert_rows_equal(rows(root / "all-dp2"), rows(one), "--dp 2, every pair")
