"""The gated delta rule written as its definition, token by token: the reference the chunked,
recurrent and Triton forms are checked against (tests only)."""

from __future__ import annotations

import torch


def naive_delta_rule(q, k, v, g, beta, *, scale, initial_state=None, document_ids=None):
    """``(o (B, S, H, V), final state (B, H, K, V))`` in float64: for every token, decay the
    state, write ``beta (v - S^T k)`` along ``k``, read with ``scale * q``; the state restarts
    from zero wherever ``document_ids`` changes along a row. Differentiable (no in-place)."""
    q, k, v, g, beta = (t.double() for t in (q, k, v, g, beta))
    B, S, H, K = k.shape
    rows_out, rows_state = [], []
    for b in range(B):
        heads = [
            torch.zeros(K, v.shape[-1], dtype=torch.float64)
            if initial_state is None
            else initial_state[b, h].double()
            for h in range(H)
        ]
        outs = []
        for t in range(S):
            if document_ids is not None and t > 0 and document_ids[b, t] != document_ids[b, t - 1]:
                heads = [torch.zeros_like(s) for s in heads]
            step = []
            for h in range(H):
                decay = g[b, t, h].exp()
                s = heads[h] * (decay[:, None] if decay.dim() else decay)
                s = s + beta[b, t, h] * torch.outer(k[b, t, h], v[b, t, h] - s.T @ k[b, t, h])
                heads[h] = s
                step.append(s.T @ (scale * q[b, t, h]))
            outs.append(torch.stack(step))
        rows_out.append(torch.stack(outs))
        rows_state.append(torch.stack(heads))
    return torch.stack(rows_out), torch.stack(rows_state)
