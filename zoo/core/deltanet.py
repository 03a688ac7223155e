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
(`pick_kernel`, `describe`); else the torch path here. A layer's `kernel` ("auto", "torch" or "fla") overrides the
choice.

Decoding (zoo.generate): the prefill keeps each document's final state (`chunked_delta_rule`'s `states_out`) and
its last K - 1 inputs of the convolution; `conv_step` and `delta_rule_step` then run one token a sequence on.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from zoo.core.contract import GatedDeltaNetSpec, NormSpec
from zoo.core.fla import fla_documents_eager, fla_kernels, fla_refused
from zoo.core.internals import run_eagerly
from zoo.core.packing import Packed
from zoo.errors import ZooError


def l2_normalize(x: Tensor, eps: float = 1e-6) -> Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (the eps inside the root, as flash-linear-attention has it)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def doc_positions(cu_seqlens: Tensor, num_tokens: int) -> tuple[Tensor, Tensor]:
    """([T] each token's document, [T] its position within it) from cu_seqlens [n+1]."""
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    doc_T = torch.repeat_interleave(torch.arange(lens.numel(), device=cu_seqlens.device), lens,
                                    output_size=num_tokens)
    return doc_T, torch.arange(num_tokens, device=cu_seqlens.device) - cu_seqlens[doc_T]


def causal_conv(x_TC: Tensor, weight_CK: Tensor, pos_T: Tensor) -> Tensor:
    """Depthwise causal convolution of width K per channel, restarting at every document: tap s reads the token s
    back, and only where that token is in the same document (pos_T >= s). Summed in fp32 and rounded once, as a
    convolution kernel accumulates."""
    K = weight_CK.shape[-1]
    x32_TC, w32_CK = _wide(x_TC), _wide(weight_CK)
    out_TC = x32_TC * w32_CK[:, K - 1]
    for s in range(1, K):
        shifted_TC = F.pad(x32_TC[:-s], (0, 0, s, 0)) * (pos_T >= s)[:, None].to(x32_TC.dtype)
        out_TC = out_TC + shifted_TC * w32_CK[:, K - 1 - s]
    return out_TC.to(x_TC.dtype)


def _prepare(q_THD: Tensor, k_THD: Tensor, v_THV: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """q and k repeated to the value heads (value head j reads key head j // (Hv / Hk)), L2-normalised, q scaled;
    all in fp32 (fp64 stays fp64: the tests compare the two forms there)."""
    groups = v_THV.shape[1] // k_THD.shape[1]
    q, k = (_wide(x).repeat_interleave(groups, dim=1) for x in (q_THD, k_THD))
    q, k = l2_normalize(q), l2_normalize(k)
    return q * q.shape[-1] ** -0.5, k, _wide(v_THV)


def _wide(x: Tensor) -> Tensor:
    return x.to(torch.promote_types(x.dtype, torch.float32))


def recurrent_delta_rule(q_THD: Tensor, k_THD: Tensor, v_THV: Tensor, g_TH: Tensor, beta_TH: Tensor,
                         cu_seqlens: Tensor) -> Tensor:
    """[T, Hv, Dv] the gated delta rule token by token, each document from a zero state: the reference the chunked
    form is tested against (slow: a Python loop over tokens)."""
    q, k, v = _prepare(q_THD, k_THD, v_THV)
    g, beta = _wide(g_TH), _wide(beta_TH)
    out = torch.zeros_like(v)
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        S_HDV = v.new_zeros(v.shape[1], q.shape[-1], v.shape[-1])
        for t in range(start, end):
            S_HDV = S_HDV * g[t].exp()[:, None, None]
            delta_HV = (v[t] - torch.einsum("hdv,hd->hv", S_HDV, k[t])) * beta[t][:, None]
            S_HDV = S_HDV + k[t][:, :, None] * delta_HV[:, None, :]
            out[t] = torch.einsum("hdv,hd->hv", S_HDV, q[t])
    return out.to(v_THV.dtype)


def chunk_layout(cu_seqlens: Tensor, num_tokens: int, C: int) -> tuple[Tensor, list[int]]:
    """Where each token goes in the chunked layout, and how many documents are still running at each step.

    Documents are ranked by their number of chunks, most first; the j-th chunks of all documents that have one are
    consecutive (step j), in rank order, so that the documents running at step j are always the first ones.
    Returns (slot_T: token t's row in the flat [M * C] layout, active: documents with a j-th chunk, per j)."""
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    chunks_n = (lens + C - 1) // C
    order = torch.argsort(chunks_n, descending=True, stable=True)
    rank_n = torch.empty_like(order)
    rank_n[order] = torch.arange(order.numel(), device=order.device)
    max_chunks = int(chunks_n.max()) if chunks_n.numel() else 0
    active_J = (chunks_n[None, :] > torch.arange(max_chunks, device=lens.device)[:, None]).sum(1)
    start_J = torch.cumsum(active_J, 0) - active_J  # the first chunk of step j
    doc_T, pos_T = doc_positions(cu_seqlens, num_tokens)
    slot_T = (start_J[pos_T // C] + rank_n[doc_T]) * C + pos_T % C
    return slot_T, active_J.tolist()


def chunked_delta_rule(q_THD: Tensor, k_THD: Tensor, v_THV: Tensor, g_TH: Tensor, beta_TH: Tensor,
                       cu_seqlens: Tensor, chunk: int = 64, layout: tuple[Tensor, list[int]] | None = None,
                       states_out: list[Tensor] | None = None) -> Tensor:
    """[T, Hv, Dv] the gated delta rule over every document of the pack from a zero state, in chunks of `chunk`
    tokens, in fp32 (cast back to v's dtype).

    Within a chunk (tokens i, j; G the cumulative decay from the chunk's start) the writes are solved at once:
    (I + A) u = beta v and (I + A) w = beta k exp(G), with A_ij = beta_i k_i.k_j exp(G_i - G_j) for j < i. Across
    chunks, with S the state at the chunk's start: v' = u - w S, o = (q exp(G)) S + tril(q k^T exp(G_i - G_j)) v',
    and S becomes exp(G_last) S + (k exp(G_last - G))^T v'. Padding (past a document's end, in its last chunk) has
    k = v = beta = 0 and g = 0: it writes nothing and decays nothing. `layout`: chunk_layout's, where a caller keeps
    it for the pack (every layer of a model shares it). `states_out`: a list that gets each document's final state
    [n, Hv, Dk, Dv] in fp32 appended (generation's prefill keeps it to decode from)."""
    T, Hv, Dv = v_THV.shape
    C = chunk
    q, k, v = _prepare(q_THD, k_THD, v_THV)
    Dk = q.shape[-1]
    slot_T, active = layout or chunk_layout(cu_seqlens, T, C)
    M = sum(active)

    def chunked(x_T: Tensor) -> Tensor:  # [T, ...] -> [M, Hv, C, ...], zeros where no token lands
        flat = x_T.new_zeros(M * C, *x_T.shape[1:]).index_copy(0, slot_T, x_T)
        return flat.view(M, C, *x_T.shape[1:]).transpose(1, 2).contiguous()

    q_MHCD, k_MHCD, v_MHCV = chunked(q), chunked(k), chunked(v)
    g_MHC, beta_MHC = chunked(_wide(g_TH)), chunked(_wide(beta_TH))
    G_MHC = g_MHC.cumsum(-1)
    fade_MHC = G_MHC.exp()  # the decay from the chunk's start
    lower = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    # exp(G_i - G_j) for j <= i, 0 above the diagonal (masked before the exp: above it the difference is positive)
    decay_MHCC = (G_MHC[..., :, None] - G_MHC[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    kb_MHCD = k_MHCD * beta_MHC[..., None]
    A_MHCC = (kb_MHCD @ k_MHCD.transpose(-1, -2) * decay_MHCC).tril(-1)
    # both systems in one solve (unitriangular: the diagonal of I + A is never read, so A alone is passed)
    rhs = torch.cat([v_MHCV * beta_MHC[..., None], kb_MHCD * fade_MHC[..., None]], dim=-1)
    u_MHCV, w_MHCD = torch.linalg.solve_triangular(A_MHCC, rhs, upper=False, unitriangular=True).split([Dv, Dk], -1)
    attn_MHCC = q_MHCD @ k_MHCD.transpose(-1, -2) * decay_MHCC
    q_decayed = q_MHCD * fade_MHC[..., None]
    last_MH = G_MHC[..., -1]
    k_decayed = k_MHCD * (last_MH[..., None] - G_MHC).exp()[..., None]

    S_nHDV = q.new_zeros(active[0] if active else 0, Hv, Dk, Dv)  # one state per running document
    outs, finished = [], []
    # each step's rows as its own piece: split's backward assembles the gradient once, where slicing inside the loop
    # would make every step's backward write a zero tensor of the whole pack (quadratic in its chunks)
    steps = zip(active, *(x.split(active) for x in (u_MHCV, w_MHCD, q_decayed, attn_MHCC, last_MH.exp(),
                                                   k_decayed.transpose(-1, -2))))
    for n, u, w, q_dec, attn, fade, k_dec_T in steps:  # step j: the j-th chunks of the first n documents
        finished.append(S_nHDV[n:])
        S_nHDV = S_nHDV[:n]  # the documents past their last chunk are done
        v_new = u - w @ S_nHDV
        outs.append(q_dec @ S_nHDV + attn @ v_new)
        S_nHDV = S_nHDV * fade[..., None, None] + k_dec_T @ v_new
    if states_out is not None:  # finished in rank order from the last (lowest ranks) back; empty documents: zero
        S_rHDV = torch.cat([S_nHDV, *reversed(finished)])
        lens = cu_seqlens[1:] - cu_seqlens[:-1]
        order = torch.argsort((lens + C - 1) // C, descending=True, stable=True)  # chunk_layout's ranks
        S_rHDV = torch.cat([S_rHDV, S_rHDV.new_zeros(order.numel() - S_rHDV.shape[0], Hv, Dk, Dv)])
        states_out.append(torch.empty_like(S_rHDV).index_copy(0, order, S_rHDV))
    if not outs:
        return v_THV.new_zeros(T, Hv, Dv)
    o_MHCV = torch.cat(outs)
    o_T = o_MHCV.transpose(1, 2).reshape(M * C, Hv, Dv)[slot_T]
    return o_T.to(v_THV.dtype)


KERNELS = ("auto", "torch", "fla")


def pick_kernel(x: Tensor, kernel: str = "auto", head_dims: tuple[int, int] = (128, 128)) -> str:
    """"fla" where flash-linear-attention runs a training step on x's device and dtype at these key and value head
    dims (zoo.core.fla.fla_refused), else "torch"; an explicit choice is kept ("fla" where it cannot run refused in one
    line)."""
    if kernel not in KERNELS:
        raise ZooError(f"unknown Gated DeltaNet kernel {kernel!r}; expected one of {', '.join(KERNELS)}")
    if kernel == "torch":
        return kernel
    refused = fla_refused(x.device, x.dtype, head_dims)
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
    return f"torch: zoo's chunked delta rule (documents side by side, chunks of 64) and causal convolution{why}"


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


# (layer, q/k/v channels [T, C] before the convolution, beta [T, Hv], g [T, Hv], pack) -> [T, Hv, Dv]
Mix = Callable[["GatedDeltaNet", Tensor, Tensor, Tensor, Packed], Tensor]


class GatedDeltaNet(nn.Module):
    """A Gated DeltaNet layer as a decoder block's mixer (the module names are transformers' Qwen3_5GatedDeltaNet's).
    It takes the rotary tables as every mixer does, and uses none: its positions are its recurrence."""

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
        # how the convolution and the delta rule run over the pack's documents: `run_documents`, unless sequence
        # parallelism (zoo.parallel.sequence) installs its own, which gathers whole documents for some heads
        self.mix: Mix | None = None
        self.kernel = "auto"  # or "torch" / "fla": which kernels run the convolution and the rule (pick_kernel)

    def forward(self, x_TD: Tensor, cos_TH: Tensor, sin_TH: Tensor, packed: Packed) -> Tensor:
        T, Dv = x_TD.shape[0], self.value_head_dim
        mixed_TC = self.in_proj_qkv(x_TD)  # q, k, v before the convolution
        beta_TH = self.in_proj_b(x_TD).sigmoid()
        g_TH = self.decay(self.in_proj_a(x_TD))
        o_THV = (self.mix or run_documents)(self, mixed_TC, beta_TH, g_TH, packed)
        o_THV = self.norm(o_THV, self.in_proj_z(x_TD).view(T, -1, Dv))
        return self.out_proj(o_THV.reshape(T, -1))


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
    if pick_kernel(mixed_TC, layer.kernel, (Dk, Dv)) == "fla":
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


def conv_step(x_nC: Tensor, window_nKC: Tensor, weight_CK: Tensor) -> Tensor:
    """[n, C] one new token per sequence through the causal convolution: `window_nKC` [n, K - 1, C] holds each
    sequence's last K - 1 inputs (zeros before its start) and gets x_nC shifted in, in place. Summed in fp32 and
    rounded once, as `causal_conv` (tap s reads the token s back: row K - 1 - s of the K taps, weight column
    K - 1 - s)."""
    taps_nKC = torch.cat([window_nKC, x_nC[:, None].to(window_nKC.dtype)], dim=1)
    window_nKC.copy_(taps_nKC[:, 1:])
    return (_wide(taps_nKC) * _wide(weight_CK).T).sum(1).to(x_nC.dtype)


def delta_rule_step(q_nHD: Tensor, k_nHD: Tensor, v_nHV: Tensor, g_nH: Tensor, beta_nH: Tensor,
                    S_nHDV: Tensor) -> Tensor:
    """[n, Hv, Dv] one new token per sequence through the gated delta rule (the module docstring's recurrence),
    from each sequence's state S_nHDV (fp32), which it advances in place."""
    q, k, v = _prepare(q_nHD, k_nHD, v_nHV)
    S = S_nHDV * _wide(g_nH).exp()[..., None, None]
    delta_nHV = (v - torch.einsum("nhdv,nhd->nhv", S, k)) * _wide(beta_nH)[..., None]
    S = S + k[..., :, None] * delta_nHV[..., None, :]
    S_nHDV.copy_(S)
    return torch.einsum("nhdv,nhd->nhv", S, q).to(v_nHV.dtype)
