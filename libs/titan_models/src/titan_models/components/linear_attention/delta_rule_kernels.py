"""Triton source of the chunked gated delta rule's kernels (``triton_kernels`` launches them;
imported only when the Triton backend runs). See ``triton_kernels`` for the algorithm.

Shapes: S padded sequence, C chunk size, K / V head dims, BK / BV their tiles.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def cumsum(g_ptr, G_ptr, H, S, K, V, C: tl.constexpr, BK: tl.constexpr, PER_CHANNEL: tl.constexpr):
    n, bh = tl.program_id(0), tl.program_id(1)
    rows = tl.arange(0, C)
    if PER_CHANNEL:
        ck = tl.arange(0, BK)
        ptrs = (bh * S + n * C + rows[:, None]) * K + ck[None, :]
        mask = ck[None, :] < K
        x = tl.load(g_ptr + ptrs, mask=mask, other=0.0)
        tl.store(G_ptr + ptrs, tl.cumsum(x, axis=0), mask=mask)
    else:
        ptrs = bh * S + n * C + rows
        tl.store(G_ptr + ptrs, tl.cumsum(tl.load(g_ptr + ptrs), axis=0))


@triton.jit
def segments(seg_ptr, b, n, S, C: tl.constexpr, HAS_SEG: tl.constexpr):
    """(carry (C,), last (C,), same (C, C), carry_last) of chunk ``n`` of row ``b``."""
    rows = tl.arange(0, C)
    if HAS_SEG:
        seg = tl.load(seg_ptr + b * S + n * C + rows)
        prev = tl.load(seg_ptr + b * S + tl.maximum(n * C - 1, 0))
        last_seg = tl.load(seg_ptr + b * S + n * C + C - 1)
        carry = (seg == prev).to(tl.float32)
        last = (seg == last_seg).to(tl.float32)
        same = seg[:, None] == seg[None, :]
        carry_last = (last_seg == prev).to(tl.float32)
    else:
        carry = tl.full([C], 1.0, tl.float32)
        last = tl.full([C], 1.0, tl.float32)
        same = rows[:, None] >= 0
        carry_last = 1.0
    return carry, last, same, carry_last


@triton.jit
def load_rows(ptr, base, D, C: tl.constexpr, BD: tl.constexpr):
    """A ``(C, BD)`` tile of rows ``base ..`` of a ``(.., D)`` tensor (zeros past D)."""
    rows, cols = tl.arange(0, C), tl.arange(0, BD)
    return tl.load(
        ptr + (base + rows[:, None]) * D + cols[None, :], mask=cols[None, :] < D, other=0.0
    )


@triton.jit
def load_decay(G_ptr, base, K, C: tl.constexpr, BK: tl.constexpr, PER_CHANNEL: tl.constexpr):
    """``G`` of a chunk as ``(C, BK)`` (per channel) or ``(C, 1)`` (per head)."""
    if PER_CHANNEL:
        return load_rows(G_ptr, base, K, C, BK)
    return tl.load(G_ptr + base + tl.arange(0, C))[:, None]


@triton.jit
def decay_row(G_ptr, base, j, K, BK: tl.constexpr, PER_CHANNEL: tl.constexpr):
    """``G`` of row ``j`` of a chunk: ``(BK,)`` or a scalar."""
    if PER_CHANNEL:
        ck = tl.arange(0, BK)
        return tl.load(G_ptr + (base + j) * K + ck, mask=ck < K, other=0.0)
    return tl.load(G_ptr + base + j)


@triton.jit
def scores(
    a, b, b_ptr, G, G_ptr, base, K, C: tl.constexpr, BK: tl.constexpr, PER_CHANNEL: tl.constexpr
):
    """``out[i, j] = sum_c a_ic b_jc exp(G_ic - G_jc)`` for j <= i (0 above)."""
    rows, cc = tl.arange(0, C), tl.arange(0, C)
    lower = rows[:, None] >= cc[None, :]
    if PER_CHANNEL:
        ck = tl.arange(0, BK)
        out = tl.zeros([C, C], dtype=tl.float32)
        for j in range(C):
            b_j = tl.load(b_ptr + (base + j) * K + ck, mask=ck < K, other=0.0)
            g_j = decay_row(G_ptr, base, j, K, BK, True)
            e = tl.exp(tl.minimum(G - g_j[None, :], 0.0))
            col = tl.sum(a * b_j[None, :] * e, axis=1)
            out = tl.where(cc[None, :] == j, col[:, None], out)
        return tl.where(lower, out, 0.0)
    g_row = tl.sum(G, axis=1)  # (C,): G was (C, 1)
    diff = tl.where(lower, g_row[:, None] - g_row[None, :], 0.0)
    prod = tl.dot(a, tl.trans(b), input_precision="ieee")
    return tl.where(lower, prod * tl.exp(diff), 0.0)


@triton.jit
def score_grads(
    dA, a, b, b_ptr, G, G_ptr, base, K, C: tl.constexpr, BK: tl.constexpr, PER_CHANNEL: tl.constexpr
):
    """Gradients of ``scores`` with respect to ``a`` and ``b`` for ``dA`` (masked)."""
    rows, cc = tl.arange(0, C), tl.arange(0, C)
    lower = rows[:, None] >= cc[None, :]
    dA = tl.where(lower, dA, 0.0)
    if PER_CHANNEL:
        ck = tl.arange(0, BK)
        da = tl.zeros([C, BK], dtype=tl.float32)
        db = tl.zeros([C, BK], dtype=tl.float32)
        for j in range(C):
            b_j = tl.load(b_ptr + (base + j) * K + ck, mask=ck < K, other=0.0)
            g_j = decay_row(G_ptr, base, j, K, BK, True)
            e = tl.exp(tl.minimum(G - g_j[None, :], 0.0))
            d_col = tl.sum(tl.where(cc[None, :] == j, dA, 0.0), axis=1)
            da += d_col[:, None] * b_j[None, :] * e
            db_j = tl.sum(d_col[:, None] * a * e, axis=0)
            db = tl.where(rows[:, None] == j, db_j[None, :], db)
        return da, db
    g_row = tl.sum(G, axis=1)
    decay = tl.exp(tl.where(lower, g_row[:, None] - g_row[None, :], 0.0))
    dAe = tl.where(lower, dA * decay, 0.0)
    da = tl.dot(dAe, b, input_precision="ieee")
    db = tl.dot(tl.trans(dAe), a, input_precision="ieee")
    return da, db


@triton.jit
def intra_fwd(
    q_ptr, k_ptr, v_ptr, G_ptr, beta_ptr, seg_ptr, T_ptr, Aqk_ptr, w_ptr, u_ptr,
    H, S, K, V,
    C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    PER_CHANNEL: tl.constexpr, HAS_SEG: tl.constexpr,
):  # fmt: skip
    n, bh = tl.program_id(0), tl.program_id(1)
    base = bh * S + n * C  # first row of the chunk
    rows, cc = tl.arange(0, C), tl.arange(0, C)
    _, _, same, _ = segments(seg_ptr, bh // H, n, S, C, HAS_SEG)
    q = load_rows(q_ptr, base, K, C, BK)
    k = load_rows(k_ptr, base, K, C, BK)
    v = load_rows(v_ptr, base, V, C, BV)
    G = load_decay(G_ptr, base, K, C, BK, PER_CHANNEL)
    beta = tl.load(beta_ptr + base + rows)
    kb = k * beta[:, None]
    strict = (rows[:, None] > cc[None, :]) & same
    A_kk = tl.where(strict, scores(kb, k, k_ptr, G, G_ptr, base, K, C, BK, PER_CHANNEL), 0.0)
    A_qk = tl.where(same, scores(q, k, k_ptr, G, G_ptr, base, K, C, BK, PER_CHANNEL), 0.0)
    # T = (I + A_kk)^-1 row by row: T_i = e_i - sum_{j<i} A_ij T_j.
    T = tl.where(rows[:, None] == cc[None, :], 1.0, 0.0)
    for i in range(1, C):
        a_i = tl.sum(tl.where(rows[:, None] == i, A_kk, 0.0), axis=0)
        t_i = tl.where(cc == i, 1.0, -tl.sum(a_i[:, None] * T, axis=0))
        T = tl.where(rows[:, None] == i, t_i[None, :], T)
    w = tl.dot(T, kb * tl.exp(G), input_precision="ieee")
    u = tl.dot(T, v * beta[:, None], input_precision="ieee")
    ck, cv = tl.arange(0, BK), tl.arange(0, BV)
    tl.store(T_ptr + (base + rows[:, None]) * C + cc[None, :], T)
    tl.store(Aqk_ptr + (base + rows[:, None]) * C + cc[None, :], A_qk)
    tl.store(w_ptr + (base + rows[:, None]) * K + ck[None, :], w, mask=ck[None, :] < K)
    tl.store(u_ptr + (base + rows[:, None]) * V + cv[None, :], u, mask=cv[None, :] < V)


@triton.jit
def state_fwd(
    k_ptr, G_ptr, seg_ptr, w_ptr, u_ptr, state_ptr, h_ptr, vnew_ptr, final_ptr,
    H, S, K, V, N,
    C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    PER_CHANNEL: tl.constexpr, HAS_SEG: tl.constexpr,
):  # fmt: skip
    bh = tl.program_id(0)
    rows, ck, cv = tl.arange(0, C), tl.arange(0, BK), tl.arange(0, BV)
    kv = (ck[:, None] < K) & (cv[None, :] < V)
    kv_ptrs = ck[:, None] * V + cv[None, :]
    h = tl.load(state_ptr + bh * K * V + kv_ptrs, mask=kv, other=0.0)
    for n in range(N):
        base = bh * S + n * C
        carry, last, _, carry_last = segments(seg_ptr, bh // H, n, S, C, HAS_SEG)
        tl.store(h_ptr + (bh * N + n) * K * V + kv_ptrs, h, mask=kv)
        w = load_rows(w_ptr, base, K, C, BK)
        u = load_rows(u_ptr, base, V, C, BV)
        k = load_rows(k_ptr, base, K, C, BK)
        G = load_decay(G_ptr, base, K, C, BK, PER_CHANNEL)
        gamma = decay_row(G_ptr, base, C - 1, K, BK, PER_CHANNEL)
        v_new = u - carry[:, None] * tl.dot(w, h, input_precision="ieee")
        tl.store(vnew_ptr + (base + rows[:, None]) * V + cv[None, :], v_new, mask=cv[None, :] < V)
        k_tail = k * tl.exp(gamma - G) * last[:, None]
        if PER_CHANNEL:
            h = h * (tl.exp(gamma) * carry_last)[:, None]
        else:
            h = h * (tl.exp(gamma) * carry_last)
        h += tl.dot(tl.trans(k_tail), v_new, input_precision="ieee")
    tl.store(final_ptr + bh * K * V + kv_ptrs, h, mask=kv)


@triton.jit
def output_fwd(
    q_ptr, G_ptr, seg_ptr, Aqk_ptr, h_ptr, vnew_ptr, o_ptr,
    H, S, K, V, N,
    C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    PER_CHANNEL: tl.constexpr, HAS_SEG: tl.constexpr,
):  # fmt: skip
    n, bh = tl.program_id(0), tl.program_id(1)
    base = bh * S + n * C
    rows, ck, cv = tl.arange(0, C), tl.arange(0, BK), tl.arange(0, BV)
    carry, _, _, _ = segments(seg_ptr, bh // H, n, S, C, HAS_SEG)
    q = load_rows(q_ptr, base, K, C, BK)
    G = load_decay(G_ptr, base, K, C, BK, PER_CHANNEL)
    kv = (ck[:, None] < K) & (cv[None, :] < V)
    h = tl.load(h_ptr + (bh * N + n) * K * V + ck[:, None] * V + cv[None, :], mask=kv, other=0.0)
    A_qk = tl.load(Aqk_ptr + (base + rows[:, None]) * C + tl.arange(0, C)[None, :])
    v_new = load_rows(vnew_ptr, base, V, C, BV)
    o = carry[:, None] * tl.dot(q * tl.exp(G), h, input_precision="ieee")
    o += tl.dot(A_qk, v_new, input_precision="ieee")
    tl.store(o_ptr + (base + rows[:, None]) * V + cv[None, :], o, mask=cv[None, :] < V)


@triton.jit
def state_bwd(
    q_ptr, k_ptr, G_ptr, seg_ptr, Aqk_ptr, w_ptr, do_ptr, dfinal_ptr, dh_ptr, dvnew_ptr,
    dstate_ptr,
    H, S, K, V, N,
    C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    PER_CHANNEL: tl.constexpr, HAS_SEG: tl.constexpr,
):  # fmt: skip
    bh = tl.program_id(0)
    rows, ck, cv = tl.arange(0, C), tl.arange(0, BK), tl.arange(0, BV)
    kv = (ck[:, None] < K) & (cv[None, :] < V)
    kv_ptrs = ck[:, None] * V + cv[None, :]
    dh = tl.load(dfinal_ptr + bh * K * V + kv_ptrs, mask=kv, other=0.0)
    for i in range(N):
        n = N - 1 - i
        base = bh * S + n * C
        carry, last, _, carry_last = segments(seg_ptr, bh // H, n, S, C, HAS_SEG)
        tl.store(dh_ptr + (bh * N + n) * K * V + kv_ptrs, dh, mask=kv)
        q = load_rows(q_ptr, base, K, C, BK)
        k = load_rows(k_ptr, base, K, C, BK)
        w = load_rows(w_ptr, base, K, C, BK)
        do = load_rows(do_ptr, base, V, C, BV)
        G = load_decay(G_ptr, base, K, C, BK, PER_CHANNEL)
        gamma = decay_row(G_ptr, base, C - 1, K, BK, PER_CHANNEL)
        A_qk = tl.load(Aqk_ptr + (base + rows[:, None]) * C + tl.arange(0, C)[None, :])
        k_tail = k * tl.exp(gamma - G) * last[:, None]
        dv_new = tl.dot(k_tail, dh, input_precision="ieee")
        dv_new += tl.dot(tl.trans(A_qk), do, input_precision="ieee")
        tl.store(dvnew_ptr + (base + rows[:, None]) * V + cv[None, :], dv_new, mask=cv[None, :] < V)
        if PER_CHANNEL:
            dh = dh * (tl.exp(gamma) * carry_last)[:, None]
        else:
            dh = dh * (tl.exp(gamma) * carry_last)
        q_e = q * tl.exp(G) * carry[:, None]
        dh += tl.dot(tl.trans(q_e), do, input_precision="ieee")
        dh -= tl.dot(tl.trans(w * carry[:, None]), dv_new, input_precision="ieee")
    tl.store(dstate_ptr + bh * K * V + kv_ptrs, dh, mask=kv)


@triton.jit
def intra_bwd(
    q_ptr, k_ptr, v_ptr, G_ptr, beta_ptr, seg_ptr, T_ptr, h_ptr, vnew_ptr,
    dh_ptr, dvnew_ptr, do_ptr, dq_ptr, dk_ptr, dv_ptr, dG_ptr, dbeta_ptr,
    H, S, K, V, N,
    C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    PER_CHANNEL: tl.constexpr, HAS_SEG: tl.constexpr,
):  # fmt: skip
    n, bh = tl.program_id(0), tl.program_id(1)
    base = bh * S + n * C
    rows, cc, ck, cv = tl.arange(0, C), tl.arange(0, C), tl.arange(0, BK), tl.arange(0, BV)
    carry, last, same, carry_last = segments(seg_ptr, bh // H, n, S, C, HAS_SEG)
    q = load_rows(q_ptr, base, K, C, BK)
    k = load_rows(k_ptr, base, K, C, BK)
    v = load_rows(v_ptr, base, V, C, BV)
    G = load_decay(G_ptr, base, K, C, BK, PER_CHANNEL)
    gamma = decay_row(G_ptr, base, C - 1, K, BK, PER_CHANNEL)
    beta = tl.load(beta_ptr + base + rows)
    v_new = load_rows(vnew_ptr, base, V, C, BV)
    dv_new = load_rows(dvnew_ptr, base, V, C, BV)
    do = load_rows(do_ptr, base, V, C, BV)
    kv = (ck[:, None] < K) & (cv[None, :] < V)
    hn = (bh * N + n) * K * V + ck[:, None] * V + cv[None, :]
    h = tl.load(h_ptr + hn, mask=kv, other=0.0)
    dh = tl.load(dh_ptr + hn, mask=kv, other=0.0)
    T = tl.load(T_ptr + (base + rows[:, None]) * C + cc[None, :])
    eG = tl.exp(G)

    # Through the state: o's read of h, v_new's, and the state written for the next chunk.
    dq_e = carry[:, None] * tl.dot(do, tl.trans(h), input_precision="ieee")
    dw = -carry[:, None] * tl.dot(dv_new, tl.trans(h), input_precision="ieee")
    decay_tail = tl.exp(gamma - G) * last[:, None]
    dk_tail = tl.dot(v_new, tl.trans(dh), input_precision="ieee")
    k_tail = k * decay_tail
    dgamma = carry_last * tl.exp(gamma) * tl.sum(h * dh, axis=1)  # (BK,)
    dgamma += tl.sum(k_tail * dk_tail, axis=0)
    dq = dq_e * eG
    dG = dq_e * q * eG
    dk = dk_tail * decay_tail
    dG -= k_tail * dk_tail

    # Through the UT transform: u = T (beta v), w = T (beta k e^G), T = (I + A_kk)^-1.
    X = v * beta[:, None]
    Y = k * beta[:, None] * eG
    dX = tl.dot(tl.trans(T), dv_new, input_precision="ieee")
    dY = tl.dot(tl.trans(T), dw, input_precision="ieee")
    dT = tl.dot(dv_new, tl.trans(X), input_precision="ieee")
    dT += tl.dot(dw, tl.trans(Y), input_precision="ieee")
    strict = (rows[:, None] > cc[None, :]) & same
    dA_kk = -tl.dot(
        tl.trans(T), tl.dot(dT, tl.trans(T), input_precision="ieee"), input_precision="ieee"
    )
    dA_kk = tl.where(strict, dA_kk, 0.0)
    dv = dX * beta[:, None]
    dbeta = tl.sum(v * dX, axis=1) + tl.sum(k * eG * dY, axis=1)
    dk += dY * beta[:, None] * eG
    dG += Y * dY

    # The intra-chunk scores A_qk (q, k) and A_kk (beta k, k).
    dA_qk = tl.where(same, tl.dot(do, tl.trans(v_new), input_precision="ieee"), 0.0)
    da, db = score_grads(dA_qk, q, k, k_ptr, G, G_ptr, base, K, C, BK, PER_CHANNEL)
    dq += da
    dk += db
    dG += q * da - k * db
    kb = k * beta[:, None]
    da, db = score_grads(dA_kk, kb, k, k_ptr, G, G_ptr, base, K, C, BK, PER_CHANNEL)
    dk += da * beta[:, None] + db
    dbeta += tl.sum(k * da, axis=1)
    dG += kb * da - k * db

    kmask = ck[None, :] < K
    tl.store(dq_ptr + (base + rows[:, None]) * K + ck[None, :], dq, mask=kmask)
    tl.store(dk_ptr + (base + rows[:, None]) * K + ck[None, :], dk, mask=kmask)
    tl.store(dv_ptr + (base + rows[:, None]) * V + cv[None, :], dv, mask=cv[None, :] < V)
    tl.store(dbeta_ptr + base + rows, dbeta)
    # G = cumsum(g): dg_i = sum_{t >= i} dG_t, the chunk's last row also carrying dgamma.
    if PER_CHANNEL:
        dG = tl.where(rows[:, None] == C - 1, dG + dgamma[None, :], dG)
        dg = tl.cumsum(dG, axis=0, reverse=True)
        tl.store(dG_ptr + (base + rows[:, None]) * K + ck[None, :], dg, mask=kmask)
    else:
        dG_row = tl.sum(dG, axis=1) + tl.where(rows == C - 1, tl.sum(dgamma, axis=0), 0.0)
        tl.store(dG_ptr + base + rows, tl.cumsum(dG_row, axis=0, reverse=True))
