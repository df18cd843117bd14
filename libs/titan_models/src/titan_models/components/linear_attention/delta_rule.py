"""The gated delta rule (Yang et al. 2024, "Gated Delta Networks"), chunked and recurrent.

Per head, with a state ``S`` of shape (K, V), a log decay ``g_t`` (one per head: Gated DeltaNet;
one per key channel: Kimi Delta Attention) and a write strength ``beta_t`` in (0, 1)::

    S_t = diag(exp(g_t)) S_{t-1}                    decay
    S_t = S_t + beta_t k_t (v_t - S_t^T k_t)^T      delta rule: correct what S predicts for k_t
    o_t = S_t^T (scale * q_t)

``chunk_delta_rule`` is the training form: chunks of ``C`` tokens, each solved with the UT
transform (Yang et al. 2024, "Parallelizing Linear Transformers with the Delta Rule"): with
``G`` the cumulative log decay inside a chunk,

    A_kk[i, j] = beta_i sum_c k_ic k_jc exp(G_ic - G_jc)   (j < i)
    T = (I + A_kk)^-1,   u = T (beta v),   w = T (beta k exp(G))
    v_new = u - w S,     o = (q exp(G)) S + (A_qk masked to j <= i) v_new
    S' = diag(exp(G_last)) S + (k exp(G_last - G))^T v_new

so the work is O(S·C·(K + V) + S·K·V) and only one (K, V) state per chunk is carried in
sequence. ``recurrent_delta_rule`` is the decode form: the recursion above token by token from
a given state (the one a KV cache holds).

Packed documents (``document_ids``) reset the state at every change of id: inside a chunk the
intra-chunk matrices are masked to pairs of one document, a token reads the incoming state only
while the chunk is still in the document that state belongs to, and only the chunk's last
document writes the outgoing state. No document reaches another, in any form.

The decays must be ``g <= 0`` (decays in (0, 1], as every model here computes them). Per-channel
decays are multiplied out stably: inside a chunk, ``exp(G_i - G_j)`` is factored around a
reference row of each 16-token block so that neither factor exceeds one, and the 16 x 16
diagonal blocks are computed exactly, one column at a time (``_ChannelDecayedScores``).

Shapes: B batch, S sequence, H heads, K key dim, V value dim, N chunks, C chunk size,
M = C / 16 blocks of a chunk, c block size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = [
    "DELTA_RULE_BACKENDS",
    "chunk_delta_rule",
    "document_segments",
    "recurrent_delta_rule",
]

DELTA_RULE_BACKENDS = ("auto", "torch", "triton")
"""``chunk_delta_rule`` backends: ``auto`` = Triton on CUDA tensors, torch elsewhere."""
_BLOCK = 16
_COLUMNS = 4  # diagonal-block columns per op: 4x the fewer ops for 4x a key tile's transient


def document_segments(document_ids_BS: torch.Tensor) -> torch.Tensor:
    """Index of each token's document inside its row, counting changes of id from 0: equal
    ids that are not adjacent are different documents (as ``positions_from_document_ids``)."""
    change_BS = torch.zeros_like(document_ids_BS, dtype=torch.long)
    change_BS[:, 1:] = (document_ids_BS[:, 1:] != document_ids_BS[:, :-1]).long()
    return change_BS.cumsum(dim=1)


def _check(q, k, v, g, beta, chunk_size: int | None, initial_state) -> None:
    if q.dim() != 4 or q.shape != k.shape:
        raise ValueError(
            f"q and k must have one shape (B, S, H, K), got {tuple(q.shape)} and {tuple(k.shape)}"
        )
    B, S, H, K = k.shape
    if v.dim() != 4 or v.shape[:3] != (B, S, H):
        raise ValueError(f"v must have shape ({B}, {S}, {H}, V), got {tuple(v.shape)}")
    if beta.shape != (B, S, H):
        raise ValueError(f"beta must have shape {(B, S, H)}, got {tuple(beta.shape)}")
    if g.shape not in ((B, S, H), (B, S, H, K)):
        raise ValueError(
            f"g must have shape {(B, S, H)} (one decay per head) or {(B, S, H, K)} (per key "
            f"channel), got {tuple(g.shape)}"
        )
    if chunk_size is not None and (chunk_size < 1 or chunk_size & (chunk_size - 1)):
        raise ValueError(f"chunk_size must be a power of two >= 1, got {chunk_size}")
    state = (B, H, K, v.shape[-1])
    if initial_state is not None and tuple(initial_state.shape) != state:
        raise ValueError(f"initial_state must have shape {state}, got {tuple(initial_state.shape)}")


def _acc_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)


def chunk_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float,
    chunk_size: int = 64,
    initial_state: torch.Tensor | None = None,
    document_ids: torch.Tensor | None = None,
    output_final_state: bool = False,
    backend: str = "torch",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Outputs ``(B, S, H, V)`` (in ``v``'s dtype) of the gated delta rule, chunk by chunk.

    Args:
        q, k: ``(B, S, H, K)`` queries and keys (normalised by the caller if the model wants).
        v: ``(B, S, H, V)`` values.
        g: log decays ``<= 0``, ``(B, S, H)`` per head or ``(B, S, H, K)`` per key channel.
        beta: ``(B, S, H)`` write strengths.
        scale: multiplies ``q`` (``K ** -0.5`` in the models).
        chunk_size: tokens per chunk ``C`` (a power of two).
        initial_state: ``(B, H, K, V)`` state before the first token (zeros by default); with
            ``document_ids`` it belongs to each row's first document.
        document_ids: ``(B, S)`` packed documents; the state restarts from zero at each change.
        output_final_state: also return the state after the last token, ``(B, H, K, V)`` fp32.
        backend: ``torch`` (any device), ``triton`` (``triton_kernels``: CUDA, or CPU under
            ``TRITON_INTERPRET=1``) or ``auto`` (Triton on CUDA tensors, torch elsewhere).

    The arithmetic is fp32 (fp64 inputs stay fp64).
    """
    _check(q, k, v, g, beta, chunk_size, initial_state)
    # A chunk need not be longer than the sequence (a short prefill): same result, less padding.
    chunk_size = min(chunk_size, max(16, 1 << (q.shape[1] - 1).bit_length()))
    if document_ids is not None and document_ids.shape != beta.shape[:2]:
        raise ValueError(
            f"document_ids must have shape {tuple(beta.shape[:2])}, got {tuple(document_ids.shape)}"
        )
    from .triton_kernels import resolve_backend

    if resolve_backend(backend, q.device) == "triton":
        from .triton_kernels import triton_chunk_delta_rule

        return triton_chunk_delta_rule(
            q,
            k,
            v,
            g,
            beta,
            scale=scale,
            chunk_size=chunk_size,
            initial_state=initial_state,
            document_ids=document_ids,
            output_final_state=output_final_state,
        )
    return _torch_chunk_delta_rule(
        q, k, v, g, beta, scale, chunk_size, initial_state, document_ids, output_final_state
    )


def _chunk_masks(
    document_ids: torch.Tensor | None, S: int, N: int, C: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Intra-chunk masks (strict and inclusive lower triangles, within one document) ``(B?, 1,
    N, C, C)``; the tokens that read the incoming state ``(B, 1, N, C)`` and those of the
    chunk's last document ``(B, 1, N, C)`` (``None`` without documents)."""
    strict = torch.ones(C, C, dtype=torch.bool, device=device).tril(-1)
    inclusive = torch.ones(C, C, dtype=torch.bool, device=device).tril()
    if document_ids is None:
        return strict, inclusive, None, None
    seg_BS = document_segments(document_ids)
    pad = N * C - S
    if pad:  # padding joins the last document; its zero beta and g leave the state unchanged
        seg_BS = torch.cat([seg_BS, seg_BS[:, -1:].expand(-1, pad)], dim=1)
    seg = seg_BS.view(-1, 1, N, C)
    same = seg[..., :, None] == seg[..., None, :]
    before = torch.cat([seg[:, :, :1, :1], seg[:, :, :-1, -1:]], dim=2)  # doc of the state in
    carry = seg == before
    last = seg == seg[..., -1:]
    return strict & same, inclusive & same, carry, last


def _torch_chunk_delta_rule(
    q, k, v, g, beta, scale, C, initial_state, document_ids, output_final_state
):
    B, S, H, K = k.shape
    V = v.shape[-1]
    acc = _acc_dtype(v)
    per_channel = g.dim() == 4
    N = -(-S // C)
    pad = N * C - S

    def chunks(t: torch.Tensor, scale_by: float = 1.0) -> torch.Tensor:
        t = t.to(acc).transpose(1, 2)  # (B, H, S, ...)
        if scale_by != 1.0:
            t = t * scale_by
        if pad:
            t = F.pad(t, (0, 0, 0, pad) if t.dim() == 4 else (0, pad))
        return t.reshape(B, H, N, C, *t.shape[3:])

    q_c, k_c, v_c, b_c, g_c = chunks(q, scale), chunks(k), chunks(v), chunks(beta), chunks(g)
    strict, inclusive, carry, last = _chunk_masks(document_ids, S, N, C, q.device)

    G = g_c.cumsum(dim=3)  # (B, H, N, C[, K])
    Gk = G if per_channel else G[..., None]  # broadcastable over K
    kb_c = k_c * b_c[..., None]
    A_kk = decayed_scores(kb_c, k_c, G, strict)
    A_qk = decayed_scores(q_c, k_c, G, inclusive)
    # UT transform: T = (I + A_kk)^-1 applied by unit-triangular solves (two narrow solves
    # measured 2-3x faster on CPU than one over the concatenated right-hand sides).
    u = torch.linalg.solve_triangular(A_kk, v_c * b_c[..., None], upper=False, unitriangular=True)
    eG = Gk.exp()  # <= 1: decays since the chunk start
    w = torch.linalg.solve_triangular(A_kk, kb_c * eG, upper=False, unitriangular=True)
    q_e = q_c * eG
    gamma = Gk[:, :, :, -1]  # (B, H, N, K | 1): the chunk's total log decay
    k_tail = k_c * (gamma[:, :, :, None] - Gk).exp()
    decay = gamma.exp()
    if carry is not None:
        assert last is not None  # made with carry
        k_tail = k_tail * last[..., None]
        decay = decay * carry[..., -1:]
        carry = carry[..., None].to(acc)

    state = (
        torch.zeros(B, H, K, V, dtype=acc, device=v.device)
        if initial_state is None
        else initial_state.to(acc)
    )
    # Per-chunk views by one unbind each: indexing chunk n of a whole-sequence tensor inside
    # the loop would make every index's backward write a zero-filled gradient of the whole
    # sequence (O(S^2 / C) bytes in backward instead of O(S)).
    w_n, q_n, u_n, a_n, decay_n, k_n = (t.unbind(2) for t in (w, q_e, u, A_qk, decay, k_tail))
    carry_n = carry.unbind(2) if carry is not None else None
    outs = []
    for n in range(N):
        ws, qs = w_n[n] @ state, q_n[n] @ state
        if carry_n is not None:
            ws, qs = ws * carry_n[n], qs * carry_n[n]
        v_new = u_n[n] - ws
        outs.append(qs + a_n[n] @ v_new)
        state = state * decay_n[n][..., None] + k_n[n].transpose(-1, -2) @ v_new
    o = torch.stack(outs, dim=2).reshape(B, H, N * C, V)[:, :, :S]
    return o.transpose(1, 2).to(v.dtype), (state if output_final_state else None)


def decayed_scores(
    a: torch.Tensor, b: torch.Tensor, G: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """``out[i, j] = sum_c a_ic b_jc exp(G_ic - G_jc)`` where ``mask`` holds, else 0.

    ``a``, ``b``: ``(..., C, K)``; ``G``: ``(..., C)`` (one decay per head) or ``(..., C, K)``
    (per channel; computed stably by ``_ChannelDecayedScores``); ``mask`` broadcastable to
    ``(..., C, C)`` and lower triangular (``G`` decreases along a chunk)."""
    if G.dim() == a.dim():
        return _ChannelDecayedScores.apply(a, b, G, mask)
    diff = (G[..., :, None] - G[..., None, :]).masked_fill(~mask, float("-inf"))
    return (a @ b.transpose(-1, -2)) * diff.exp()


def _blocks(C: int) -> tuple[int, int]:
    c = min(_BLOCK, C)
    return C // c, c


def _block_lower(C: int, device: torch.device) -> torch.Tensor:
    """``(C, C)`` True below the diagonal 16 x 16 blocks (the factorised part)."""
    c = _blocks(C)[1]
    block = torch.arange(C, device=device) // c
    return block[:, None] > block[None, :]


class _ChannelDecayedScores(torch.autograd.Function):
    """``decayed_scores`` with per-channel decays, saving only its inputs.

    Off-diagonal blocks: with ``r`` the decay at the first row of block row I, ``exp(G_i - G_j) =
    exp(G_i - r) exp(r - G_j)``; both exponents are <= 0 for i in I and j before I, so the
    block row is one matmul of bounded factors. Diagonal blocks: exact, one column j at a time,
    ``sum_c a_ic b_jc exp(G_ic - G_jc)`` over the block's rows. The gradient with respect to
    ``G`` is ``a * da - b * db`` (the derivative of the exponent's two ends), so the backward
    needs only ``da`` and ``db``, computed with the same two schemes.
    """

    @staticmethod
    def forward(ctx, a, b, G, mask):
        ctx.save_for_backward(a, b, G, mask)
        C = a.shape[-2]
        M, c = _blocks(C)
        out = torch.zeros(*a.shape[:-1], C, dtype=a.dtype, device=a.device)
        if M > 1:
            a_f, b_f, _ = _factors(a, b, G, M, c)
            off = (a_f @ b_f.transpose(-1, -2)).reshape(*a.shape[:-1], C)
            out = torch.where(_block_lower(C, a.device), off, out)
        diag = _diagonal_view(out, M, c)
        aB, bB, GB = (t.unflatten(-2, (M, c)) for t in (a, b, G))
        for cols in _column_groups(c):
            e = _diagonal_decay(GB, cols)  # (..., M, c rows, J cols, K)
            diag[..., cols] = (aB[..., :, None, :] * bB[..., None, cols, :] * e).sum(-1)
        return out.masked_fill(~mask, 0)

    @staticmethod
    def backward(ctx, grad):  # pyrefly: ignore[bad-override]  # torch: one arg per output
        a, b, G, mask = ctx.saved_tensors
        C = a.shape[-2]
        M, c = _blocks(C)
        d = grad.masked_fill(~mask, 0)
        da, db = torch.zeros_like(a), torch.zeros_like(b)
        if M > 1:
            d_off = d.masked_fill(~_block_lower(C, a.device), 0).unflatten(-2, (M, c))
            a_f, b_f, (ea, eb) = _factors(a, b, G, M, c)
            da = da + ((d_off @ b_f) * ea).flatten(-3, -2)
            db = db + ((d_off.transpose(-1, -2) @ a_f) * eb).sum(-3)
        d_diag = _diagonal_view(d, M, c)  # (..., M, c rows, c cols)
        aB, bB, GB = (t.unflatten(-2, (M, c)) for t in (a, b, G))
        daB, dbB = torch.zeros_like(aB), torch.zeros_like(bB)
        for cols in _column_groups(c):
            e = _diagonal_decay(GB, cols)
            dcol = d_diag[..., cols, None]  # (..., M, c rows, J cols, 1)
            daB += (dcol * bB[..., None, cols, :] * e).sum(-2)
            dbB[..., cols, :] = (dcol * aB[..., :, None, :] * e).sum(-3)
        da = da + daB.flatten(-3, -2)
        db = db + dbB.flatten(-3, -2)
        return da, db, a * da - b * db, None


def _column_groups(c: int) -> list[slice]:
    return [slice(j, min(j + _COLUMNS, c)) for j in range(0, c, _COLUMNS)]


def _diagonal_decay(GB: torch.Tensor, cols: slice) -> torch.Tensor:
    """``exp(G_i - G_j)`` for the rows i of each diagonal block and its columns ``cols``,
    ``(..., M, c, J, K)``; clamped at 1 above the diagonal (masked out by the caller)."""
    return (GB[..., :, None, :] - GB[..., None, cols, :]).clamp(max=0).exp()


def _factors(a, b, G, M: int, c: int):
    """Bounded factors of the off-diagonal blocks: ``a_f (..., M, c, K)`` (rows of block I
    times ``exp(G - r_I)``), ``b_f (..., M, C, K)`` (every row times ``exp(r_I - G)``, clamped
    at 0 where unused) and the two exponentials."""
    aB, GB = a.unflatten(-2, (M, c)), G.unflatten(-2, (M, c))
    ref = GB[..., :1, :]  # (..., M, 1, K)
    ea = (GB - ref).exp()
    eb = (ref - G[..., None, :, :]).clamp(max=0).exp()  # (..., M, C, K)
    return aB * ea, b[..., None, :, :] * eb, (ea, eb)


def _diagonal_view(x: torch.Tensor, M: int, c: int) -> torch.Tensor:
    """The diagonal ``c x c`` blocks of ``x (..., C, C)`` as a writable view ``(..., M, c, c)``."""
    blocks = x.unflatten(-1, (M, c)).unflatten(-3, (M, c))  # (..., M, c, M, c)
    return blocks.diagonal(dim1=-4, dim2=-2).movedim(-1, -3)


def recurrent_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float,
    state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The recursion token by token from ``state`` ``(B, H, K, V)`` (zeros by default): outputs
    ``(B, S, H, V)`` in ``v``'s dtype and the state after the last token (fp32). The decode
    form: a step costs O(H·K·V) whatever the length of the context."""
    _check(q, k, v, g, beta, None, state)
    B, S, H, K = k.shape
    acc = _acc_dtype(v)
    S_t = (
        torch.zeros(B, H, K, v.shape[-1], dtype=acc, device=v.device)
        if state is None
        else state.to(acc)
    )
    per_channel = g.dim() == 4
    outs = []
    for t in range(S):
        q_t, k_t, v_t = (x[:, t].to(acc) for x in (q, k, v))
        decay = g[:, t].to(acc).exp()
        S_t = S_t * (decay[..., None] if per_channel else decay[..., None, None])
        delta = (v_t - torch.einsum("bhk,bhkv->bhv", k_t, S_t)) * beta[:, t, :, None].to(acc)
        S_t = S_t + k_t[..., None] * delta[..., None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", q_t * scale, S_t))
    return torch.stack(outs, dim=1).to(v.dtype), S_t
