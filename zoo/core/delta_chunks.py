"""The chunked gated delta rule's arithmetic as one autograd Function with its backward written out
(zoo.core.delta_rule lays the documents out in chunks and calls it). Autograd through the chunk algebra kept a few
dozen pack-sized intermediates and ran a few hundred small backward nodes; here the forward keeps what the backward
reads (each chunk's state at its start, the triangular inverse, the WY writes) and the backward runs as many
batched matmuls as the forward. On a CPU what costs beside the matmuls is memory: glibc maps every allocation over
32 MB afresh and the page faults of that cost as much as the arithmetic, so the per-chunk work runs a few chunks at
a time, the backward one step at a time, and only what the backward reads is pack-wide.

Shapes: M chunks (every document's, step-major: the j-th chunks of the documents still running are neighbours, in
rank order, as zoo.core.delta_rule.chunk_layout lays them out), H value heads, C chunk length, K key head dim,
V value head dim, n documents with at least one chunk (in rank order). Per chunk, with G the cumulative log decay
from its start and D_ij = exp(G_i - G_j) on and below the diagonal:

    B = strict_tril(k k^T * D),  T = (I + diag(beta) B)^-1,  [U | W] = T [beta v | beta exp(G) k]
    v' = U - W S,  o = (q exp(G)) S + tril(q k^T * D) v',  S_end = exp(G_C) S + (k exp(G_C - G))^T v'

S the chunk's state at its start (the document's S_in at its first chunk). The forward's loop over steps is one
batched matmul pair a step, the rest runs over runs of chunks; the backward's loop over steps (last first) also
runs each step's chunks' own gradients, as soon as their end states' gradients are known.

Precision: G is summed in g's dtype, which the caller makes fp64 for fp32 inputs, and every decay is the exp of a
difference of those sums (taken in fp64, the exp in fp32). A decay of -20 a token (Qwen3.5's A reaches 16) sums to
-1000 over a chunk, where fp32 keeps 6e-5 absolute: exp(G_i - G_j) of fp32 sums is off by that much relative, in
every fp32 implementation that sums in fp32 (transformers' fallback; the decays' gradients, A_log's, inherit it:
1.9e-4 from fp64 in tests/test_qwen3_5_moe.py, against 4e-5 here). The backward adds G's gradient up in fp64 too
(its terms cancel), and hands g's back in fp64.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def chunk_rule(q_MHCK: Tensor, k_MHCK: Tensor, v_MHCV: Tensor, g_MHC: Tensor, beta_MHC: Tensor, S_nHKV: Tensor,
               active: list[int]) -> tuple[Tensor, Tensor]:
    """(o [M, H, C, V], each document's state after its last chunk [n, H, K, V]) of the chunks laid out as the
    module docstring says, every document from its S_nHKV (zeros for a document's own start); padding rows (past a
    document's end) must hold k = v = beta = g = 0. Differentiable in every tensor argument."""
    return _ChunkRule.apply(q_MHCK, k_MHCK, v_MHCV, g_MHC, beta_MHC, S_nHKV, active)


def to_chunks(x_TH: Tensor, slot_T: Tensor, M: int, C: int) -> Tensor:
    """[T, H, ...] -> [M, H, C, ...]: token t to row slot_T[t] of the flat [M * C] chunk layout, zeros where no token
    lands (one scatter; its backward one gather)."""
    return _ToChunks.apply(x_TH, slot_T, M, C)


def from_chunks(x_MHC: Tensor, slot_T: Tensor) -> Tensor:
    """[M, H, C, ...] -> [T, H, ...], to_chunks undone (one gather; its backward one scatter)."""
    return _FromChunks.apply(x_MHC, slot_T)


def to_chunks_normed(x_THD: Tensor, groups: int, scale: float | None, slot_T: Tensor, M: int, C: int) -> Tensor:
    """[T, Hk, D] -> [M, Hk * groups, C, D] in fp32 (fp64 stays fp64): each head repeated to the `groups` value heads
    that read it, L2-normalised over D (eps 1e-6 inside the root), times `scale` where given, then laid out as
    to_chunks lays it. The same numbers as those steps one by one (x * rsqrt(sum(x^2) + eps), then * scale), with
    no pack-sized temporary: on CPU a few hundred tokens at a time; its backward the same way."""
    return _ToChunksNormed.apply(x_THD, groups, scale, slot_T, M, C)


def _token_blocks(x_TH: Tensor, width: int) -> list[slice]:
    """The tokens in runs whose [run, width] fp32 rows take about SLICE_BYTES (CPU: glibc maps every allocation over
    32 MB afresh); one run on a GPU."""
    T = x_TH.shape[0]
    m = T if x_TH.device.type != "cpu" else max(1, SLICE_BYTES // max(width * 4, 1))
    return [slice(i, min(i + m, T)) for i in range(0, T, m)]


class _ToChunksNormed(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, groups: int, scale: float | None, slot_T: Tensor, M: int, C: int) -> Tensor:
        T, Hk, D = x.shape
        wide = torch.promote_types(x.dtype, torch.float32)
        out = _zero_padding(x.new_empty(M, Hk, groups, C, D, dtype=wide).view(M, Hk * groups, C, D), slot_T)
        out = out.view(M, Hk, groups, C, D)
        at_TCHGD = out.permute(0, 3, 1, 2, 4)  # [M, C, Hk, groups, D]: a token's row is at (its chunk, its place)
        m_T, c_T = slot_T // C, slot_T % C
        r_TH1 = x.new_empty(T, Hk, 1, dtype=wide)  # 1 / the norm
        for blk in _token_blocks(x, Hk * groups * D):
            y = x[blk].to(wide)
            r = torch.rsqrt((y * y).sum(-1, keepdim=True) + 1e-6, out=r_TH1[blk])
            y = y * r
            if scale is not None:
                y = y * scale
            at_TCHGD.index_put_((m_T[blk], c_T[blk]), y[:, :, None])
        ctx.save_for_backward(x, r_TH1, m_T, c_T)
        ctx.groups, ctx.scale = groups, scale
        return out.view(M, Hk * groups, C, D)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        x, r_TH1, m_T, c_T = ctx.saved_tensors
        T, Hk, D = x.shape
        M, _, C, _ = grad.shape
        s = 1.0 if ctx.scale is None else ctx.scale
        at_TCHGD = grad.view(M, Hk, ctx.groups, C, D).permute(0, 3, 1, 2, 4)
        dx = torch.empty_like(x)
        for blk in _token_blocks(x, Hk * ctx.groups * D):
            g = at_TCHGD[m_T[blk], c_T[blk]]
            g = g.sum(2) if ctx.groups > 1 else g[:, :, 0]  # the value heads' gradients added: [t, Hk, D]
            xb, r = x[blk].to(g.dtype), r_TH1[blk]
            # y = s x r, r = (x.x + eps)^-1/2: dx = s r g - s r^3 (x.g) x, the dot summed in fp64 (a projection:
            # the radial part of g cancels)
            coef = ((xb * g).sum(-1, keepdim=True, dtype=torch.float64) * (s * r.double() ** 3)).to(g.dtype)
            if dx.dtype == g.dtype:
                torch.addcmul(g.mul_(r * s), xb, coef, value=-1, out=dx[blk])
            else:
                dx[blk] = torch.addcmul(g.mul_(r * s), xb, coef, value=-1)
        return dx, None, None, None, None, None


def _scatter(x_TH: Tensor, slot_T: Tensor, M: int, C: int) -> Tensor:
    out = _zero_padding(x_TH.new_empty(M, x_TH.shape[1], C, *x_TH.shape[2:]), slot_T)
    out.transpose(1, 2).index_put_((slot_T // C, slot_T % C), x_TH)
    return out


def _zero_padding(out_MHC: Tensor, slot_T: Tensor) -> Tensor:
    """`out` [M, H, C, ...] with zeros in the rows no token lands on (the rest is written next: a pack-wide fill
    of zeros would be one more pass over it)."""
    M, C = out_MHC.shape[0], out_MHC.shape[2]
    free = torch.ones(M * C, dtype=torch.bool, device=slot_T.device).index_fill_(0, slot_T, False)
    rows = free.nonzero().squeeze(1)
    out_MHC.transpose(1, 2).index_put_((rows // C, rows % C), out_MHC.new_zeros(()))
    return out_MHC


def _gather(x_MHC: Tensor, slot_T: Tensor) -> Tensor:
    C = x_MHC.shape[2]
    return x_MHC.transpose(1, 2)[slot_T // C, slot_T % C]


class _ToChunks(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x_TH: Tensor, slot_T: Tensor, M: int, C: int) -> Tensor:
        ctx.save_for_backward(slot_T)
        return _scatter(x_TH, slot_T, M, C)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        return from_chunks(grad, ctx.saved_tensors[0]), None, None, None


class _FromChunks(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x_MHC: Tensor, slot_T: Tensor) -> Tensor:
        ctx.save_for_backward(slot_T)
        ctx.M, ctx.C = x_MHC.shape[0], x_MHC.shape[2]
        return _gather(x_MHC, slot_T)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        slot_T = ctx.saved_tensors[0]
        return to_chunks(grad, slot_T, ctx.M, ctx.C), None


def _flat(x: Tensor) -> Tensor:  # [M, H, a, b] -> [M * H, a, b], the batch of bmm
    return x.flatten(0, 1)


def _t(x: Tensor) -> Tensor:
    return x.transpose(-1, -2)


def _decays(G_MHC: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """From the cumulative log decay G, in `dtype`: (exp(G) the decay from the chunk's start, exp(G_C - G) the decay
    to its end), each [M, H, C]."""
    return G_MHC.exp().to(dtype), (G_MHC[..., -1:] - G_MHC).exp().to(dtype)


def _pair_decays(G_mHC: Tensor, out_mHCC: Tensor) -> Tensor:
    """exp(G_i - G_j) on and below the diagonal, 0 above (masked before the exp: above it the difference is
    positive), written to `out` in its dtype. The differences are taken in G's dtype (what the fp64 sums are for)
    and the exp in out's: a difference rounded to fp32 is off by 6e-8 of itself, which moves exp(d) by 6e-8 |d|
    relative, under 2e-6 wherever exp(d) is above 1e-13."""
    C = G_mHC.shape[-1]
    upper = torch.ones(C, C, dtype=torch.bool, device=G_mHC.device).triu(1)
    return out_mHCC.copy_(G_mHC[..., :, None] - G_mHC[..., None, :]).masked_fill_(upper, float("-inf")).exp_()


def _slices(M: int, row_bytes: int) -> list[slice]:
    """The chunks in runs of about SLICE_BYTES of `row_bytes` each: the per-chunk algebra runs a run at a time, so
    that its temporaries stay small (glibc maps every allocation over 32 MB afresh, and the page faults of that cost
    more than the arithmetic) and near the cache."""
    m = max(1, SLICE_BYTES // max(row_bytes, 1))
    return [slice(i, min(i + m, M)) for i in range(0, M, m)]


SLICE_BYTES = 4 << 20


def _starts(active: list[int]) -> list[int]:
    starts, at = [], 0
    for n in active:
        starts.append(at)
        at += n
    return starts


def _bmm(a: Tensor, b: Tensor, out: Tensor) -> Tensor:
    """[m, H, x, y] @ [m, H, y, z] into the contiguous `out` [m, H, x, z]."""
    torch.bmm(_flat(a), _flat(b), out=_flat(out))
    return out


class _ChunkRule(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, S0: Tensor,
                active: list[int]) -> tuple[Tensor, Tensor]:
        M, H, C, K = q.shape
        V = v.shape[-1]
        G = g.cumsum(-1)  # in g's dtype, fp64 from fp32 inputs: the module docstring's precision note
        eG, tail = _decays(G, q.dtype)
        Dm, B, P, T = (q.new_empty(M, H, C, C) for _ in range(4))
        X = q.new_empty(M, H, C, V + K)  # [U | W]
        eye = torch.eye(C, dtype=q.dtype, device=q.device)
        slices = _slices(M, H * C * (V + K) * q.element_size())
        for sl in slices:
            _pair_decays(G[sl], Dm[sl])
            _bmm(k[sl], _t(k[sl]), B[sl]).mul_(Dm[sl]).tril_(-1)
            torch.linalg.solve_triangular(B[sl] * beta[sl, ..., None], eye.expand_as(B[sl]), upper=False,
                                          unitriangular=True, out=T[sl])
            R = q.new_empty(*B[sl].shape[:3], V + K)  # [beta v | beta exp(G) k], written in place
            torch.mul(v[sl], beta[sl, ..., None], out=R[..., :V])
            torch.mul(k[sl], (beta[sl] * eG[sl])[..., None], out=R[..., V:])
            _bmm(T[sl], R, X[sl])
            _bmm(q[sl], _t(k[sl]), P[sl]).mul_(Dm[sl]).tril_()
        fade = eG[..., -1]
        S_all = q.new_empty(M, H, K, V)  # each chunk's state at its start
        Vn = q.new_empty(M, H, C, V)
        S_fin = q.new_empty(S0.shape)
        starts = _starts(active)
        if active:
            S_all[:active[0]] = S0
        for j, (s, n) in enumerate(zip(starts, active)):
            nxt = active[j + 1] if j + 1 < len(active) else 0
            S, X_j = S_all[s:s + n], X[s:s + n]
            torch.baddbmm(_flat(X_j[..., :V]), _flat(X_j[..., V:]), _flat(S), alpha=-1, out=_flat(Vn[s:s + n]))
            Kd = k[s:s + n] * tail[s:s + n, ..., None]
            # the documents going on write their next chunk's start state, the others their final one
            for rows, into in ((slice(0, nxt), S_all[s + n:s + n + nxt]), (slice(nxt, n), S_fin[nxt:n])):
                torch.mul(S[rows], fade[s:s + n][rows][..., None, None], out=into)
                _flat(into).baddbmm_(_flat(_t(Kd[rows])), _flat(Vn[s:s + n][rows]))
        o = q.new_empty(M, H, C, V)
        for sl in slices:
            _flat(_bmm(q[sl], S_all[sl], o[sl]).mul_(eG[sl, ..., None])).baddbmm_(_flat(P[sl]), _flat(Vn[sl]))
        ctx.save_for_backward(q, k, v, beta, G, Dm, B, P, T, X, Vn, S_all)
        ctx.active = active
        return o, S_fin

    @staticmethod
    def backward(ctx: Any, dO: Tensor, dS_fin: Tensor | None) -> tuple[Tensor | None, ...]:
        q, k, v, beta, G, Dm, B, P, T, X, Vn, S_all = ctx.saved_tensors
        active = ctx.active
        M, H, C, K = q.shape
        V = v.shape[-1]
        dO = dO.contiguous()
        eG, tail = _decays(G, q.dtype)
        fade = eG[..., -1]
        row_bytes = H * C * (V + K) * q.element_size()
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        dbeta, dg = torch.empty_like(beta), torch.empty_like(G)
        # one step at a time, last first: its chunks' end-state gradients come from the next step's start states,
        # and with them its chunks' gradients are complete, so v''s gradient and the chunks' own algebra run there
        # (a step's worth of temporaries, never the pack's)
        dS = q.new_zeros(0, H, K, V)  # the start states' gradients of the step after this one
        starts = _starts(active)
        for j in reversed(range(len(active))):
            s, n = starts[j], active[j]
            nxt = active[j + 1] if j + 1 < len(active) else 0
            dS_end = dS if nxt == n else torch.cat([dS, dS_fin[nxt:n] if dS_fin is not None
                                                    else dS.new_zeros(n - nxt, H, K, V)])
            at = slice(s, s + n)
            dVn = _bmm(_t(P[at]), dO[at], torch.empty_like(Vn[at]))  # v''s gradient
            _flat(dVn).baddbmm_(_flat(k[at] * tail[at, ..., None]), _flat(dS_end))
            # the gradient of the decayed keys k exp(G_C - G) through the end state, and of its fade: sum(S dS_end)
            # per state, one dot product each
            dKd = _bmm(Vn[at], _t(dS_end), torch.empty_like(k[at]))
            dfade = torch.bmm(S_all[at].reshape(n * H, 1, K * V), dS_end.reshape(n * H, K * V, 1)).view(n, H)
            dS = _bmm(_t(q[at] * eG[at, ..., None]), dO[at], torch.empty_like(dS_end))
            dS.addcmul_(dS_end, fade[at][..., None, None])
            _flat(dS).baddbmm_(_flat(_t(X[at, ..., V:])), _flat(dVn), alpha=-1)
            for sl in _slices(n, row_bytes):
                c = slice(s + sl.start, s + sl.stop)
                dg[c], dbeta[c] = _chunk_grads(
                    q[c], k[c], v[c], beta[c], G[c], eG[c], tail[c], dfade[sl], Dm[c], B[c], P[c], T[c], X[c],
                    Vn[c], S_all[c], dO[c], dVn[sl], dKd[sl], dq[c], dk[c], dv[c])
        return dq, dk, dv, dg, dbeta, dS, None  # dS: each document's S_in gradient (the first step's start states)


def _chunk_grads(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, G: Tensor, eG: Tensor, tail: Tensor, dfade: Tensor,
                 Dm: Tensor, B: Tensor, P: Tensor, T: Tensor, X: Tensor, Vn: Tensor, S: Tensor, dO: Tensor,
                 dVn: Tensor, dKd: Tensor, dq: Tensor, dk: Tensor, dv: Tensor) -> tuple[Tensor, Tensor]:
    """(dg, dbeta) of a run of chunks, dq, dk and dv written to the (contiguous) tensors given, from v''s gradient
    and the gradient of its decayed keys (k exp(G_C - G)) through the chunk's end state, v' dS_end^T."""
    V = v.shape[-1]
    S_T = _t(S)
    dQg = dO @ S_T
    dX = dVn.new_empty(*dVn.shape[:3], V + q.shape[-1])  # [dVn | -dVn S^T]
    dX[..., :V] = dVn
    torch.matmul(dVn, S_T, out=dX[..., V:]).neg_()
    dR = _t(T) @ dX
    dA = (dR @ _t(X)).tril_(-1).neg_()
    dP = (dO @ _t(Vn)).tril_()
    dR_v, dR_k = dR[..., :V], dR[..., V:]
    kdR_k = (dR_k * k).sum(-1)
    dbeta = (dA * B).sum(-1) + (dR_v * v).sum(-1) + kdR_k * eG
    dA.mul_(beta[..., None])
    Hm = dA * B + dP * P  # each pair decay's gradient times the decay: +d/dG_i, -d/dG_j
    E = dA.mul_(Dm)
    Ep = dP.mul_(Dm)
    _bmm(Ep, k, dq).addcmul_(dQg, eG[..., None])
    _bmm(E + _t(E), k, dk)
    _flat(dk).baddbmm_(_flat(_t(Ep)), _flat(q))
    dk.addcmul_(dR_k, (beta * eG)[..., None]).addcmul_(dKd, tail[..., None])
    torch.mul(dR_v, beta[..., None], out=dv)
    dKdKd = (dKd * k).sum(-1) * tail
    # G's gradient in G's dtype (fp64 from fp32 inputs): its terms cancel (the pair decays' +/- and the chunk-end
    # ones), and the sum over the chunk below (G = cumsum g) adds them up
    wide = G.dtype
    dG = (Hm.sum(-1, dtype=wide) - Hm.sum(-2, dtype=wide)
          + (beta * eG * kdR_k + (dQg * q).sum(-1) * eG - dKdKd).to(wide))
    dG[..., -1] += dKdKd.sum(-1, dtype=wide) + (dfade * eG[..., -1]).to(wide)
    return dG.flip(-1).cumsum(-1).flip(-1), dbeta
