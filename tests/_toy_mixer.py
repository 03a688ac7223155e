"""A token mixer zoo does not have, defined here and not in zoo: each token's output is the mean of its document's
values so far (a running sum: state that a decode step carries per sequence, and that under Ulysses sequence
parallelism runs along whole documents for a share of the channels). It keeps `zoo.core.mixer.Mixer` and is
registered in the decoder's mixer table; nothing in zoo.generate or zoo.parallel names it.

Used by tests/test_mixer_contract.py and its spawned processes (`main`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import _sp_worker
import torch
import torch.distributed as dist
from torch import Tensor, nn

import zoo
from zoo.core.contract import NormSpec
from zoo.core.mixer import HeadExchange, MixerCache
from zoo.core.packing import Packed
from zoo.errors import ZooError
from zoo.models import decoder
from zoo.models.llama import LlamaConfig


@dataclass(frozen=True)
class MeanSpec:
    channels: int
    rope: str = "default"


class MeanMixer(nn.Module):
    def __init__(self, dim: int, spec: MeanSpec, norm: NormSpec, norm_eps: float, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.v_proj = nn.Linear(dim, spec.channels, bias=False)
        self.o_proj = nn.Linear(spec.channels, dim, bias=False)
        self.cache: MixerCache | None = None
        self.exchange: HeadExchange | None = None

    def forward(self, x_TD: Tensor, cos_TH: Tensor, sin_TH: Tensor, packed: Packed) -> Tensor:
        v_TC = self.v_proj(x_TD)
        if self.cache is not None and packed.doc_len is not None:  # a decode step: one token a sequence
            sum_nC = self.cache.kept(self.layer, "sum")
            sum_nC.add_(v_TC)
            return self.o_proj(sum_nC / packed.doc_len[:, None].to(v_TC.dtype))
        if self.exchange is not None and self.exchange.holds(packed):
            T, U = v_TC.shape[0], self.exchange.size
            v_tc, whole = self.exchange.scatter(v_TC.view(T, U, -1), packed)
            o_tc = running_sum(v_tc, whole) / counts(whole, v_tc.dtype)
            return self.o_proj(self.exchange.gather(o_tc, packed).reshape(T, -1))
        sum_TC = running_sum(v_TC, packed)
        if self.cache is not None:  # the prefill: each prompt's sum
            self.cache.keep(self.layer, "sum", sum_TC[packed.cu_seqlens[1:].long() - 1])
        return self.o_proj(sum_TC / counts(packed, v_TC.dtype))

    def generation_bytes(self, n: int, capacity: int, itemsize: int) -> int:
        return n * self.v_proj.out_features * itemsize

    def use_cache(self, cache: MixerCache | None) -> None:
        self.cache = cache

    def sequence_parallel(self, exchange: HeadExchange | None, mode: str) -> None:
        if exchange is not None and mode != "ulysses":
            raise ZooError(f"the mean mixer runs under Ulysses only, got mode {mode!r}")
        self.exchange = exchange

    def kernel_choice(self, device: torch.device, dtype: torch.dtype) -> str:
        return "torch: a cumulative sum per document"

    def mixing_flops(self, seqlens) -> int:
        return self.v_proj.out_features * sum(seqlens)  # the running sum's additions


def running_sum(v_TC: Tensor, packed: Packed) -> Tensor:
    """Each token's sum of its document's values up to itself."""
    bounds = packed.cu_seqlens.tolist()
    return torch.cat([v_TC[a:b].cumsum(0) for a, b in zip(bounds[:-1], bounds[1:])])


def counts(packed: Packed, dtype: torch.dtype) -> Tensor:
    """[T, 1] each token's position in its document, plus one."""
    bounds = packed.cu_seqlens.tolist()
    return torch.cat([torch.arange(1, b - a + 1, dtype=dtype) for a, b in zip(bounds[:-1], bounds[1:])])[:, None]


decoder.MIXERS.setdefault(MeanSpec, MeanMixer)


@dataclass(frozen=True)
class MeanLlamaConfig(LlamaConfig):
    """A Llama whose even layers mix by the running mean."""

    def decoder_spec(self):  # type: ignore[override]
        spec = super().decoder_spec()
        layers = tuple(dataclasses.replace(layer, mixer=MeanSpec(32)) if i % 2 == 0 else layer
                       for i, layer in enumerate(spec.layers))
        return dataclasses.replace(spec, layers=layers)


def build(dtype=torch.float32):
    cfg = MeanLlamaConfig(dim=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=48, vocab_size=96, max_seq_len=256)
    return _sp_worker._build(decoder.Decoder, cfg).to(dtype)


def main(rank: int, world: int, port: int, out_path: str) -> None:
    """Rank 0 writes {case: [ok, detail]}: Ulysses over `world` ranks against one process; ring refused."""
    from zoo.parallel import SequenceParallel

    def cases() -> dict:
        model = build()
        packed = zoo.pack(_sp_worker._docs([1, 23, 5, 2, 30, 19], 96, 1))
        ref = _sp_worker.reference(model, packed)
        sp = SequenceParallel(dist.group.WORLD, mode="ulysses")
        problems = _sp_worker.against(ref, _sp_worker.sp_run(model, sp, packed))
        for m in model.decoder.mixers():
            m.sequence_parallel(None, "ulysses")
        results = {"ulysses": [not problems, "; ".join(problems)]}
        try:
            SequenceParallel(dist.group.WORLD, mode="ring").apply(build())
            results["ring refused"] = [False, "ring mode was accepted"]
        except ZooError as e:
            results["ring refused"] = ["Ulysses only" in str(e), str(e)]
        return results

    _sp_worker.spawned(cases, rank, world, port, out_path)
