"""The gated delta rule (Qwen3.5's Gated DeltaNet, zoo.core.deltanet) as tensor functions over a packed batch:
the causal convolution, the rule token by token (the reference) and in chunks (what runs), and one decode step of
each. Shapes: T tokens, Hk key heads, Hv value heads (a multiple of Hk), Dk key head dim, Dv value head dim,
C chunk length, M chunks of the pack, n sequences.

Per value head, a state S [Dk, Dv] runs

    S_t = exp(g_t) S_{t-1} + beta_t k_t (v_t - exp(g_t) S_{t-1}^T k_t)^T,    o_t = S_t^T q_t

with q and k L2-normalised and q scaled by Dk ** -0.5; every document starts from a zero state.
`chunked_delta_rule` runs all documents at once: each padded to whole chunks, the j-th chunks of all documents
neighbours, one loop over j carrying every document's state forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from zoo.core.delta_chunks import chunk_rule, from_chunks, to_chunks, to_chunks_normed


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


def causal_conv_continued(x_TC: Tensor, weight_CK: Tensor, window_nWC: Tensor, cu_seqlens: Tensor) -> Tensor:
    """`causal_conv` over pieces of documents (cu_seqlens), piece i continuing from `window_nWC[i]`, the W = K - 1
    inputs before it in its document (zeros before the document's start): the convolution runs over [window;
    piece] and keeps the piece's rows, bit-equal to it over the whole document (a zero row adds the exact zero a
    masked tap adds)."""
    (T, C), (n, W) = x_TC.shape, window_nWC.shape[:2]
    doc_T, pos_T = doc_positions(cu_seqlens, T)
    rows_T = torch.arange(T, device=x_TC.device) + W * (doc_T + 1)  # where each token lands, after its window
    rows_nW = ((cu_seqlens[:-1].long() + W * torch.arange(n, device=x_TC.device))[:, None]
               + torch.arange(W, device=x_TC.device)).reshape(-1)
    ext_TC = x_TC.new_zeros(T + n * W, C).index_copy(0, rows_T, x_TC).index_copy(
        0, rows_nW, window_nWC.reshape(n * W, C).to(x_TC.dtype))
    pos_ext = pos_T.new_zeros(T + n * W).index_copy(0, rows_T, pos_T + W).index_copy(
        0, rows_nW, torch.arange(W, device=x_TC.device).repeat(n))
    return causal_conv(ext_TC, weight_CK, pos_ext)[rows_T]


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
                       states_out: list[Tensor] | None = None, states_in: Tensor | None = None) -> Tensor:
    """[T, Hv, Dv] the gated delta rule over every document of the pack from a zero state (or from `states_in`
    [n, Hv, Dk, Dv], each document's state at its start), in chunks of `chunk` tokens, in fp32 (cast back to v's
    dtype; fp64 stays fp64), the cumulative decays of fp32 inputs in fp64.

    Within a chunk (tokens i, j; G the cumulative decay from the chunk's start) the writes are solved at once:
    (I + A) u = beta v and (I + A) w = beta k exp(G), with A_ij = beta_i k_i.k_j exp(G_i - G_j) for j < i. Across
    chunks, with S the state at the chunk's start: v' = u - w S, o = (q exp(G)) S + tril(q k^T exp(G_i - G_j)) v',
    and S becomes exp(G_last) S + (k exp(G_last - G))^T v'. Padding (past a document's end, in its last chunk) has
    k = v = beta = 0 and g = 0: it writes nothing and decays nothing. `layout`: chunk_layout's, where a caller keeps
    it for the pack (every layer of a model shares it). `states_out`: a list that gets each document's final state
    [n, Hv, Dk, Dv] in fp32 appended (generation's prefill keeps it to decode from)."""
    T, Hv, Dv = v_THV.shape
    C = chunk
    Dk = q_THD.shape[-1]
    slot_T, active = layout or chunk_layout(cu_seqlens, T, C)
    M = sum(active)
    groups = Hv // k_THD.shape[1]  # as _prepare: q and k repeated to the value heads, L2-normalised, q scaled
    q_MHCD = to_chunks_normed(q_THD, groups, Dk ** -0.5, slot_T, M, C)
    k_MHCD = to_chunks_normed(k_THD, groups, None, slot_T, M, C)

    # the cumulative decay in fp64 where the rule's inputs are fp32 (zoo.core.delta_chunks: exp of differences of
    # fp32 sums loses the decays' precision); from bf16 inputs in fp32, as transformers and fla sum it, whose bf16
    # outputs it then equals bit for bit
    g_dtype = torch.float64 if v_THV.dtype in (torch.float32, torch.float64) else torch.float32
    v_MHCV, g_MHC, beta_MHC = (to_chunks(x, slot_T, M, C) for x in (_wide(v_THV), g_TH.to(g_dtype), _wide(beta_TH)))
    n = active[0] if active else 0  # the documents with a chunk, in rank order
    order = None
    if states_in is not None or states_out is not None:
        lens = cu_seqlens[1:] - cu_seqlens[:-1]
        order = torch.argsort((lens + C - 1) // C, descending=True, stable=True)  # chunk_layout's ranks
    S_nHDV = q_MHCD.new_zeros(n, Hv, Dk, Dv)
    if states_in is not None:
        assert order is not None
        S_nHDV = _wide(states_in)[order[:n]]
    o_MHCV = q_MHCD.new_zeros(0, Hv, C, Dv)
    if M:
        o_MHCV, S_nHDV = chunk_rule(q_MHCD, k_MHCD, v_MHCV, g_MHC, beta_MHC, S_nHDV, active)
    if states_out is not None:  # back from rank order; empty documents (no chunk): their state at the start, or zero
        assert order is not None
        empty = order[n:]
        S_rHDV = torch.cat([S_nHDV, S_nHDV.new_zeros(len(empty), Hv, Dk, Dv) if states_in is None
                            else _wide(states_in)[empty]])
        states_out.append(torch.empty_like(S_rHDV).index_copy(0, order, S_rHDV))
    return from_chunks(o_MHCV, slot_T).to(v_THV.dtype)


def from_states(qP_THK: Tensor, S_nHKV: Tensor, cu_seqlens: Tensor, chunk: int,
                layout: tuple[Tensor, list[int]]) -> Tensor:
    """[T, Hv, Dv] what each document's state at its start adds to its outputs, (q_t^T P_t) S_in, given
    qP_THK = q_t^T P_t (P_t the map of the state from the document's start to t) and S_nHKV: one product per chunk
    of `layout` (chunk_layout's, chunks of `chunk` tokens), its document's state gathered once per chunk."""
    T, Hv, Dk = qP_THK.shape
    C, (slot_T, active) = chunk, layout
    M = sum(active)
    doc_T, pos_T = doc_positions(cu_seqlens, T)
    firsts = (pos_T % C == 0).nonzero().squeeze(1)  # each chunk's first token names its document
    doc_M = doc_T.new_zeros(M).index_copy(0, slot_T[firsts] // C, doc_T[firsts])
    qP_MHCK = qP_THK.new_zeros(M * C, Hv, Dk).index_copy(0, slot_T, qP_THK).view(M, C, Hv, Dk).transpose(1, 2)
    o_MHCV = qP_MHCK @ _wide(S_nHKV).to(qP_THK.dtype)[doc_M]
    return o_MHCV.transpose(1, 2).reshape(M * C, Hv, -1)[slot_T]


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
