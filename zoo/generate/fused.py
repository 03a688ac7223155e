"""Decoding with fused projections: q/k/v as one matrix product and gate/up as one, for generation only.

A batch-1 decode step reads every weight once; on a GPU each layer's seven small products (q, k, v, o, gate, up,
down) run as seven matrix-vector kernels, the small ones far below the memory bandwidth (docs/numbers.md: 45% of
the bound, each kernel ~13 us). Concatenated, a layer runs four: [q; k; v] and [gate; up] each one larger product.

The layout is a load-time transform of generation alone: `fused_decoder(lm)` builds a `FusedDecoder` beside the
model, holding the concatenated weights (copies: q/k/v and gate/up take twice their memory while it lives) and
running the decode step's forward with them; the model's parameters, its checkpoint layout and training never see
it. Everything else of a block (norms, q/k norms, rotary, the installed attention function, o and down projections,
MoE and Gated DeltaNet layers) is the model's own module, called as the model calls it. A layer whose projections
are not plain nn.Linear of one dtype (LoRA, NF4, fp8) keeps its own forward.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from zoo.core.contract import DecoderConfig, TextModel
from zoo.core.layers import GatedMLP
from zoo.core.packing import Packed
from zoo.models.decoder import Attention, Block, Decoder


def _plain(*linears: nn.Linear) -> bool:
    """All plain nn.Linear with plain weights (and biases alike) of one dtype and device: concatenable."""
    if not all(type(m) is nn.Linear and type(m.weight) in (Tensor, nn.Parameter) for m in linears):
        return False
    w, biased = linears[0].weight, linears[0].bias is not None
    return all(m.weight.dtype == w.dtype and m.weight.device == w.device and (m.bias is not None) == biased
               for m in linears)


def _cat(*linears: nn.Linear) -> tuple[nn.Parameter, nn.Parameter | None]:
    """The concatenated weight [sum out, in] and bias, as frozen parameters (CUDA graphs take parameters as inputs
    at fixed addresses)."""
    weight = torch.cat([m.weight.detach() for m in linears])
    bias = None if linears[0].bias is None else torch.cat([m.bias.detach() for m in linears])
    return nn.Parameter(weight, requires_grad=False), None if bias is None else nn.Parameter(bias, requires_grad=False)


class FusedAttention(nn.Module):
    """The model's `Attention` with q/k/v from one product; the rest is the original module's."""

    def __init__(self, attn: Attention) -> None:
        super().__init__()
        self.attn = [attn]  # in a list: not a submodule, so the original's parameters are not this module's
        self.weight, self.bias = _cat(attn.q_proj, attn.k_proj, attn.v_proj)
        self.splits = [attn.q_proj.out_features, attn.k_proj.out_features, attn.v_proj.out_features]

    def forward(self, x_TD: Tensor, cos_TH: Tensor, sin_TH: Tensor, packed: Packed) -> Tensor:
        q, k, v = F.linear(x_TD, self.weight, self.bias).split(self.splits, dim=-1)
        return self.attn[0].attend_projected(q, k, v.contiguous(), x_TD.dtype, cos_TH, sin_TH, packed)


class FusedMLP(nn.Module):
    """The model's `GatedMLP` with gate and up from one product; down is the original's."""

    def __init__(self, mlp: GatedMLP) -> None:
        super().__init__()
        self.mlp = [mlp]
        self.weight, self.bias = _cat(mlp.gate_proj, mlp.up_proj)

    def forward(self, x_TD: Tensor) -> Tensor:
        m = self.mlp[0]
        gate_TF, up_TF = F.linear(x_TD, self.weight, self.bias).chunk(2, dim=-1)
        return m.down_proj(m.act(gate_TF) * up_TF)


class FusedBlock(nn.Module):
    """Block.forward over the fused mixer and MLP where they fuse, the block's own modules where not."""

    def __init__(self, block: Block) -> None:
        super().__init__()
        self.block = [block]
        a, m = block.attn, block.mlp
        self.attn: nn.Module | None = (FusedAttention(a) if isinstance(a, Attention)
                                       and _plain(a.q_proj, a.k_proj, a.v_proj) else None)
        self.mlp: nn.Module | None = (FusedMLP(m) if type(m) is GatedMLP and _plain(m.gate_proj, m.up_proj)
                                      else None)

    def forward(self, x_TD: Tensor, cos_TH: Tensor, sin_TH: Tensor, packed: Packed) -> Tensor:
        b = self.block[0]
        return b.around(self.attn if self.attn is not None else b.attn, self.mlp if self.mlp is not None else b.mlp,
                        x_TD, cos_TH, sin_TH, packed)


class FusedDecoder(nn.Module):
    """What a decode step runs instead of the Decoder (a `TextModel` as generation uses one): `embed`, `hidden`,
    `head_weight` and `config` are the Decoder's, the blocks fused (`fused_layers` of them: those whose mixer or MLP
    fused)."""

    def __init__(self, lm: Decoder) -> None:
        super().__init__()
        self.lm = [lm]
        self.blocks = nn.ModuleList(FusedBlock(b) for b in lm.layers)  # type: ignore[arg-type]
        self.fused_layers = sum(1 for b in self.blocks if b.attn is not None or b.mlp is not None)

    @property
    def config(self) -> DecoderConfig:
        return self.lm[0].config

    @property
    def layers(self) -> nn.ModuleList:
        return self.lm[0].layers

    @property
    def head_weight(self) -> Tensor:
        return self.lm[0].head_weight

    @property
    def embed(self) -> nn.Embedding:
        return self.lm[0].embed

    @property
    def final_softcap(self) -> float | None:
        return self.lm[0].final_softcap

    def attention_flops(self, seqlens: Sequence[int]) -> int:
        return self.lm[0].attention_flops(seqlens)

    def hidden(self, packed: Packed, x_TD: Tensor | None = None) -> Tensor:
        """Decoder.hidden through the fused blocks (a decode step gives the token embeddings)."""
        lm = self.lm[0]
        if x_TD is None:
            x_TD = lm.embed(packed.input_ids)
        tables = {key: lm.rotaries[key](packed, x_TD.dtype) for key in dict.fromkeys(lm.rope_keys)}
        for block, key in zip(self.blocks, lm.rope_keys):
            x_TD = block(x_TD, *tables[key], packed)
        return lm.norm(x_TD)


# the last compiled call's fused decoder, kept for the next call on the same weights: CUDA graphs replay at fixed
# addresses, so fused weights built afresh every call would re-record the graph every call
_last: list[tuple[weakref.ref[Decoder], tuple[tuple[int, int], ...], FusedDecoder]] = []


def _weights_key(lm: Decoder) -> tuple[tuple[int, int], ...]:
    """Where each parameter lives and its version counter: any in-place update (an optimizer step) changes it."""
    return tuple((p.data_ptr(), p._version) for p in lm.parameters())


@torch.no_grad()
def fused_decoder(lm: TextModel, keep: bool = False) -> FusedDecoder | None:
    """A FusedDecoder of `lm` (None where no layer fuses: nothing to gain). keep: keep it for the next call with the
    same weights (the compiled path; one is kept at a time, `release()` frees it)."""
    if not isinstance(lm, Decoder):
        return None
    if keep and _last:
        ref, key, fused = _last[0]
        if ref() is lm and key == _weights_key(lm):
            return fused
    release()
    fused = FusedDecoder(lm)
    if not fused.fused_layers:
        return None
    if keep:
        _last.append((weakref.ref(lm), _weights_key(lm), fused))
    return fused


def decode_model(lm: TextModel, fuse: bool | None, device: torch.device, compiled: bool) -> TextModel:
    """What generate's decode steps run: `lm` fused (`fuse`; None: on CUDA, where a step is bound by reading the
    weights) where a layer fuses, else `lm` itself."""
    if not (device.type == "cuda" if fuse is None else fuse):
        return lm
    fused = fused_decoder(lm, keep=compiled)
    return lm if fused is None else fused


def release() -> None:
    """Free the fused weights kept by the last compiled call."""
    _last.clear()
