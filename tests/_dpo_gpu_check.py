"""The CUDA side of recipes.dpo, run by hand on a GPU machine (no pytest collection: the name starts with _):

    python tests/_dpo_gpu_check.py OUT_DIR

1. zoo.core.logprobs on CUDA: fp32 and bf16 weights (the GEMM writing fp32 where it can) against an fp64 log_softmax,
   sums and both gradients.
2. recipes.dpo, one step over every pair: CPU fp32 against CUDA fp32 (the same numbers) and CUDA bf16 (mixed
   precision, close), each with the shared prompt and with two documents.
Writes OUT_DIR/dpo_gpu.json and prints it.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import zoo  # noqa: E402
from recipes import dpo  # noqa: E402
from zoo.core import logprobs  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a smoke run of this script itself
KEYS = ("loss", "grad_norm", "rewards/chosen", "rewards/margins", "logps/chosen", "logps/rejected", "logits/chosen")


def logprob_check() -> dict[str, float]:
    torch.manual_seed(0)
    T, D, V = 300, 64, 1000
    lens = [50, 120, 130]
    packed = zoo.pack([torch.randint(0, V, (n,)) for n in lens]).to(DEV)
    h64 = torch.randn(T, D, dtype=torch.float64, device=DEV)
    w64 = torch.randn(V, D, dtype=torch.float64, device=DEV) * 0.1
    weights = torch.randn(3, dtype=torch.float64, device=DEV)
    out = {}
    for name, dtype in (("fp64", torch.float64), ("fp32", torch.float32), ("bf16", torch.bfloat16)):
        h = h64.to(dtype).requires_grad_(True)
        w = w64.to(dtype).requires_grad_(True)
        logp, _, _ = logprobs.sequence_logprobs(h, w, packed)
        gh, gw = torch.autograd.grad((logp.double() * weights).sum(), (h, w))
        hr = h.detach().double().requires_grad_(True)
        wr = w.detach().double().requires_grad_(True)
        labels = packed.require_labels()
        m = labels != -100
        doc = torch.repeat_interleave(torch.arange(3, device=DEV), torch.tensor(lens, device=DEV))[m]
        tok = torch.log_softmax(hr @ wr.T, -1)[m].gather(1, labels[m][:, None])[:, 0]
        want = torch.zeros(3, dtype=torch.float64, device=DEV).index_add(0, doc, tok)
        rh, rw = torch.autograd.grad((want * weights).sum(), (hr, wr))
        out[f"{name} sum max rel err"] = float(((logp.double() - want).abs() / want.abs()).max())
        out[f"{name} grad_h rel err"] = float((gh.double() - rh).norm() / rh.norm())
        out[f"{name} grad_w rel err"] = float((gw.double() - rw).norm() / rw.norm())
    return out


def recipe_check(tmp: Path) -> dict[str, object]:
    from test_dpo import hf_checkpoint, write_pairs

    policy, ref = hf_checkpoint(tmp / "policy", 0), hf_checkpoint(tmp / "ref", 1)
    data = write_pairs(tmp / "pairs.jsonl", n=24)
    runs: dict[str, dict[str, float]] = {}
    for device, dtype in (("cpu", "float32"), (DEV, "float32"), (DEV, "bfloat16")):
        for layout in ("--share-prompt", "--no-share-prompt"):
            name = f"{device}-{dtype}{layout.replace('--share-prompt', '-shared').replace('--no-share-prompt', '')}"
            t0 = time.perf_counter()
            dpo.main(["--model", str(policy), "--ref-model", str(ref), "--data", str(data), "--out", str(tmp / name),
                      "--steps", "1", "--seq-len", "256", "--batch-tokens", "65536", "--no-progress", "--lr", "1e-9",
                      "--grad-clip", "0", "--device", device, "--dtype", dtype, layout, "--force",
                      "--attn", "sdpa"])  # the tiny test model's head_dim 8 is below flex attention's minimum (16)
            row = json.loads((tmp / name / "metrics.jsonl").read_text().splitlines()[0])
            runs[name] = {k: row[k] for k in KEYS} | {"wall_s": time.perf_counter() - t0}
    base = runs["cpu-float32"]
    diffs = {name: max(abs(r[k] - base[k]) / max(1.0, abs(base[k])) for k in KEYS) for name, r in runs.items()}
    return {"runs": runs, "max rel diff vs cpu fp32": diffs}


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, object] = {"device": torch.cuda.get_device_name(0) if DEV == "cuda" else "cpu",
                                 "torch": torch.__version__}
    report["logprobs"] = logprob_check()
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        report["recipe"] = recipe_check(Path(tmp))
    text = json.dumps(report, indent=1)
    (out / "dpo_gpu.json").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
