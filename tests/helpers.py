"""The bodies several test files share: zoo's packed forward against each document alone through transformers
(logits, loss, gradients). The tolerances are the product's: fp32 logits within 1e-4, losses within 1e-5, gradients
within a relative 1e-5 unless a family says why its own differs."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from conftest import prefixed
from torch.overrides import TorchFunctionMode


def transformers_reference(hf, docs: list[torch.Tensor], routers: bool = False):
    """transformers' model `hf` on each document alone: (logits per document, the token-weighted mean next-token
    loss, its gradients by parameter name) and, with `routers`, the router logits per document and sparse layer
    as a fourth item. With `routers` the loss is the cross-entropy of the logits (transformers' own loss would hold
    the balancing loss); without, transformers' loss over labels. `hf`'s gradients are left cleared."""
    hf.zero_grad(set_to_none=True)
    logits, router_logits, count = [], [], 0
    total: Any = 0.0  # a tensor once a document adds to it
    for d in docs:
        n = d.numel() - 1
        if routers:
            out = hf(d[None], output_router_logits=True)
            router_logits.append([r.detach() for r in out.router_logits])
            if n:
                total, count = total + F.cross_entropy(out.logits[0, :-1], d[1:], reduction="sum"), count + n
        else:
            out = hf(d[None], labels=d[None])
            if n:
                total, count = total + out.loss * n, count + n
        logits.append(out.logits[0].detach())
    loss = total / count
    loss.backward()
    grads = {name: p.grad.clone() for name, p in hf.named_parameters() if p.grad is not None}
    hf.zero_grad(set_to_none=True)
    return (logits, loss.detach(), grads, router_logits) if routers else (logits, loss.detach(), grads)


class Fp64Throughout(TorchFunctionMode):
    """transformers' fp64 copy of a model kept in fp64 where its code casts to fp32: Qwen3.5's chunked delta rule
    (`.to(torch.float32)` of q, k, v, g, beta), its RMSNorms and its softmax cast an fp64 tensor down, so a plain
    `.double()` copy still rounds those in fp32 (and shares that rounding with transformers' fp32 run). Inside this
    mode any op given an fp64 tensor gets float64 wherever it asked for float32, and `.float()` of an fp64 tensor is
    the tensor: transformers' own code then runs in fp64 end to end, the truth fp32 runs are measured from."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(isinstance(a, torch.Tensor) and a.dtype == torch.float64 for a in (*args, *kwargs.values())):
            if func is torch.Tensor.float:
                return args[0]
            args = tuple(torch.float64 if a is torch.float32 else a for a in args)
            kwargs = {k: torch.float64 if v is torch.float32 else v for k, v in kwargs.items()}
        return func(*args, **kwargs)


def transformers_reference_fp64(hf, docs: list[torch.Tensor], routers: bool = False):
    """transformers_reference of an fp64 copy of `hf` run in fp64 throughout (Fp64Throughout); its experts, where
    it has any, by the eager loop (its grouped_mm takes no fp64)."""
    import copy

    hf64 = copy.deepcopy(hf).double()
    if hasattr(hf64, "set_experts_implementation"):
        hf64.set_experts_implementation("eager")
    with Fp64Throughout():
        return transformers_reference(hf64, docs, routers=routers)


def save_randomized(model, path: Path, seed: int):
    """transformers' `model` with its norm weights and biases moved off their init (_tiny_families.randomize with
    `seed`), in eval mode with eager attention, saved to `path` (save_pretrained); returned."""
    import _tiny_families

    model = _tiny_families.randomize(model, seed).eval()
    model.config._attn_implementation = "eager"
    model.save_pretrained(path)
    return model


def tiny_checkpoints(root: Path, save: Callable[..., Any], variants: Mapping[str, dict]) -> dict[str, tuple[Any, Path]]:
    """name -> (transformers model, its directory root/name) of each of `variants`: save(root / name, seed=its
    index, **its options)."""
    return {name: (save(root / name, seed=i, **variants[name]), root / name) for i, name in enumerate(variants)}


def hf_names(model) -> dict[str, str]:
    """zoo parameter name -> transformers' name, through the family's export plan (a pure rename for the families
    that use this: every tensor one source, no combining)."""
    from zoo.models import FAMILIES

    names = [n for n, _ in model.named_parameters()]
    plan = FAMILIES[model.family].plan_to_hf(model.config, names)
    assert all(fn is None and len(srcs) == 1 for srcs, fn in plan.values()), model.family
    out = {srcs[0]: hf_name for hf_name, (srcs, _) in plan.items()}
    assert sorted(out) == sorted(names)
    return out


def hf_rows(model) -> dict[str, tuple[str, int, int]]:
    """zoo parameter name -> (transformers' name, first row, rows), through the family's export plan: a fused tensor
    (Phi-3's qkv_proj, gate_up_proj) is its sources' rows one after another."""
    from zoo.models import FAMILIES

    params = dict(model.named_parameters())
    out = {}
    for hf_name, (srcs, _) in FAMILIES[model.family].plan_to_hf(model.config, list(params)).items():
        row = 0
        for s in srcs:
            out[s] = (hf_name, row, params[s].shape[0])
            row += params[s].shape[0]
    return out


def random_docs(lens: Sequence[int], vocab: int = 128, seed: int = 2) -> list[torch.Tensor]:
    """Documents of `lens` tokens, uniform over the vocabulary, from a generator seeded with `seed`."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g) for n in lens]


def assert_packed_logits(model, packed, ref_logits: list[torch.Tensor], backends, where: str) -> None:
    """One packed forward per backend: every document's rows equal its logits alone (atol and rtol 1e-4)."""
    cu = packed.cu_seqlens.tolist()
    for backend in backends:
        model.set_attention(backend)
        with torch.no_grad():
            logits = model(packed)
        for i, ref in enumerate(ref_logits):
            torch.testing.assert_close(logits[cu[i]:cu[i + 1]], ref, atol=1e-4, rtol=1e-4,
                                       msg=prefixed(f"{where} {backend} doc {i}"))


def assert_packed_loss_and_grads(model, packed, ref_loss: torch.Tensor, ref_grads: dict[str, torch.Tensor],
                                 names: Mapping[str, str | tuple[str, int, int]], backends, where: str,
                                 grad_rel: float = 1e-5, upstream: dict[str, torch.Tensor] | None = None) -> None:
    """Per backend: model.loss(packed) within 1e-5 of `ref_loss`, and every parameter's gradient within `grad_rel`
    (relative, in norm) of `ref_grads[names[zoo name]]`, which is not zero; a name given as (name, first row, rows)
    (hf_rows) compares those rows of the fused tensor. With `upstream` (transformers' own fp32 gradients, `ref_grads`
    then being its fp64 ones), a gradient may be as far from fp64 as transformers' fp32 one is, where that is more."""
    for backend in backends:
        model.set_attention(backend)
        model.zero_grad(set_to_none=True)
        loss = model.loss(packed)
        loss.backward()
        assert abs(loss.item() - ref_loss.item()) < 1e-5, (backend, loss.item(), ref_loss.item())
        for zoo_name, p in model.named_parameters():
            target = names[zoo_name]
            name, rows = (target, slice(None)) if isinstance(target, str) else (target[0], slice(target[1],
                                                                                                 target[1] + target[2]))
            ref = ref_grads[name][rows]
            rel = ((p.grad - ref).norm() / ref.norm()).item()
            bound = grad_rel
            if upstream is not None:
                bound = max(grad_rel, ((upstream[name][rows] - ref).norm() / ref.norm()).item())
            assert ref.norm() > 0 and rel < bound, (f"{where} {backend} grad {zoo_name}: relative error {rel:.2e} "
                                                    f"(bound {bound:.2e})")


def assert_fused_parity(hf, path: Path, docs: list[torch.Tensor], family: str, backends, train_backends,
                        where: str) -> None:
    """zoo's checkpoint `path` (eager, of `family`) against the transformers model `hf` it was saved from, on `docs`
    packed: the logits per backend in `backends` (assert_packed_logits), and per backend in `train_backends` the
    loss and every gradient (assert_packed_loss_and_grads), a fused tensor's gradient by its sources' rows
    (hf_rows), which name every transformers parameter."""
    import zoo

    ref_logits, ref_loss, ref_grads = transformers_reference(hf, docs)
    model = zoo.load(path, attn="eager")
    assert model.family == family
    packed = zoo.pack(docs)
    assert_packed_logits(model, packed, ref_logits, backends, where)

    to_hf = hf_rows(model)
    assert {h for h, _, _ in to_hf.values()} == set(ref_grads)
    assert_packed_loss_and_grads(model, packed, ref_loss, ref_grads, to_hf, train_backends, where)


def assert_refused_in_one_line(read: Callable[[dict], Any], config: dict, words: str | Sequence[str]) -> None:
    """read(config) raises a ZooError whose message is one line holding `words` (each of them, given several)."""
    import pytest

    from zoo.errors import ZooError

    with pytest.raises(ZooError) as e:
        read(config)
    message = str(e.value)
    assert "\n" not in message and all(w in message for w in ([words] if isinstance(words, str) else words)), message


def assert_near_uniform(losses: list[float], vocab: int, tol: float = 0.5) -> None:
    """A fresh model's losses, a few steps in: within `tol` of ln(vocab), the cross-entropy of a uniform guess
    (the tiny random checkpoints here start 0.2 to 0.4 above it). NaN, a loss of 0 or a runaway one fails."""
    uniform = math.log(vocab)
    assert all(abs(x - uniform) < tol for x in losses), f"losses {losses}, ln({vocab}) = {uniform:.3f}"


def pretrain_exports_what_transformers_loads(base: Path, out: Path, hf_class, docs: list[torch.Tensor],
                                             atol: float) -> list[float]:
    """recipes.pretrain from the Hugging Face directory `base` (given the bundled 2048-token tokenizer), 2 steps
    with --export-hf into `out`: every weight moves, OUT/model keeps the architecture, and OUT/model-hf loads in
    transformers as `hf_class`, nothing missing or unexpected, with OUT/model's logits on `docs` (within `atol`).
    Returns the recipe's losses."""
    import shutil

    from transformers import AutoModelForCausalLM

    import zoo
    from recipes import pretrain
    from recipes.data.tokenizer_choice import ASSETS

    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ASSETS / f, base / f)
    got = pretrain.main(["--model", str(base), "--steps", "2", "--export-hf", "--seq-len", "64",
                         "--batch-tokens", "128", "--no-progress", "--device", "cpu", "--save-every", "0",
                         "--out", str(out)])
    assert len(got) == 2, got
    assert_near_uniform(got, 2048)
    before, after = zoo.load(base), zoo.load(out / "model")
    assert after.config == before.config
    for (name, a), b in zip(before.state_dict().items(), after.state_dict().values(), strict=True):
        assert not torch.equal(a, b), name
    hf, info = AutoModelForCausalLM.from_pretrained(out / "model-hf", dtype=torch.float32, output_loading_info=True,
                                                    attn_implementation="eager")
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert type(hf) is hf_class
    packed = zoo.pack(docs)
    cu = packed.cu_seqlens.tolist()
    with torch.no_grad():
        ours = after.eval()(packed)
        for i, doc in enumerate(docs):
            torch.testing.assert_close(ours[cu[i]:cu[i + 1]], hf(input_ids=doc[None]).logits[0], atol=atol, rtol=0)
    return got


def adamw_steps(model, packed, steps: int = 3, lr: float = 2e-2) -> list[float]:
    """`steps` AdamW steps of model.loss(packed) over the parameters that train (a LoRA's adapters); the losses."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = model.loss(packed)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def hf_greedy(hf, prompt: torch.Tensor, max_new: int, **options: Any) -> list[int]:
    """transformers' greedy generate on `prompt` alone, `max_new` new tokens (pad id 0; `options` go to generate,
    such as eos_token_id); the new tokens."""
    out = hf.generate(input_ids=prompt[None], attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                      max_new_tokens=max_new, do_sample=False, pad_token_id=0, **options)
    return out[0, len(prompt):].tolist()


def export_lora(model, lora, path: Path, tmp_path: Path) -> tuple[Any, Path]:
    """recipes.engine.export's adapter of the LoRA `model` (its config `lora`, base checkpoint `path`) into
    `tmp_path`, the plain model to name it built on the meta device: (that plain model, the adapter's directory)."""
    from recipes.engine.export import export_adapter
    from zoo.models import FAMILIES
    from zoo.train.lora import shared_a

    with torch.device("meta"):
        plain: Any = FAMILIES[model.family].build(model.config, "eager")  # a Decoder or Llava
    out = export_adapter(tmp_path, str(path), plain, model.state_dict(), lora, shared_a(model))
    assert out is not None
    return plain, out


def assert_adapter_logits(model, peft_model, base, packed, docs: list[torch.Tensor], where: Any = "") -> None:
    """The LoRA `model`'s packed logits, in eval mode, within 1e-5 of PEFT's `peft_model` on each document alone,
    and those at least 1e-3 from the `base` transformers model's somewhere in every document (the adapter
    matters)."""
    model.eval()
    cu = packed.cu_seqlens.tolist()
    with torch.no_grad():
        mine = model(packed)
        for i, doc in enumerate(docs):
            theirs = peft_model(input_ids=doc[None]).logits[0]
            assert (mine[cu[i]:cu[i + 1]] - theirs).abs().max() < 1e-5, (where, i)
            assert (theirs - base(input_ids=doc[None]).logits[0]).abs().max() > 1e-3, (where, i)


def convert_round_trip(src: Path, tmp_path: Path, model_type: str, hf_class, original=None,
                       keys: Sequence[str] = ()):
    """convert.hf_to_zoo of the Hugging Face directory `src` into tmp_path/zoo, then convert.zoo_to_hf into
    tmp_path/hf: the same tensor names, every tensor with its bits and dtype; the written config.json names
    `model_type` and `hf_class`, and transformers loads the export as `hf_class` with nothing missing, unexpected or
    mismatched. Given the `original` transformers model, the export's config has its values of `keys` and the
    converted zoo checkpoint's config is `src`'s. Returns the export's tensors and the model transformers loaded."""
    import json

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from convert import hf_to_zoo, zoo_to_hf

    assert hf_to_zoo.main([str(src), str(tmp_path / "zoo"), "--quiet"]) is None  # type: ignore[func-returns-value]
    assert zoo_to_hf.main([str(tmp_path / "zoo"), str(tmp_path / "hf"), "--quiet"]) is None  # type: ignore[func-returns-value]
    a, b = load_file(src / "model.safetensors"), load_file(tmp_path / "hf" / "model.safetensors")
    assert a.keys() == b.keys()
    for n in a:
        assert a[n].dtype == b[n].dtype and torch.equal(a[n], b[n]), n
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (written["model_type"], written["architectures"]) == (model_type, [hf_class.__name__])
    again, info = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True,
                                                       attn_implementation="eager")
    assert not any(info.values()), info
    assert type(again) is hf_class
    if original is not None:
        import zoo

        for key in keys:
            assert getattr(again.config, key) == getattr(original.config, key), key
        assert zoo.load(tmp_path / "zoo").config == zoo.load(src).config
    return b, again
