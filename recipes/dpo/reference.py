"""The reference of recipes.dpo (a frozen model, the policy with its adapters off, or log-probs computed once
before training and kept beside the run) and the shared-prompt layout's attention."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from recipes.data.preference import PairPack, PreferenceData, TargetPlan
from recipes.data.tokenizer_choice import find_tokenizer
from recipes.dpo.config import DPOConfig
from recipes.dpo.losses import COMPLETION, NEEDS_REFERENCE, over_group, scorer
from recipes.engine.build import build_model, check_model, load_sharded, model_config, parallelize_model
from recipes.engine.processes import Dist
from zoo.core.attention import AttentionFn
from zoo.core.contract import AttentionSpec, GatedDeltaNetSpec, MLASpec
from zoo.core.packing import Packed
from zoo.errors import ZooError
from zoo.io.safetensors import save_safetensors
from zoo.models import FAMILIES, Model
from zoo.train.lora import lora_modules


@contextmanager
def adapters_off(model: Model) -> Iterator[None]:
    """The policy as its base: every LoRA update scaled by 0 (its output is then exactly the base's)."""
    modules = list(lora_modules(model).values())
    scales = [m.scale for m in modules]
    for m in modules:
        m.scale = 0.0
    try:
        yield
    finally:
        for m, s in zip(modules, scales):
            m.scale = s


class Reference:
    """The reference log-probs of a pack's pairs: a frozen model's forward, the policy's with adapters off, or a
    table computed before training (by pair index)."""

    def __init__(self, model: Model | None = None, policy: Model | None = None, table: Tensor | None = None):
        self.model, self.policy, self.table = model, policy, table
        self.run_model = self.model or self.policy
        self.score = None if self.run_model is None else scorer(self.run_model)

    def __call__(self, pairs: list[int], where: Tensor | TargetPlan, packed: Packed, d: Dist,
                 context: AbstractContextManager[object]) -> Tensor:
        """[pairs, 2] (chosen, rejected) completion log-prob sums."""
        if self.table is not None:
            return self.table[torch.tensor(pairs)].to(d.device)
        assert self.score is not None
        off = adapters_off(self.policy) if self.policy is not None else nullcontext()
        with torch.no_grad(), off, context:
            sums = self.score(where, packed)
        sums = over_group(sums, d)
        return sums[:, COMPLETION].view(-1, 2)


def prepared(data: PreferenceData, i: int, d: Dist) -> tuple[Packed, Tensor | TargetPlan]:
    """Pack i of `data` as this rank runs it (its shard under sequence parallelism), on the device, with what `score`
    needs beside it."""
    packed = data.in_order(i)
    if data.share_prompt:
        return packed.to(d.device), data.target_plan(i).to(d.device)
    prompt_T = torch.repeat_interleave(torch.tensor(data.prompt_lens(i)), torch.tensor(packed.seqlens()))
    if d.sequence_parallel is not None:
        packed = d.sequence_parallel.shard(packed)
        prompt_T = prompt_T[packed.index]
    return packed.to(d.device), prompt_T.to(d.device)


class SharedPromptAttention:
    """The attention of a shared-prompt pack (recipes.data.preference.PairPack): each pair's queries, keys and values
    gathered into its two documents, prompt + chosen and prompt + rejected, attended there by the model's own
    backend (so the rejected tokens see the prompt and themselves, never the chosen ones), and each token's output
    taken back. Only attention pays twice for the prompt; its projections, MLPs, norms and head run once. Any other
    pack goes to the backend as it is."""

    def __init__(self, inner: AttentionFn):
        self.inner = inner

    def __call__(self, q_TNH: Tensor, k_TKH: Tensor, v_TKH: Tensor, packed: Packed, **options: Any) -> Tensor:
        if not isinstance(packed, PairPack):
            return self.inner(q_TNH, k_TKH, v_TKH, packed, **options)
        e = packed.expand_E
        o_ENH = self.inner(q_TNH[e], k_TKH[e], v_TKH[e], packed.expanded, **options)
        return o_ENH[packed.take_T]

    @staticmethod
    def unwrap(attend: AttentionFn) -> AttentionFn | None:
        """The function a SharedPromptAttention wraps, None for any other: generation (the sample generations of
        --sample-every) runs without it, as its KV cache passes a positional `scale` this wrapper does not take."""
        return attend.inner if isinstance(attend, SharedPromptAttention) else None


# the mixers the shared-prompt layout runs: attention and latent attention (MLA: its keys and values expanded from
# the latents, then an ordinary attention call) through SharedPromptAttention, Gated DeltaNet following the pack's
# forks itself (each answer from the prompt's final state)
SHARES_PROMPT = (AttentionSpec, MLASpec, GatedDeltaNetSpec)


def no_shared_prompt(cfg: DPOConfig, d: Dist) -> str | None:
    """Why the shared-prompt layout cannot run here, or None when it can."""
    if d.sequence_parallel is not None:
        return "--sp cuts a pack across ranks, and the layout's attention gathers each pair whole"
    if cfg.parallel.compile:
        return "--compile: the gathering attention is not compiled yet"
    for name in dict.fromkeys((cfg.model.name, cfg.pref.ref_model or cfg.model.name)):
        config = model_config(replace(cfg.model, name=name))
        text = FAMILIES[config.family].text_config(config)  # a LLaVA's is its language model's: not run alone here
        layers = text.decoder_spec().layers
        if text is not config:
            return f"{name} is a vision-language model, whose packs the shared-prompt layout does not lay out"
        other = next((layer.mixer for layer in layers if not isinstance(layer.mixer, SHARES_PROMPT)), None)
        if other is not None:
            # a mixer that does not follow the pack's forks would run the segment's tokens in order: rejected after
            # chosen (attention's are gathered here, Gated DeltaNet's followed by the layer: zoo.core.forks)
            return f"{name} has {type(other).__name__.removesuffix('Spec')} layers, which the shared-prompt layout " \
                "does not run (attention, latent attention and Gated DeltaNet layers only)"
        scaling = getattr(config, "rope_scaling", None)
        if isinstance(scaling, dict) and scaling.get("type", scaling.get("rope_type")) == "dynamic":
            return f"{name} scales RoPE by the document's length, and a shared prompt belongs to two documents"
    return None


# ---- the reference: built, or computed once ----


def weights_fingerprint(path: str) -> str:
    """What a precomputed table's reference was: its directory's weight files, by name and size (or a preset)."""
    root = Path(path)
    files = sorted([p.name, p.stat().st_size] for p in root.glob("*.safetensors")) if root.is_dir() else path
    return hashlib.sha256(json.dumps([str(root.resolve()) if root.is_dir() else path, files]).encode()).hexdigest()


def precompute(d: Dist, reference: Reference, data: PreferenceData, context: AbstractContextManager[object]) -> Tensor:
    """[pairs, 2] the reference's completion log-prob sums of every pair: pack i on data-parallel rank i % dp (cut
    over its sp group), every rank running the same number of forwards (FSDP's gathers are collective)."""
    table = torch.zeros(len(data.pairs), 2, dtype=torch.float64, device=d.device)
    n = len(data)
    for k in range(-(-n // d.dp)):
        i = k * d.dp + d.dp_rank
        packed, where = prepared(data, i % n, d)
        sums = reference(data.pairs_in(i % n), where, packed, d, context)
        if i < n and d.sp_rank == 0:
            table[torch.tensor(data.pairs_in(i))] = sums.double()
    if dist.is_initialized():
        dist.all_reduce(table)
    return table.float().cpu()


def read_tables(path: Path, key: str, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Tensor] | None:
    """The tables at `path` (ref_logps, and eval_ref_logps for held-out pairs) if they were computed for `key` (the
    same pairs and reference), else None. A table computed for `key` but not of its shape in `shapes`, or holding a
    NaN, is refused: its log-probs would train every step silently wrong."""
    from safetensors import safe_open

    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as f:
            if (f.metadata() or {}).get("key") != key:
                return None
            tables = {name: f.get_tensor(name) for name in f.keys()}
    except Exception:  # a damaged file is computed again
        return None
    for name, shape in shapes.items():
        t = tables.get(name)
        got = "none" if t is None else f"{list(t.shape)} {t.dtype}"
        if t is None or tuple(t.shape) != shape or not t.is_floating_point():
            raise ZooError(f"{path}: expected {name} as {list(shape)} floats (a log-prob sum per pair, chosen and "
                           f"rejected), got {got}; remove the file to compute the table again")
        bad = int((~torch.isfinite(t)).sum())
        if bad:
            raise ZooError(f"{path}: expected finite log-probs in {name}, got {bad} NaN or infinite; remove the file "
                           "to compute the table again")
    return tables


def write_tables(path: Path, tables: dict[str, Tensor], key: str) -> None:
    """The tables to `path`, whole or not at all (a full disk: one line, no temporary file left)."""
    tmp = path.with_suffix(".tmp")
    try:
        save_safetensors({k: t.contiguous() for k, t in tables.items()}, tmp, metadata={"key": key})
        tmp.replace(path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise ZooError(f"{path}: reference log-probs not written ({e.strerror or e}); --precompute-ref computes "
                       "them again on --resume") from e


def reference_key(cfg: DPOConfig, data: PreferenceData, eval_data: PreferenceData | None, lora: bool) -> str:
    """What precomputed tables were computed from: the reference's weights, the pairs, the dtype."""
    ref = ("adapters-off:" if lora and cfg.pref.ref_model is None else "model:") + \
        weights_fingerprint(cfg.pref.ref_model or cfg.model.name)
    return f"{ref}|{data.fingerprint}|{eval_data.fingerprint if eval_data else ''}|{cfg.model.dtype}"


def build_reference(cfg: DPOConfig, d: Dist, model: Model, lora: bool, shared: bool) -> Reference | None:
    """The run's reference: None for SimPO and ORPO; the policy with its adapters off (LoRA without --ref-model);
    else --ref-model (or --model) loaded frozen, parallelized like the policy (and with `shared`, attending through
    SharedPromptAttention)."""
    if cfg.pref.loss not in NEEDS_REFERENCE:
        return None
    if lora and cfg.pref.ref_model is None:
        return Reference(policy=model)
    section = replace(cfg.model, name=cfg.pref.ref_model or cfg.model.name)
    check_model(section, cfg.data.seq_len, find_tokenizer(cfg.model.tokenizer, cfg.model.name))
    ref, on_meta = build_model(section, d, cfg.run.seed)
    ref.requires_grad_(False)
    parallelize_model(ref, d, section, replace(cfg.parallel, activation_checkpointing=False, compile=False))
    if on_meta:
        load_sharded(ref, d, section)
    ref.eval()
    if shared:
        ref.set_attention(SharedPromptAttention(ref.attend))
    return Reference(model=ref)
