"""Peak memory of converting a Mixture-of-Experts checkpoint both ways: the per-expert Hugging Face tensors stacked
into zoo's (hf_to_zoo) and split back (zoo_to_hf), against the checkpoint's size and one layer's experts.

A Qwen3-MoE of about 3.4 GB in bf16 (16 layers, 64 experts of 512 on a width of 1024) is saved by transformers'
Qwen3MoeForCausalLM (one tensor per expert, as the hub has them); each converter runs in its own process with
--shard-size 0.25 (the writer holds at most one shard), and its peak anonymous memory and resident set are sampled from
/proc. The round trip is checked bit for bit on a sample of tensors.

    python bench/bench_convert_moe.py [--layers 16] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def make_checkpoint(path: Path, layers: int) -> int:
    """Save the model; returns its bytes on disk."""
    import transformers

    cfg = transformers.Qwen3MoeConfig(hidden_size=1024, num_hidden_layers=layers, num_attention_heads=8,
                                      num_key_value_heads=2, head_dim=128, intermediate_size=2048,
                                      moe_intermediate_size=512, num_experts=64, num_experts_per_tok=8,
                                      vocab_size=32000, norm_topk_prob=True)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = transformers.Qwen3MoeForCausalLM(cfg)
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    model.save_pretrained(path, max_shard_size="1GB")
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def run_peak(*argv: str) -> tuple[int, int, float]:
    """(peak anonymous memory, peak resident set, seconds) of one converter process, sampled from /proc every 5 ms.
    The resident set counts the checkpoint's memory-mapped pages the process has touched, which the kernel may drop
    at will (page cache); the anonymous memory is what the converter itself holds."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", *argv, "--shard-size", "0.25", "--quiet"], cwd=ROOT)
    anon = rss = 0
    while proc.poll() is None:
        try:
            status = Path(f"/proc/{proc.pid}/status").read_text()
        except OSError:
            break
        fields = {line.split(":")[0]: line.split()[1] for line in status.splitlines() if line.startswith(("Rss",
                                                                                                          "VmRSS"))}
        anon = max(anon, int(fields.get("RssAnon", 0)) * 1024)
        rss = max(rss, int(fields.get("VmRSS", 0)) * 1024)
        time.sleep(0.005)
    if proc.wait() != 0:
        raise SystemExit(f"{argv[0]} failed")
    return anon, rss, time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--json")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        hf, zoo_dir, back = Path(tmp) / "hf", Path(tmp) / "zoo", Path(tmp) / "back"
        size = make_checkpoint(hf, args.layers)
        layer_experts = 64 * 3 * 1024 * 512 * 2
        to_zoo = run_peak("convert.hf_to_zoo", str(hf), str(zoo_dir))
        to_hf = run_peak("convert.zoo_to_hf", str(zoo_dir), str(back))
        from safetensors import safe_open

        def tensors(d: Path) -> dict[str, Path]:
            out = {}
            for f in d.glob("*.safetensors"):
                with safe_open(str(f), "pt") as h:
                    out.update({k: f for k in h.keys()})
            return out

        a, b = tensors(hf), tensors(back)
        assert a.keys() == b.keys(), "the round trip changed the tensor names"
        for name in sorted(a)[:: max(1, len(a) // 200)]:
            with safe_open(str(a[name]), "pt") as x, safe_open(str(b[name]), "pt") as y:
                assert torch.equal(x.get_tensor(name), y.get_tensor(name)), name
    gib = 2**30
    print(f"checkpoint {size / gib:.2f} GiB ({len(a)} tensors); one layer's experts {layer_experts / gib:.2f} GiB; "
          f"writer shards 0.25 GiB")
    for what, (anon, rss, s) in (("hf_to_zoo (stack)", to_zoo), ("zoo_to_hf (split)", to_hf)):
        print(f"{what:<20} peak anonymous {anon / gib:.2f} GiB, resident {rss / gib:.2f} GiB (mapped pages "
              f"included)  {s:.1f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"checkpoint_bytes": size, "layer_expert_bytes": layer_experts,
                                               "hf_to_zoo": to_zoo, "zoo_to_hf": to_hf}))


if __name__ == "__main__":
    main()
