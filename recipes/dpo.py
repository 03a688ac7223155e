"""python -m recipes.dpo: preference tuning (DPO, IPO, SimPO, ORPO) on JSONL pairs, packed, one process or torchrun.

Pairs are tokenized as TRL's DPOTrainer does and packed whole: a pair's chosen and rejected are two documents of
one pack, so a step pays for no padding, and a pack of pairs shards over --sp ranks like any other. The losses and
the metrics (metrics.jsonl, under TRL's names: rewards/chosen, rewards/margins, logps/chosen, ...) are TRL's.

The reference (sigmoid, robust, ipo): --ref-model DIR, frozen and sharded like the policy; with LoRA and no
--ref-model, the policy with its adapters switched off; else a frozen copy of --model. --precompute-ref computes
the reference log-probs once, before training, keeps them in OUT/ref_logps.safetensors and frees the reference;
--resume reads them back. SimPO and ORPO need no reference.

--share-prompt (on where it can run): a pair laid out prompt + chosen + rejected, the prompt through the model
once, attention gathering each pair's two documents for the model's own backend (SharedPromptAttention); the same
numbers as two documents.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from recipes.build import add_adapters, build_model, check_model, load_sharded, model_config, parallelize_model
from recipes.config import cli, non_negative, opt, parse, positive, section
from recipes.data.preference import PairPack, PreferenceData, TargetPlan
from recipes.export import export
from recipes.loop import packs_per_rank, train
from recipes.metrics import summary
from recipes.processes import Dist, distributed
from recipes.sections import (
    WHOLE_SAMPLES_HELP,
    ChatDataSection,
    CheckpointSection,
    LogSection,
    LoRASection,
    ModelSection,
    OptimSection,
    ParallelSection,
    RunSection,
)
from recipes.tokenizer import find_tokenizer
from zoo.core.attention import AttentionFn
from zoo.core.contract import AttentionSpec
from zoo.core.logprobs import document_ids, row_logprobs, token_logprobs
from zoo.core.moe import moe_layers
from zoo.core.packing import Packed
from zoo.errors import ZooError
from zoo.models import Model
from zoo.train.flops import step_flops
from zoo.train.lora import apply_lora, lora_modules
from zoo.train.quant import require_nf4

LOSSES = ("sigmoid", "robust", "ipo", "simpo", "orpo")
NEEDS_REFERENCE = ("sigmoid", "robust", "ipo")
SFT_OUT, PRETRAINED = Path("out/sft/model"), Path("out/pretrain/model")
REF_TABLE = "ref_logps.safetensors"
SCORE_METHOD = "preference_score"  # the FSDP forward method `scorer` adds


@dataclass
class PreferenceSection:
    """The preference loss and its reference."""

    loss: str = opt("sigmoid", "sigmoid: DPO; robust: robust DPO (--label-smoothing the flip rate); ipo: IPO "
                               "(length-normalised, as TRL); simpo: SimPO (TRL's CPO loss_type simpo, cpo_alpha 0); "
                               "orpo: ORPO (odds ratio plus the chosen NLL)", LOSSES)
    beta: float = opt(0.1, "beta: the KL strength of DPO/IPO (IPO's tau), SimPO's reward scale, ORPO's lambda",
                      check=positive)
    label_smoothing: float = opt(0.0, "sigmoid: the conservative DPO's label noise (cDPO, TRL before 1.0); robust: "
                                      "the flip rate; simpo: as TRL's CPO; in [0, 0.5)", check=non_negative)
    simpo_gamma: float = opt(0.5, "SimPO's target reward margin (TRL's simpo_gamma)", check=non_negative)
    ref_model: str | None = opt(None, "reference checkpoint directory (frozen; default: the policy's adapters "
                                      "switched off with LoRA, else a frozen copy of --model)")
    precompute_ref: bool = opt(False, "compute the reference log-probs once before training (kept in "
                                      f"OUT/{REF_TABLE}, read back by --resume) and free the reference")
    share_prompt: bool = opt(True, "lay a pair out as prompt + chosen + rejected, the prompt computed once (the "
                                   "same numbers as two documents); off by itself under --sp, --compile and RoPE "
                                   "scaled by the document's length")


@dataclass
class DPOConfig:
    """The options of recipes.dpo."""

    model: ModelSection = section(lambda: ModelSection(name="auto"), help={
        "name": "preset or checkpoint directory; auto: out/sft/model, else out/pretrain/model, else the debug preset"})
    data: ChatDataSection = section(lambda: ChatDataSection(seq_len=1024, batch_tokens=4096), help={
        "path": "JSONL preference pairs: {\"prompt\", \"chosen\", \"rejected\"} as text, or as conversations "
                "(message lists, prompt optional), with an optional \"system\" (required)",
        "eval_data": "held-out pairs in --data's format: their loss and metrics, as TRL's eval_loss, "
                     "eval_rewards/accuracies, ..., every --eval-every steps and after the last",
        "overlong": "pairs longer than --seq-len: truncate (both sequences keep their start) or drop; counted",
        **WHOLE_SAMPLES_HELP})
    run: RunSection = section(lambda: RunSection(out="out/dpo", steps=100))
    optim: OptimSection = section(lambda: OptimSection(lr=5e-6, warmup=5, weight_decay=0.0))
    checkpoint: CheckpointSection = section(CheckpointSection)
    parallel: ParallelSection = section(ParallelSection)
    log: LogSection = section(LogSection)
    lora: LoRASection = section(LoRASection)
    pref: PreferenceSection = section(PreferenceSection)


# ---- the losses (TRL's, per pair) ----


def log1mexp(x: Tensor) -> Tensor:
    """log(1 - exp(x)) for x < 0, accurate at both ends."""
    return torch.where(x > -math.log(2), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


@dataclass
class PairScores:
    """Per pair of a pack: the policy's (and reference's) completion log-prob sums, the completion lengths, and
    what the metrics read."""

    chosen: Tensor  # sum of log p over the chosen completion (differentiable)
    rejected: Tensor
    ref_chosen: Tensor | None
    ref_rejected: Tensor | None
    chosen_len: Tensor  # completion tokens (TRL's completion_mask sums: IPO's normaliser)
    rejected_len: Tensor
    chosen_count: Tensor  # completion tokens predicted (SimPO's and ORPO's averages)
    rejected_count: Tensor
    chosen_logits: Tensor  # sum over the completion of each token's vocabulary-mean logit
    rejected_logits: Tensor
    chosen_nll: Tensor  # ORPO: minus the sum of log p over every token of prompt + chosen (differentiable)
    chosen_nll_count: Tensor


def pair_losses(cfg: PreferenceSection, s: PairScores) -> tuple[Tensor, dict[str, Tensor]]:
    """(loss per pair, metric per pair): TRL's DPOTrainer (sigmoid, robust, ipo), CPOTrainer (simpo) and
    ORPOTrainer (orpo) formulas."""
    beta, eps = cfg.beta, cfg.label_smoothing
    if cfg.loss in NEEDS_REFERENCE:
        assert s.ref_chosen is not None and s.ref_rejected is not None
        chosen_ratio, rejected_ratio = s.chosen - s.ref_chosen, s.rejected - s.ref_rejected
        delta = chosen_ratio - rejected_ratio
        if cfg.loss == "sigmoid":
            loss = -(1 - eps) * F.logsigmoid(beta * delta) - eps * F.logsigmoid(-beta * delta)
        elif cfg.loss == "robust":
            loss = (-(1 - eps) * F.logsigmoid(beta * delta) + eps * F.logsigmoid(-beta * delta)) / (1 - 2 * eps)
        else:  # IPO, each log-ratio averaged over its completion's tokens (TRL's normalisation)
            ipo = chosen_ratio / s.chosen_len.clamp(min=1) - rejected_ratio / s.rejected_len.clamp(min=1)
            loss = (ipo - 1 / (2 * beta)) ** 2
        rewards = (beta * chosen_ratio.detach(), beta * rejected_ratio.detach())
        logps = (s.chosen.detach(), s.rejected.detach())
        return loss, metrics_of(rewards, logps)
    avg_chosen, avg_rejected = s.chosen / s.chosen_count.clamp(min=1), s.rejected / s.rejected_count.clamp(min=1)
    rewards = (beta * avg_chosen.detach(), beta * avg_rejected.detach())
    logps = (avg_chosen.detach(), avg_rejected.detach())
    if cfg.loss == "simpo":
        margin = avg_chosen - avg_rejected - cfg.simpo_gamma / beta
        loss = -(1 - eps) * F.logsigmoid(beta * margin) - eps * F.logsigmoid(-beta * margin)
        return loss, metrics_of(rewards, logps)
    log_odds = (avg_chosen - avg_rejected) - (log1mexp(avg_chosen) - log1mexp(avg_rejected))
    ratio = F.logsigmoid(log_odds)
    out = metrics_of(rewards, logps)
    out["log_odds_ratio"], out["log_odds_chosen"] = ratio.detach(), log_odds.detach()
    return -beta * ratio, out


def metrics_of(rewards: tuple[Tensor, Tensor], logps: tuple[Tensor, Tensor]) -> dict[str, Tensor]:
    return {"rewards/chosen": rewards[0], "rewards/rejected": rewards[1],
            "rewards/accuracies": (rewards[0] > rewards[1]).to(rewards[0].dtype),
            "rewards/margins": rewards[0] - rewards[1], "logps/chosen": logps[0], "logps/rejected": logps[1]}


# ---- log-prob sums of a pack ----


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) over a group whose ranks all go on to compute the same loss from the sum: the gradient of
    each rank's part is the sum's gradient, passed back unchanged (each rank then backpropagates its own share)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


Scorer = Callable[[Tensor | TargetPlan, Packed], Tensor]  # `score` bound to a model

# the per-document columns a scorer returns: log p over the completion, its predicted tokens, its mean-logit sum,
# log p over every target (ORPO's NLL), their count
COMPLETION, COUNT, LOGITS, ALL, ALL_COUNT = range(5)


def score(model: Model, where: Tensor | TargetPlan, packed: Packed) -> Tensor:
    """[documents of the whole pack, 5]: per document the COMPLETION .. ALL_COUNT sums over this pack's (or
    shard's) targets. `where`: for a pack of documents, per token where its document's completion starts (a target
    is the completion's when the token it predicts sits at or after it); for a shared-prompt pack, its TargetPlan."""
    h_TD = model.hidden(packed)
    if isinstance(where, TargetPlan):
        doc_M, completion_M, n = where.doc_M, where.completion_M, 2 * packed.num_docs
        logp_M, mean_logit_M = row_logprobs(h_TD, model.head_weight, where.rows_M, where.targets_M)
    else:
        rows_M, logp_M, mean_logit_M = token_logprobs(h_TD, model.head_weight, packed.targets(model.labels))
        doc_T, n = document_ids(packed)
        doc_M = doc_T.index_select(0, rows_M)
        completion_M = packed.position_ids.index_select(0, rows_M) + 1 >= where.index_select(0, rows_M)
    ones_M, zeros_M = torch.ones_like(logp_M), torch.zeros_like(logp_M)
    cols_M5 = torch.stack([torch.where(completion_M, logp_M, zeros_M), completion_M.to(logp_M.dtype),
                           torch.where(completion_M, mean_logit_M, zeros_M), logp_M, ones_M], dim=1)
    return torch.zeros(n, 5, dtype=logp_M.dtype, device=h_TD.device).index_add(0, doc_M, cols_M5)


def scorer(model: Model) -> Scorer:
    """`score` bound to `model`. Under FSDP it runs as one of the model's forward methods (the root's embedding,
    norm and head are gathered around it, as for `loss`): the contract has no such method, so it is set on this
    model object and registered with FSDP."""
    from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method

    bound = partial(score, model)
    if not isinstance(model, FSDPModule):
        return bound
    if not hasattr(model, SCORE_METHOD):  # else registered already (with LoRA the policy is its own reference)
        setattr(model, SCORE_METHOD, bound)
        register_fsdp_forward_method(model, SCORE_METHOD)
    return cast(Scorer, getattr(model, SCORE_METHOD))


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


def no_shared_prompt(cfg: DPOConfig, d: Dist) -> str | None:
    """Why the shared-prompt layout cannot run here, or None when it can."""
    if d.sequence_parallel is not None:
        return "--sp cuts a pack across ranks, and the layout's attention gathers each pair whole"
    if cfg.parallel.compile:
        return "--compile: the gathering attention is not compiled yet"
    for name in dict.fromkeys((cfg.model.name, cfg.pref.ref_model or cfg.model.name)):
        config = model_config(replace(cfg.model, name=name))
        spec = config.decoder_spec() if hasattr(config, "decoder_spec") else None
        if spec is None or not all(isinstance(layer.mixer, AttentionSpec) for layer in spec.layers):
            # a recurrent mixer (Gated DeltaNet) runs the segment's tokens in order: rejected after chosen
            return f"{name} has layers other than attention, which would carry the chosen answer into the rejected"
        scaling = getattr(config, "rope_scaling", None)
        if isinstance(scaling, dict) and scaling.get("type", scaling.get("rope_type")) == "dynamic":
            return f"{name} scales RoPE by the document's length, and a shared prompt belongs to two documents"
    return None


def over_group(x: Tensor, d: Dist) -> Tensor:
    """A shard's per-document sums, summed over its sequence-parallel group (the whole documents')."""
    if d.sequence_parallel is None or d.mesh is None:
        return x
    return _SumOverGroup.apply(x, d.mesh["sp"].get_group())


class Sums:
    """A step's (or an evaluation's) running sums on this rank: the loss and each metric over its pairs, the
    completion tokens' logits; `means` reduces them over the ranks into TRL's per-pair means."""

    def __init__(self, d: Dist):
        self.loss = torch.zeros((), dtype=torch.float64, device=d.device)
        self.metrics: dict[str, Tensor] = {}
        self.logits = torch.zeros(4, dtype=torch.float64, device=d.device)

    def add(self, loss: Tensor, metrics: dict[str, Tensor], chosen: Tensor, rejected: Tensor, weight: float) -> None:
        self.loss += loss.detach().double() * weight
        for k, v in metrics.items():
            self.metrics[k] = self.metrics.get(k, torch.zeros_like(self.loss)) + v.double().sum() * weight
        self.logits += torch.stack([chosen[:, LOGITS].sum(), chosen[:, COUNT].sum(), rejected[:, LOGITS].sum(),
                                    rejected[:, COUNT].sum()]).detach().double() * weight

    def means(self, d: Dist, n_pairs: int) -> dict[str, float]:
        """Each metric's mean over the pairs (logits/*: over the completion tokens), as TRL logs them, and the loss
        (the shares add up to the mean), over every rank; the ranks of an sp group hold the same pairs: one counts."""
        names = sorted(self.metrics)
        values = torch.cat([torch.stack([self.metrics[k] for k in names]), self.logits, self.loss[None]])
        if dist.is_initialized():
            values = values * (d.sp_rank == 0)
            dist.all_reduce(values)
        out = {k: float(v) / n_pairs for k, v in zip(names, values[: len(names)].tolist())}
        c_logits, c_count, r_logits, r_count, loss = values[len(names):].tolist()
        out["logits/chosen"] = c_logits / max(c_count, 1)
        out["logits/rejected"] = r_logits / max(r_count, 1)
        out["pairs"] = n_pairs
        out["loss"] = loss
        return out


class PreferenceStep:
    """One optimizer step over pairs (loop.train's `step_fn`): this rank's packs, each pair's loss, the backward.

    The averaging rule of recipes.loop, with pairs for tokens: each pack's loss is its pairs' losses summed over
    the number of pairs in the whole step (all packs, all ranks), ORPO's NLL its tokens' over the step's chosen
    tokens; each rank backpropagates `world x share`. Under sequence parallelism the ranks of a group sum the
    shards' log-probs (an all-reduce that passes the gradient back unchanged), compute the same pair losses, and
    each backpropagates them through its own tokens; the loss is counted once per group."""

    def __init__(self, cfg: DPOConfig, data: PreferenceData, eval_data: PreferenceData | None = None):
        self.cfg, self.data, self.eval_data = cfg.pref, data, eval_data
        self.reference: Reference | None = None  # the train pairs' (a table is by pair index)
        self.eval_reference: Reference | None = None  # the held-out pairs'
        self.eval_every, self.steps = cfg.data.eval_every, cfg.run.steps
        self.score: Scorer | None = None
        self.last: dict[str, float] = {}
        self.pending_table: Callable[[], None] | None = None  # writes the precomputed table once the run has begun
        self.evaluate_now: Callable[[], dict[str, float]] | None = None

    def slots(self, step: int, accum: int, d: Dist) -> tuple[list[int | None], list[int]]:
        """(this rank's packs of `step`, the step's packs): run indices of the data's packs, None for a slot with
        no pack. A step reads --batch-tokens / --seq-len packs in order through the epochs; with fewer packs in the
        data, a step is one epoch, every pair once, dealt over the data-parallel ranks (a rank short of packs runs
        one at weight 0, as FSDP's collectives need every rank to run the same number)."""
        n, per_step = len(self.data), accum * d.dp
        if n >= per_step:
            first = (step - 1) * per_step
            every = list(range(first, first + per_step))
            return [every[d.dp_rank * accum + a] for a in range(accum)], every
        k = -(-n // d.dp)
        every = [(step - 1) * n + j for j in range(n)]
        mine = [(step - 1) * n + j if j < n else None for j in range(d.dp_rank * k, (d.dp_rank + 1) * k)]
        return mine, every

    def __call__(self, d: Dist, model: Model, data: Any, step: int, accum: int,
                 context: AbstractContextManager[object]) -> tuple[Tensor, int, int, int]:
        if self.pending_table is not None:
            self.pending_table()
            self.pending_table = None
        if self.score is None:
            self.score = scorer(model)
        mine, every = self.slots(step, accum, d)
        packs = [self.data.index(g) for g in every]
        totals = self.totals(self.data, packs)
        fsdp = None
        if d.fsdp_mesh is not None:
            from torch.distributed.fsdp import FSDPModule

            fsdp = model if isinstance(model, FSDPModule) else None
        sums = Sums(d)
        tokens = flops = 0
        for a, g in enumerate(mine):
            i = self.data.index(g if g is not None else every[0])
            weight = 0.0 if g is None else 1.0
            seqlens = self.data.seqlens(i)
            tokens += sum(seqlens) * (g is not None)
            pack_flops = step_flops(model, seqlens) * (g is not None)
            flops += pack_flops
            if self.reference is not None and self.reference.run_model is not None:
                flops += pack_flops // 3  # the reference's forward: about a third of a training step
            if fsdp is not None:
                fsdp.set_requires_gradient_sync(a == len(mine) - 1)
            loss = self.pack_loss(self.data, self.reference, i, d, context, totals, sums, weight)
            (loss * weight * d.world).backward()
        self.last = sums.means(d, totals[0])
        self.last.pop("loss")  # the loop logs the step's loss itself
        if self.eval_data is not None and (step == self.steps or (self.eval_every and step % self.eval_every == 0)):
            self.evaluate_now = partial(self.evaluate, d, model, self.eval_data, context)  # after the update
        step_targets = sum(self.data.loss_tokens[i] for i in packs)
        return (sums.loss / d.sp).to(torch.float32), tokens, step_targets, flops

    @staticmethod
    def totals(data: PreferenceData, packs: list[int]) -> tuple[int, int]:
        """(pairs, ORPO's NLL targets: every token of prompt + chosen but the first) of these packs."""
        pairs = [j for i in packs for j in data.pairs_in(i)]
        return len(pairs), sum(len(data.pairs[j].prompt) + len(data.pairs[j].chosen) - 1 for j in pairs)

    def pack_loss(self, data: PreferenceData, reference: Reference | None, i: int, d: Dist,
                  context: AbstractContextManager[object], totals: tuple[int, int], sums: Sums,
                  weight: float) -> Tensor:
        """Pack i's share of the loss over `totals` (pairs, NLL targets); its metrics go into `sums`, x weight."""
        assert self.score is not None
        n_pairs, nll_tokens = totals
        packed, where = prepared(data, i, d)
        pairs = data.pairs_in(i)
        ref = None if reference is None else reference(pairs, where, packed, d, context)
        with context:
            cols = over_group(self.score(where, packed), d)
        chosen, rejected = cols[0::2], cols[1::2]
        lens = torch.tensor([[len(data.pairs[j].chosen), len(data.pairs[j].rejected)] for j in pairs],
                            dtype=cols.dtype, device=cols.device)
        scores = PairScores(chosen[:, COMPLETION], rejected[:, COMPLETION],
                            None if ref is None else ref[:, 0].to(cols.dtype),
                            None if ref is None else ref[:, 1].to(cols.dtype), lens[:, 0], lens[:, 1],
                            chosen[:, COUNT], rejected[:, COUNT], chosen[:, LOGITS], rejected[:, LOGITS],
                            -chosen[:, ALL], chosen[:, ALL_COUNT])
        per_pair, metrics = pair_losses(self.cfg, scores)
        loss = per_pair.sum() / n_pairs
        if self.cfg.loss == "orpo":
            loss = loss + scores.chosen_nll.sum() / max(nll_tokens, 1)
            metrics["nll_loss"] = scores.chosen_nll.detach() * (n_pairs / max(nll_tokens, 1))
        sums.add(loss, metrics, chosen, rejected, weight)
        return loss

    def evaluate(self, d: Dist, model: Model, data: PreferenceData, context: AbstractContextManager[object],
                 ) -> dict[str, float]:
        """The loss and metrics over every pair of `data` (held out), without gradients or dropout, under TRL's
        eval_ names. Pack i goes to data-parallel rank i % dp (cut over its sp group); every rank runs the same
        number of packs (FSDP's gathers are collective), a repeated one counted zero times."""
        if self.score is None:
            self.score = scorer(model)
        n = len(data)
        totals = self.totals(data, list(range(n)))
        sums = Sums(d)
        was_training = model.training
        model.eval()
        with torch.no_grad():
            for k in range(-(-n // d.dp)):
                i = k * d.dp + d.dp_rank
                self.pack_loss(data, self.eval_reference, i % n, d, context, totals, sums, float(i < n))
        model.train(was_training)
        return {f"eval_{k}": v for k, v in sums.means(d, totals[0]).items() if k != "pairs"}

    def metrics(self) -> dict[str, float]:
        """The last step's metrics (loop.train's `step_metrics`, called after the optimizer's update), and where
        the step was one to evaluate at, the held-out pairs' (eval_loss, eval_rewards/..., as TRL names them)."""
        if self.evaluate_now is not None:
            self.last.update(self.evaluate_now())
            self.evaluate_now = None
        return self.last


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


def read_tables(path: Path, key: str) -> dict[str, Tensor] | None:
    """The tables at `path` (ref_logps, and eval_ref_logps for held-out pairs) if they were computed for `key` (the
    same pairs and reference), else None."""
    from safetensors import safe_open

    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as f:
            if (f.metadata() or {}).get("key") != key:
                return None
            return {name: f.get_tensor(name) for name in f.keys()}
    except Exception:  # a damaged file is computed again
        return None


def write_tables(path: Path, tables: dict[str, Tensor], key: str) -> None:
    from safetensors.torch import save_file

    tmp = path.with_suffix(".tmp")
    save_file({k: t.contiguous() for k, t in tables.items()}, str(tmp), metadata={"key": key})
    tmp.replace(path)


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


def main(argv: list[str] | None = None) -> list[float]:
    started = time.perf_counter()
    cfg = parse(DPOConfig, argv, __doc__)
    if cfg.model.name == "auto":
        cfg.model.name = next((str(p) for p in (SFT_OUT, PRETRAINED) if (p / "config.json").is_file()), "debug")
    if not cfg.data.path:
        raise ZooError("--data is required: a JSONL file (or directory) of {\"prompt\", \"chosen\", \"rejected\"} "
                       "pairs")
    pref = cfg.pref
    if pref.label_smoothing >= 0.5:
        raise ZooError(f"--label-smoothing must be below 0.5 (at 0.5 the labels are noise), got {pref.label_smoothing}")
    if pref.loss not in NEEDS_REFERENCE and (pref.ref_model or pref.precompute_ref):
        raise ZooError(f"--loss {pref.loss} uses no reference model: leave out --ref-model and --precompute-ref")
    if pref.ref_model is not None and not Path(pref.ref_model).is_dir():
        raise ZooError(f"--ref-model {pref.ref_model}: expected a checkpoint directory")
    lora = cfg.lora.config()
    if cfg.lora.qlora:
        require_nf4()
    with distributed(cfg.parallel) as d:
        tok = find_tokenizer(cfg.model.tokenizer, cfg.model.name)
        check_model(cfg.model, cfg.data.seq_len, tok)
        why_not = no_shared_prompt(cfg, d) if pref.share_prompt else None
        shared = pref.share_prompt and why_not is None
        data = PreferenceData(cfg.data.path, tok, cfg.data.seq_len, cfg.run.seed, cfg.data.chat_template,
                              cfg.data.overlong, full_chosen=pref.loss == "orpo", share_prompt=shared)
        packs_per_rank(cfg.data, d)  # --batch-tokens checked against --seq-len x dp before anything is built
        data.spread(d.dp)
        eval_data = None
        if cfg.data.eval_data:
            eval_data = PreferenceData(cfg.data.eval_data, tok, cfg.data.seq_len, cfg.run.seed,
                                       cfg.data.chat_template, cfg.data.overlong, full_chosen=pref.loss == "orpo",
                                       share_prompt=shared)
        if d.main:
            print(f"model: {cfg.model.name}\ndata: {data.stats}")
            if eval_data is not None:
                print(f"eval data: {eval_data.stats}")
            print("pairs laid out prompt + chosen + rejected (--share-prompt)" if shared else
                  f"pairs as two documents each{f' (no --share-prompt: {why_not})' if why_not else ''}")

        model, on_meta = build_model(cfg.model, d, cfg.run.seed, lora=cfg.lora)
        if moe_layers(model):  # the step here is the preference loss alone: a router would go unbalanced
            raise ZooError(f"--model {cfg.model.name} is a Mixture-of-Experts model: recipes.dpo does not add its "
                           "balancing losses to the preference loss yet; tune a dense model")
        wrap = None
        if lora is not None:
            wrap = partial(apply_lora, cfg=lora, seed=cfg.run.seed)
            add_adapters(model, d, cfg.model, lora, cfg.lora.qlora, wrap)
        parallelize_model(model, d, cfg.model, cfg.parallel)
        if on_meta:
            load_sharded(model, d, cfg.model, wrap)
        if shared:
            model.set_attention(SharedPromptAttention(model.attend))

        from recipes.build import autocast

        context = autocast(cfg.model, d)
        table_file = Path(cfg.run.out) / REF_TABLE
        step = PreferenceStep(cfg, data, eval_data)
        if pref.precompute_ref:
            key = reference_key(cfg, data, eval_data, lora is not None)
            tables = read_tables(table_file, key)
            if tables is None:
                reference = build_reference(cfg, d, model, lora is not None, shared)
                assert reference is not None
                tables = {"ref_logps": precompute(d, reference, data, context)}
                if eval_data is not None:
                    tables["eval_ref_logps"] = precompute(d, reference, eval_data, context)
                del reference
                if d.main:
                    print(f"reference log-probs of {len(data.pairs)} pairs computed; kept in {table_file} from step 1")
                    step.pending_table = partial(write_tables, table_file, tables, key)
            elif d.main:
                print(f"reference log-probs read from {table_file}")
            step.reference = Reference(table=tables["ref_logps"])
            step.eval_reference = Reference(table=tables.get("eval_ref_logps"))
        else:
            step.reference = step.eval_reference = build_reference(cfg, d, model, lora is not None, shared)
        losses = train(cfg, d, model, data, None, cfg.lora, step_fn=step, step_metrics=step.metrics)
        export(cfg, d, model, tok, lora, cfg.data.chat_template)
        summary(cfg, d, losses, started, adapter=lora is not None)
    return losses


if __name__ == "__main__":
    cli(main)
