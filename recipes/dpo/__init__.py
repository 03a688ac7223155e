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

import copy
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from recipes.data.preference import PreferenceData
from recipes.data.tokenizer_choice import find_tokenizer
from recipes.dpo.config import DPOConfig
from recipes.dpo.losses import (
    ALL,
    ALL_COUNT,
    COMPLETION,
    COUNT,
    LOGITS,
    LOSSES,
    NEEDS_REFERENCE,
    REF_TABLE,
    PairScores,
    PreferenceSection,
    Scorer,
    over_group,
    pair_losses,
    scorer,
)
from recipes.dpo.reference import (
    Reference,
    SharedPromptAttention,
    build_reference,
    no_shared_prompt,
    precompute,
    prepared,
    read_tables,
    reference_key,
    write_tables,
)
from recipes.engine.build import add_adapters, build_model, check_model, load_sharded, parallelize_model, resolve_model
from recipes.engine.checkpoint import check_out
from recipes.engine.config import check, parse
from recipes.engine.defaults import choose_lr, schedule_warning
from recipes.engine.export import export
from recipes.engine.loop import packs_per_rank, train
from recipes.engine.metrics import Result, summary
from recipes.engine.moe import Balance
from recipes.engine.processes import Dist, distributed
from zoo.errors import ZooError
from zoo.models import Model
from zoo.train.flops import step_flops
from zoo.train.lora import apply_lora
from zoo.train.quant import require_nf4

__all__ = ["LOSSES", "REF_TABLE", "DPOConfig", "PreferenceSection", "PreferenceStep", "Reference",
           "SharedPromptAttention", "main", "no_shared_prompt"]

SFT_OUT, PRETRAINED = Path("out/sft/model"), Path("out/pretrain/model")


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

    The averaging rule of recipes.engine.loop, with pairs for tokens: each pack's loss is its pairs' losses summed over
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
                 context: AbstractContextManager[object], *, balance: Balance | None) -> tuple[Tensor, int, int, int]:
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
            loss = self.pack_loss(self.data, self.reference, i, d, context, totals, sums, weight,
                                  (model, balance) if balance else None)
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
                  weight: float, balanced: tuple[Model, Balance] | None = None) -> Tensor:
        """Pack i's share of the loss over `totals` (pairs, NLL targets); its metrics go into `sums`, x weight.
        `balanced`: (the policy, its MoE balancing): a Mixture-of-Experts policy adds the balancing terms of the same
        forward, weighted by the pack's share of the step's pairs (as TRL adds aux_loss_coef x transformers' router
        aux loss over the batch to its DPO loss)."""
        assert self.score is not None
        n_pairs, nll_tokens = totals
        packed, where = prepared(data, i, d)
        pairs = data.pairs_in(i)
        ref = None if reference is None else reference(pairs, where, packed, d, context)
        recording: AbstractContextManager[list[list[Tensor]]] = (
            balanced[0].decoder.recording_router() if balanced is not None else nullcontext([]))
        with context, recording as records:
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
        logged = loss
        if balanced is not None and records:
            terms = balanced[1].terms(packed, [r[0] for r in records], len(pairs) / n_pairs)
            # each shard's terms are its part of the whole pack's: they add up over the sp group, where the pair
            # losses are the group's (logged once per group, recipes.dpo.Sums)
            loss, logged = loss + terms, logged + terms * d.sp
        sums.add(logged, metrics, chosen, rejected, weight)
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


def main(argv: list[str] | None = None) -> list[float]:
    """The command line: `python -m recipes.dpo [flags]`; returns the losses of the steps run."""
    return run(parse(DPOConfig, argv, __doc__)).losses


def run(cfg: DPOConfig) -> Result:
    """Train with `cfg` (the command line's path, its values checked alike; under torchrun each process calls it),
    returning where the outputs are and the final metrics."""
    started = time.perf_counter()
    check(cfg, DPOConfig)
    cfg = copy.deepcopy(cfg)  # the caller's config stays as given ("auto" is resolved below)
    if cfg.model.name == "auto":
        cfg.model.name = next((str(p) for p in (SFT_OUT, PRETRAINED) if (p / "config.json").is_file()), "debug")
    cfg.model = resolve_model(cfg.model)  # a hub id as its cached snapshot, a preset in any case
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
    check_out(cfg)  # before the model and the data load
    lr_line = choose_lr(cfg.optim, cfg.model, lora is not None, preference=True, scratch=5e-6)
    if cfg.lora.qlora:
        require_nf4()
    with distributed(cfg.parallel) as d:
        tok = find_tokenizer(cfg.model.tokenizer, cfg.model.name)
        check_model(cfg.model, cfg.data.seq_len, tok, device=d.device, lora=cfg.lora)
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
            print("\n".join(filter(None, (lr_line, schedule_warning(cfg.optim, cfg.run.steps)))))
            print(f"model: {cfg.model.name}\ndata: {data.describe()}")
            if eval_data is not None:
                print(f"eval data: {eval_data.describe()}")
            print("pairs laid out prompt + chosen + rejected (--share-prompt)" if shared else
                  f"pairs as two documents each{f' (no --share-prompt: {why_not})' if why_not else ''}")

        model, on_meta = build_model(cfg.model, d, cfg.run.seed, lora=cfg.lora)
        wrap = None
        if lora is not None:
            wrap = partial(apply_lora, cfg=lora, seed=cfg.run.seed)
            add_adapters(model, d, cfg.model, lora, cfg.lora.qlora, wrap)
        parallelize_model(model, d, cfg.model, cfg.parallel)
        if on_meta:
            load_sharded(model, d, cfg.model, wrap)
        if shared:
            model.set_attention(SharedPromptAttention(model.attend))

        from recipes.engine.build import autocast

        context = autocast(cfg.model, d)
        table_file = Path(cfg.run.out) / REF_TABLE
        step = PreferenceStep(cfg, data, eval_data)
        if pref.precompute_ref:
            key = reference_key(cfg, data, eval_data, lora is not None)
            shapes = {"ref_logps": (len(data.pairs), 2)}
            if eval_data is not None:
                shapes["eval_ref_logps"] = (len(eval_data.pairs), 2)
            tables = read_tables(table_file, key, shapes)
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
        losses = train(cfg, d, model, data, None, cfg.lora, step_fn=step, step_metrics=step.metrics,
                       unwrap=SharedPromptAttention.unwrap)
        export(cfg, d, model, tok, lora, cfg.data.chat_template)
        summary(cfg, d, losses, started, adapter=lora is not None)
    return Result.of(cfg, losses)

