"""Before/after check for refactors: every family's logits, loss, gradients and greedy tokens, bit for bit.

    python tools/ab_snapshot.py save before.safetensors     # on the old code
    python tools/ab_snapshot.py save after.safetensors      # on the new code
    python tools/ab_snapshot.py compare before.safetensors after.safetensors

Each family's first preset shrunk to a tiny size (the same seed, weights and pack every run), run on every CPU
attention backend: a packed forward of three documents (logits), the loss and every parameter's gradient, and 6
greedily generated tokens. `compare` lists every tensor that is not bit-identical (and those only one side has).
"""

from __future__ import annotations

import dataclasses
import sys

import torch

import zoo
from zoo.core.attention import available_backends
from zoo.core.layers import init_weights
from zoo.generate import generate
from zoo.models import FAMILIES

TINY = dict(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=96, vocab_size=128, max_seq_len=256,
            n_experts=4, top_k=2, expert_ffn_dim=32, shared_expert_ffn_dim=48, linear_key_heads=2,
            linear_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, rotary_dim=8,
            sliding_window=5, query_pre_attn_scalar=16, n_group=1, topk_group=1)


def tiny(config):
    names = {f.name for f in dataclasses.fields(config)}
    if "language" in names:  # LLaVA: its language model shrunk; the vision tower is left out (text-only packs)
        return None
    change = {k: v for k, v in TINY.items() if k in names}
    if "layer_types" in names and config.layer_types:
        types = tuple(config.layer_types)
        pattern = tuple(dict.fromkeys(types))  # one of each kind, in first-seen order
        change["layer_types"] = (pattern * 4)[:4] if len(pattern) < 4 else pattern[:4]
    if "mlp_only_layers" in names:
        change["mlp_only_layers"] = ()
    if "qkv_multipliers" in names:  # OpenELM: per-layer heads and widths
        change = dict(dim=64, n_layers=2, head_dim=16, vocab_size=128, num_gqa_groups=2, n_heads=(), n_kv_heads=(),
                      ffn_dim=(), ffn_multipliers=(1.5, 2.0), ffn_dim_divisor=16, max_context_length=256,
                      rope_max_length=256)
        change = {k: v for k, v in change.items() if k in names}
    return dataclasses.replace(config, **change)


def families():
    seen = {}
    for name, preset in zoo.PRESETS.items():
        if name != "debug" and preset.family not in seen:
            seen[preset.family] = preset.config
    return seen


def snapshot() -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(0, 128, (n,), generator=g) for n in (7, 12, 3)]
    for fam, config in families().items():
        config = tiny(config)
        if config is None:
            continue
        for backend in available_backends("cpu"):
            torch.manual_seed(0)
            model = FAMILIES[fam].build(config, backend)
            init_weights(model, std=0.1)
            with torch.no_grad():
                gen = torch.Generator().manual_seed(1)
                for p in model.parameters():
                    if p.dim() == 1:
                        p.add_(torch.randn(p.shape, generator=gen) * 0.2)
            packed = zoo.pack(docs)
            key = f"{fam}.{backend}"
            with torch.no_grad():
                out[f"{key}.logits"] = model(packed)
            try:  # a backend without a CPU backward (flex) is checked on its forward only
                loss = model.loss(packed)
                loss.backward()
            except zoo.ZooError:
                loss = None
            if loss is not None:
                out[f"{key}.loss"] = loss.detach()
                for n, p in model.named_parameters():
                    if p.grad is not None:
                        out[f"{key}.grad.{n}"] = p.grad.detach().clone()
                model.zero_grad(set_to_none=True)
            with torch.no_grad():
                tokens = generate(model, [docs[0], docs[2]], max_new_tokens=6, stop=[])
            for i, t in enumerate(tokens):
                out[f"{key}.generate.{i}"] = t
    return {k: v.contiguous() for k, v in out.items()}


def main(argv: list[str]) -> int:
    from safetensors.torch import load_file, save_file

    if len(argv) == 2 and argv[0] == "save":
        snap = snapshot()
        save_file(snap, argv[1])
        print(f"{len(snap)} tensors of {len(families())} families -> {argv[1]}")
        return 0
    if len(argv) == 3 and argv[0] == "compare":
        a, b = load_file(argv[1]), load_file(argv[2])
        bad = [f"only in {argv[1]}: {k}" for k in sorted(a.keys() - b.keys())]
        bad += [f"only in {argv[2]}: {k}" for k in sorted(b.keys() - a.keys())]
        bad += [f"differs: {k} (max abs {(a[k].double() - b[k].double()).abs().max().item():.3g})"
                for k in sorted(a.keys() & b.keys())
                if a[k].shape != b[k].shape or not torch.equal(a[k], b[k])]
        print("\n".join(bad) if bad else f"bit-identical: {len(a.keys() & b.keys())} tensors")
        return 1 if bad else 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
