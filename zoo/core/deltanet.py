"""Gated DeltaNet (Qwen3.5's linear-attention layers) over a packed batch, document by document.

Shapes: T tokens (all documents of the pack, no batch dimension), D model dim, Hk key heads, Hv value heads (a
multiple of Hk: grouped value heads), Dk key head dim, Dv value head dim, C chunk length, M chunks of the pack.

A layer projects x to q, k, v (one projection, then a depthwise causal convolution of width `conv_kernel` and SiLU),
to z (the output gate), to b (beta = sigmoid(b): how much of each token is written) and to a (the decay,
g = -exp(A_log) * softplus(a + dt_bias), in log space). Per value head, a state S [Dk, Dv] runs the gated delta rule

    S_t = exp(g_t) S_{t-1} + beta_t k_t (v_t - exp(g_t) S_{t-1}^T k_t)^T,    o_t = S_t^T q_t

with q and k L2-normalised and q scaled by Dk ** -0.5. The output is RMS-normed per head, times silu(z), and
projected back to D.

Packing: every document starts from a zero state and its convolution sees none of the previous document's tokens.
`chunked_delta_rule` runs the rule in chunks of C tokens (the WY form: within a chunk a triangular solve, between
chunks the state), all documents at once: each document is padded to whole chunks, the chunks are laid out so that
the j-th chunks of all documents are neighbours, and one loop over j carries every document's state forward.
`recurrent_delta_rule` is the per-token form the tests hold it to.

Kernels: on CUDA, where flash-linear-attention (`fla`, an optional extra) imports and can train (its backward
refuses some Triton versions on Hopper), its Triton kernels run the convolution and the rule with cu_seqlens
(`pick_kernel`, `describe`); else the torch path here (zoo.core.delta_chunks: the chunk algebra with its backward
written out, the decays of fp32 inputs from fp64 sums). Where fla's forward runs but its backward is refused, a pass
that takes no gradient (no_grad: generation's prefill, evaluation, preference tuning's reference log-probs) runs
fla's forward (its outputs equal the torch path's within tests/test_qwen3_5_gpu.py's tolerance). A layer's `kernel`
("auto", "torch" or "fla") overrides the choice.

Decoding (zoo.generate, through the layer's `use_cache`): the prefill keeps each document's final state
(`chunked_delta_rule`'s `states_out`) and its last K - 1 inputs of the convolution; `conv_step` and
`delta_rule_step` then run one token a sequence on.

Sequence parallelism (zoo.parallel, through `sequence_parallel` and the `HeadExchange` it hands the layer): under
Ulysses each rank runs whole documents for its share of the heads. Under ring (and hybrid: Ulysses heads inside a
group, ring across groups) a document crosses ranks, and each rank runs its pieces of it: the convolution continues
from the K - 1 inputs before the piece (`halo`), and the rule runs once from the state [I | 0] with v widened to
[0 | v], which gives, beside the outputs from a zero state, q_t^T P_t (P_t the piece's map of the state up to t)
and the piece's whole map S_end = A S_start + B. `carry` composes the earlier pieces' maps (one all-gather, no chain
of ranks waiting on each other) into each piece's state at its start, S_in, and o_t += S_in^T P_t^T q_t. The ring
path runs zoo's torch kernels.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from zoo.core.contract import GatedDeltaNetSpec, NormSpec
from zoo.core.delta_rule import (
    causal_conv,
    causal_conv_continued,
    chunk_layout,
    chunked_delta_rule,
    conv_step,
    delta_rule_step,
    doc_positions,
    from_states,
    l2_normalize,
    recurrent_delta_rule,
)
from zoo.core.fla import fla_documents_eager, fla_forward_refused, fla_kernels, fla_refused
from zoo.core.forks import ForkRows
from zoo.core.internals import run_eagerly
from zoo.core.mixer import HeadExchange, MixerCache
from zoo.core.packing import Packed
from zoo.errors import ZooError

__all__ = [  # the rule's tensor functions (zoo.core.delta_rule) are read from here too
    "GatedDeltaNet", "causal_conv", "chunk_layout", "chunked_delta_rule", "conv_step", "delta_rule_step", "describe",
    "doc_positions", "l2_normalize", "pick_kernel", "recurrent_delta_rule", "run_documents",
]

KERNELS = ("auto", "torch", "fla")


def pick_kernel(x: Tensor, kernel: str = "auto", head_dims: tuple[int, int] = (128, 128), grad: bool = True) -> str:
    """"fla" where flash-linear-attention runs on x's device and dtype at these key and value head dims: a training
    step (zoo.core.fla.fla_refused), or with `grad` False (no_grad: prefill, evaluation, reference log-probs) its
    forward alone, which runs where its backward is refused (fla_forward_refused); else "torch". An explicit choice
    is kept ("fla" where it cannot run refused in one line)."""
    if kernel not in KERNELS:
        raise ZooError(f"unknown Gated DeltaNet kernel {kernel!r}; expected one of {', '.join(KERNELS)}")
    if kernel == "torch":
        return kernel
    refused = (fla_refused if grad else fla_forward_refused)(x.device, x.dtype, head_dims)
    if kernel == "fla" and refused:
        raise ZooError(f"Gated DeltaNet kernel 'fla' cannot run here: {refused}")
    return "torch" if refused else "fla"


def describe(device: torch.device | str = "cuda", dtype: torch.dtype = torch.bfloat16,
             head_dims: tuple[int, int] = (128, 128)) -> str:
    """What a Gated DeltaNet layer of these head dims runs on `device` in `dtype` in this process ("auto"), and
    why not fla where it does not, e.g. describe("cuda")."""
    device = torch.device(device)
    kernels, refused = fla_kernels(), fla_refused(device, dtype, head_dims)
    if kernels is not None and refused is None:
        return f"fla {kernels[2]}: chunk_gated_delta_rule and causal_conv1d (Triton), with cu_seqlens"
    why = "" if device.type != "cuda" else f" ({refused})"
    torch_path = f"torch: zoo's chunked delta rule (documents side by side, chunks of 64) and causal convolution{why}"
    if kernels is not None and fla_forward_refused(device, dtype, head_dims) is None:
        return f"{torch_path}; without gradients (no_grad) fla {kernels[2]}'s forward"
    return torch_path


def deltanet_flops(seqlens: Sequence[int], n_value_heads: int, key_head_dim: int, value_head_dim: int,
                   channels: int, conv_kernel: int, chunk: int) -> int:
    """Forward FLOPs of one Gated DeltaNet layer's convolution and chunked delta rule over documents of these
    lengths (the formula: the module docstring)."""
    C, Dk, Dv = chunk, key_head_dim, value_head_dim
    per_chunk = 4 * C * C * Dk + C * (C - 1) * (Dk + Dv) + 2 * C * C * Dv + 6 * C * Dk * Dv
    chunks = sum(-(-L // C) for L in seqlens)
    return 2 * channels * conv_kernel * sum(seqlens) + n_value_heads * per_chunk * chunks


class GatedRMSNorm(nn.Module):
    """RMSNorm over each value head, times silu(z): the weight multiplies the normed x cast back to x's dtype, the
    gate in fp32 (as transformers' Qwen3_5RMSNormGated)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor, z: Tensor) -> Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * x32.to(x.dtype) * F.silu(z.float())).to(x.dtype)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class Decay(nn.Module):
    """Each value head's decay in log space, g = -exp(A_log) * softplus(a + dt_bias), in fp32. Its own module so
    that init_weights finds it as a leaf with its own init (transformers': dt_bias 1, A = U(0.01, 16))."""

    def __init__(self, n_heads: int) -> None:
        super().__init__()
        self.A_log = nn.Parameter(torch.empty(n_heads))
        self.dt_bias = nn.Parameter(torch.empty(n_heads))
        self.reset_parameters()

    def forward(self, a_TH: Tensor) -> Tensor:
        return -self.A_log.float().exp() * F.softplus(a_TH.float() + self.dt_bias)

    def reset_parameters(self) -> None:
        if self.A_log.is_meta:
            return
        with torch.no_grad():
            self.A_log.copy_(torch.empty_like(self.A_log).uniform_(0.01, 16).log())
            nn.init.ones_(self.dt_bias)


class GatedDeltaNet(nn.Module):
    """A Gated DeltaNet layer as a decoder block's mixer (the module names are transformers' Qwen3_5GatedDeltaNet's).
    It takes the rotary tables as every mixer does, and uses none: its positions are its recurrence.

    A `zoo.core.mixer.Mixer`: under generation (`use_cache`) it keeps per sequence the last conv_kernel - 1
    inputs of its convolution [n, K - 1, C] and the delta rule's state [n, Hv, Dk, Dv] (fp32), filled by the
    prefill and advanced one token a decode step (in place, eager or compiled); under Ulysses sequence parallelism
    (`sequence_parallel`) it trades its q/k/v channels, beta and g for whole documents of its share of the heads."""

    def __init__(self, dim: int, spec: GatedDeltaNetSpec, norm: NormSpec, norm_eps: float, layer: int) -> None:
        super().__init__()
        Hk, Hv, Dk, Dv = spec.n_key_heads, spec.n_value_heads, spec.key_head_dim, spec.value_head_dim
        if Hv % Hk:
            raise ZooError(f"linear_num_value_heads ({Hv}) must be a multiple of linear_num_key_heads ({Hk})")
        self.key_dim, self.value_dim, self.value_head_dim = Hk * Dk, Hv * Dv, Dv
        self.key_head_dim, self.chunk, self.layer = Dk, spec.chunk, layer
        channels = 2 * Hk * Dk + Hv * Dv
        self.in_proj_qkv = nn.Linear(dim, channels, bias=False)
        self.in_proj_z = nn.Linear(dim, Hv * Dv, bias=False)
        self.in_proj_b = nn.Linear(dim, Hv, bias=False)
        self.in_proj_a = nn.Linear(dim, Hv, bias=False)
        self.conv1d = nn.Conv1d(channels, channels, spec.conv_kernel, groups=channels, bias=False)
        self.decay = Decay(Hv)
        self.norm = GatedRMSNorm(Dv, norm_eps)
        self.out_proj = nn.Linear(Hv * Dv, dim, bias=False)
        self.kernel = "auto"  # or "torch" / "fla": which kernels run the convolution and the rule (pick_kernel)
        self.cache: MixerCache | None = None  # generation's (use_cache)
        self.exchange: HeadExchange | None = None  # sequence parallelism's (sequence_parallel)

    def forward(self, x_TD: Tensor, cos_TH: Tensor, sin_TH: Tensor, packed: Packed) -> Tensor:
        T, Dv = x_TD.shape[0], self.value_head_dim
        mixed_TC = self.in_proj_qkv(x_TD)  # q, k, v before the convolution
        beta_TH = self.in_proj_b(x_TD).sigmoid()
        g_TH = self.decay(self.in_proj_a(x_TD))
        if packed.forks() is not None:
            if self.cache is not None:
                raise ZooError("generation prefills whole prompts; this pack's documents fork (zoo.core.forks)")
            o_THV = forked_documents_eager(mixed_TC, self.conv1d.weight[:, 0], beta_TH, g_TH, packed,
                                           self.key_head_dim, Dv, self.chunk)
        elif self.cache is not None:
            o_THV = self._generation(self.cache, mixed_TC, beta_TH, g_TH, packed)
        elif self.exchange is not None and self.exchange.holds(packed):
            o_THV = self._sequence_parallel(self.exchange, mixed_TC, beta_TH, g_TH, packed)
        else:
            o_THV = run_documents(self, mixed_TC, beta_TH, g_TH, packed)
        o_THV = self.norm(o_THV, self.in_proj_z(x_TD).view(T, -1, Dv))
        return self.out_proj(o_THV.reshape(T, -1))

    # ---- the Mixer contract ----

    def generation_bytes(self, n: int, capacity: int, itemsize: int) -> int:
        """The fp32 state and the last conv_kernel - 1 inputs per sequence, whatever the capacity."""
        channels, K = self.conv1d.in_channels, self.conv1d.kernel_size[0]
        Hv = self.value_dim // self.value_head_dim
        return n * (4 * Hv * self.key_head_dim * self.value_head_dim + (K - 1) * channels * itemsize)

    def use_cache(self, cache: MixerCache | None) -> None:
        self.cache = cache

    def kernel_choice(self, device: torch.device, dtype: torch.dtype) -> str:
        if self.kernel == "torch":
            return "torch: zoo's chunked delta rule and causal convolution (kernel='torch')"
        return describe(device, dtype, (self.key_head_dim, self.value_head_dim))

    def mixing_flops(self, seqlens: Sequence[int]) -> int:
        return deltanet_flops(seqlens, self.value_dim // self.value_head_dim, self.key_head_dim,
                              self.value_head_dim, self.conv1d.in_channels, self.conv1d.kernel_size[0], self.chunk)

    def sequence_parallel(self, exchange: HeadExchange | None, mode: str) -> None:
        """Any mode: Ulysses (and hybrid's Ulysses groups) split the key and value heads, ring continues each
        document's convolution and state from rank to rank (the module docstring)."""
        if exchange is not None:
            Hk, Hv = self.key_dim // self.key_head_dim, self.value_dim // self.value_head_dim
            if Hk % exchange.size or Hv % exchange.size:
                raise ZooError(f"{mode} sequence parallel splits a Gated DeltaNet layer's {Hk} key and {Hv} value "
                               f"heads over {exchange.size} Ulysses ranks; both must be divisible by it (use mode "
                               "'ring', or a hybrid ulysses_size dividing both)")
        self.exchange = exchange

    # ---- generation and sequence parallelism ----

    def _generation(self, cache: MixerCache, mixed_TC: Tensor, beta_TH: Tensor, g_TH: Tensor,
                    packed: Packed) -> Tensor:
        """The prefill runs whole documents as `run_documents` does and keeps, per sequence, the last
        conv_kernel - 1 inputs of the convolution and the delta rule's final state; a decode step (a pack with
        `doc_len`: one token of each sequence) runs the convolution and the rule one token on from them, updating
        them in place (no host sync: compiled whole)."""
        Dk, Dv, i = self.key_head_dim, self.value_head_dim, self.layer
        conv_CK = self.conv1d.weight[:, 0]
        Hv = beta_TH.shape[1]
        Hk = (mixed_TC.shape[1] - Hv * Dv) // (2 * Dk)
        if packed.doc_len is None:
            return self._prefill(cache, mixed_TC, beta_TH, g_TH, packed, conv_CK)
        qkv_nC = F.silu(conv_step(mixed_TC, cache.kept(i, "conv"), conv_CK))
        q_nC, k_nC, v_nC = qkv_nC.split([Hk * Dk, Hk * Dk, Hv * Dv], dim=-1)
        n = mixed_TC.shape[0]
        return delta_rule_step(q_nC.view(n, Hk, Dk), k_nC.view(n, Hk, Dk), v_nC.view(n, Hv, Dv), g_TH, beta_TH,
                               cache.kept(i, "state"))

    def _prefill(self, cache: MixerCache, mixed_TC: Tensor, beta_TH: Tensor, g_TH: Tensor, packed: Packed,
                 conv_CK: Tensor) -> Tensor:
        cu, i = packed.cu_seqlens.long(), self.layer
        states: list[Tensor] = []
        o_THV = run_documents(self, mixed_TC, beta_TH, g_TH, packed, states_out=states)
        # each document's last K - 1 inputs, zeros where it has fewer
        K = conv_CK.shape[-1]
        rows_nK = cu[1:, None] - (K - 1) + torch.arange(K - 1, device=cu.device)
        window_nKC = mixed_TC[rows_nK.clamp(min=0)] * (rows_nK >= cu[:-1, None])[..., None].to(mixed_TC.dtype)
        cache.keep(i, "conv", window_nKC)
        cache.keep(i, "state", states[0])
        return o_THV

    def _sequence_parallel(self, exchange: HeadExchange, mixed_TC: Tensor, beta_TH: Tensor, g_TH: Tensor,
                           packed: Packed) -> Tensor:
        """The layer's q/k/v channels (before the convolution), beta and g go from [T_rank, all heads] to
        [T_group, heads / U] in one exchange (none where U = 1), so each rank runs the convolution and the delta
        rule over the group's documents (or pieces of them, `_continued`) for its share of the key and value heads
        (its channels' convolution weights), and the outputs come back by the reverse exchange. Value head j reads
        key head j // (Hv / Hk): contiguous shares of both keep every pair on one rank."""
        U, u = exchange.size, exchange.position
        T, Dk, Dv = mixed_TC.shape[0], self.key_head_dim, self.value_head_dim
        Hk, Hv = self.key_dim // Dk, self.value_dim // Dv
        q_TC, k_TC, v_TC = mixed_TC.split([Hk * Dk, Hk * Dk, Hv * Dv], dim=-1)
        wide = torch.promote_types(torch.promote_types(mixed_TC.dtype, beta_TH.dtype), g_TH.dtype)  # exact casts
        parts = [q_TC.view(T, U, -1), k_TC.view(T, U, -1), v_TC.view(T, U, -1), beta_TH.view(T, U, -1),
                 g_TH.view(T, U, -1)]
        widths = [p.shape[-1] for p in parts]
        recv, whole = exchange.scatter(torch.cat([p.to(wide) for p in parts], dim=-1), packed)
        q_tc, k_tc, v_tc, beta_th, g_th = recv.split(widths, dim=-1)
        mixed_tc = torch.cat([q_tc, k_tc, v_tc], dim=-1).to(mixed_TC.dtype)
        conv_CK = self.conv1d.weight[:, 0]
        kq, kv = Hk * Dk // U, Hv * Dv // U  # this rank's channels of q (and of k), of v
        conv_ck = torch.cat([conv_CK[u * kq:(u + 1) * kq], conv_CK[Hk * Dk + u * kq:Hk * Dk + (u + 1) * kq],
                             conv_CK[2 * Hk * Dk + u * kv:2 * Hk * Dk + (u + 1) * kv]])
        beta_th, g_th = beta_th.to(beta_TH.dtype), g_th.to(g_TH.dtype)
        if exchange.crosses(packed):
            o_thV = continued_documents_eager(exchange, mixed_tc, beta_th, g_th, whole, packed, conv_ck,
                                              Dk, Dv, self.chunk)
        else:
            o_thV = run_documents(self, mixed_tc, beta_th, g_th, whole, conv_ck)
        back_TUc = exchange.gather(o_thV.reshape(o_thV.shape[0], -1), packed)
        return back_TUc.reshape(T, Hv, Dv)

def continued_documents(exchange: HeadExchange, mixed_tC: Tensor, beta_tH: Tensor, g_tH: Tensor, pieces: Packed,
                        packed: Packed, conv_CK: Tensor, Dk: int, Dv: int, chunk: int) -> Tensor:
    """[t, Hv', Dv] the convolution and the rule over pieces of documents that continue earlier pieces on other
    ranks (the module docstring): zoo's torch kernels, one exchange for the windows, one for the state maps."""
    t, C = mixed_tC.shape[0], chunk
    Hv = beta_tH.shape[1]
    Hk = (mixed_tC.shape[1] - Hv * Dv) // (2 * Dk)
    window_nWC = exchange.halo(mixed_tC, conv_CK.shape[-1] - 1, packed)
    qkv_tC = F.silu(causal_conv_continued(mixed_tC, conv_CK, window_nWC, pieces.cu_seqlens))
    q_tC, k_tC, v_tC = qkv_tC.split([Hk * Dk, Hk * Dk, Hv * Dv], dim=-1)
    wide = torch.promote_types(v_tC.dtype, torch.float32)
    v_tHX = torch.cat([v_tC.new_zeros(t, Hv, Dk, dtype=wide), v_tC.view(t, Hv, Dv).to(wide)], dim=-1)
    n = pieces.num_docs
    eye_nHKX = torch.cat([torch.eye(Dk, dtype=wide, device=v_tC.device).expand(n, Hv, Dk, Dk),
                          v_tC.new_zeros(n, Hv, Dk, Dv, dtype=wide)], dim=-1)
    layout = pieces.derived(("delta_chunks", C), lambda: chunk_layout(pieces.cu_seqlens, t, C))
    maps: list[Tensor] = []
    out_tHX = chunked_delta_rule(q_tC.view(t, -1, Dk), k_tC.view(t, -1, Dk), v_tHX, g_tH, beta_tH,
                                 pieces.cu_seqlens, C, layout, maps, eye_nHKX)
    qP_tHK, o_tHV = out_tHX.split([Dk, Dv], dim=-1)
    A_nHKK, B_nHKV = maps[0].split([Dk, Dv], dim=-1)
    S_nHKV = exchange.carry(A_nHKK, B_nHKV, packed)
    return (o_tHV + from_states(qP_tHK, S_nHKV, pieces.cu_seqlens, C, layout)).to(v_tC.dtype)


# as torch_documents (below): the pieces' chunk counts and the exchanges' sizes are read on the host
continued_documents_eager = run_eagerly(continued_documents)


def forked_documents(mixed_TC: Tensor, conv_CK: Tensor, beta_TH: Tensor, g_TH: Tensor, packed: Packed, Dk: int,
                     Dv: int, chunk: int) -> Tensor:
    """[T, Hv, Dv] the convolution and the rule over a pack whose documents fork (zoo.core.forks: a shared prompt
    and its two answers): the convolution over every piece at once, each continuing from the inputs before it on its
    path; the rule level by level (prompts, then answers), each piece from the final state of the piece it continues,
    as the two documents would reach it. zoo's torch kernels."""
    T, Hv = beta_TH.shape
    Hk = (mixed_TC.shape[1] - Hv * Dv) // (2 * Dk)
    W, forks = conv_CK.shape[-1] - 1, packed.forks()
    assert forks is not None

    def build() -> tuple[ForkRows, list[tuple[Tensor, list[int]]]]:
        rows = ForkRows(forks, T, W, packed.device)
        return rows, [chunk_layout(cu, ix.numel(), chunk) for ix, cu, _ in rows.levels]

    rows, layouts = packed.derived(("forked pieces", chunk, W), build)
    before_mW = rows.before_mW
    window_mWC = mixed_TC[before_mW.clamp(min=0)] * (before_mW >= 0)[..., None].to(mixed_TC.dtype)
    qkv_TC = F.silu(causal_conv_continued(mixed_TC, conv_CK, window_mWC, rows.cu_pieces))
    q_TC, k_TC, v_TC = qkv_TC.split([Hk * Dk, Hk * Dk, Hv * Dv], dim=-1)
    q_THD, k_THD, v_THV = q_TC.view(T, Hk, Dk), k_TC.view(T, Hk, Dk), v_TC.view(T, Hv, Dv)
    outs: list[Tensor] = []
    states: list[Tensor] = []
    for level, ((ix, cu, parents), layout) in enumerate(zip(rows.levels, layouts)):
        S_in = None if parents is None else states[-1][parents]
        # the last level's final states start nothing
        kept: list[Tensor] | None = [] if level + 1 < len(layouts) else None
        outs.append(chunked_delta_rule(q_THD[ix], k_THD[ix], v_THV[ix], g_TH[ix], beta_TH[ix], cu, chunk, layout,
                                       kept, S_in))
        states += kept or []
    return torch.cat(outs)[rows.back_T]


# as torch_documents: the levels' chunk counts are read on the host
forked_documents_eager = run_eagerly(forked_documents)


def run_documents(layer: GatedDeltaNet, mixed_TC: Tensor, beta_TH: Tensor, g_TH: Tensor, packed: Packed,
                  conv_CK: Tensor | None = None, states_out: list[Tensor] | None = None) -> Tensor:
    """[T, Hv', Dv] the convolution and the gated delta rule over the pack's whole documents, for the heads the
    channels of `mixed_TC` hold (all of the layer's, or a sequence-parallel rank's share, with `conv_CK` its
    channels' convolution weights), by the layer's kernel. `states_out`: as chunked_delta_rule's."""
    if packed.doc_len is not None or packed.part_of() is not None:
        raise ZooError("a Gated DeltaNet layer runs whole documents from a zero state; this pack holds parts of "
                       "documents (a sequence-parallel shard or a decode step), which it cannot run yet")
    Dk, Dv = layer.key_head_dim, layer.value_head_dim
    conv_CK = layer.conv1d.weight[:, 0] if conv_CK is None else conv_CK
    Hv = beta_TH.shape[1]
    Hk = (mixed_TC.shape[1] - Hv * Dv) // (2 * Dk)  # the channels hold q and k of Hk key heads, v of Hv value heads
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (mixed_TC, conv_CK, beta_TH, g_TH))
    if pick_kernel(mixed_TC, layer.kernel, (Dk, Dv), grad) == "fla":
        return fla_documents_eager(mixed_TC, conv_CK, beta_TH, g_TH, packed.cu_seqlens, Hk, Dk, Dv, states_out)
    return torch_documents_eager(mixed_TC, conv_CK, beta_TH, g_TH, packed, Hk, Dk, Dv, layer.chunk, states_out)


def torch_documents(mixed_TC: Tensor, conv_CK: Tensor, beta_TH: Tensor, g_TH: Tensor, packed: Packed, Hk: int,
                    Dk: int, Dv: int, chunk: int, states_out: list[Tensor] | None = None) -> Tensor:
    """[T, Hv, Dv] run_documents' torch path: the causal convolution (+ SiLU) and the chunked delta rule."""
    T, Hv = beta_TH.shape
    pos_T = packed.derived("doc_positions", lambda: doc_positions(packed.cu_seqlens, T))[1]
    qkv_TC = F.silu(causal_conv(mixed_TC, conv_CK, pos_T))
    q_TC, k_TC, v_TC = qkv_TC.split([Hk * Dk, Hk * Dk, Hv * Dv], dim=-1)
    layout = packed.derived(("delta_chunks", chunk), lambda: chunk_layout(packed.cu_seqlens, T, chunk))
    return chunked_delta_rule(q_TC.view(T, -1, Dk), k_TC.view(T, -1, Dk), v_TC.view(T, -1, Dv), g_TH, beta_TH,
                              packed.cu_seqlens, chunk, layout, states_out)


# the chunked rule's step loop follows the pack's documents (their chunk counts, read on the host): traced, it would
# recompile for every new pack, so a compiled block runs it eagerly
torch_documents_eager = run_eagerly(torch_documents)
