"""Attention with a dense mask: the reference every backend is tested against, and the path
of KV-cache steps that read cached keys.

``sdpa`` is ``F.scaled_dot_product_attention`` with GQA and a narrower value width;
``math_attention`` computes the scores explicitly, for what SDPA cannot express (sinks,
softcap). Both take ``(N, heads, S, dim)`` tensors and a boolean mask broadcastable to
``(N, 1, S, L)`` (True = attend).

Shapes: N batch (or pieces), H query heads, K kv heads, S queries, L keys, E q/k head dim,
V value dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def math_attention(
    q_NHSE: torch.Tensor,
    k_NKLE: torch.Tensor,
    v_NKLV: torch.Tensor,
    mask: torch.Tensor | None,
    *,
    scale: float,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention with explicit scores ``(N, H, S, L)``: every option, any mask (boolean,
    broadcastable to ``(N, 1, S, L)``, True = attend). Output ``(N, H, S, V)``."""
    N, H, S, E = q_NHSE.shape
    K, L = k_NKLE.shape[1], k_NKLE.shape[2]
    # GQA without repeating K/V: a kv head's G query heads stacked along the query rows.
    s_NKGL = q_NHSE.reshape(N, K, (H // K) * S, E) @ k_NKLE.transpose(-1, -2)
    s_NHSL = s_NKGL.view(N, H, S, L) * scale
    if softcap is not None:
        s_NHSL = softcap * torch.tanh(s_NHSL / softcap)
    if mask is not None:
        s_NHSL = s_NHSL.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        sink_NHS1 = sinks.to(s_NHSL.dtype).view(1, H, 1, 1).expand(N, H, S, 1)
        p_NHSL = torch.cat([s_NHSL, sink_NHS1], dim=-1).softmax(-1)[..., :L]
    else:
        p_NHSL = s_NHSL.softmax(-1)
    o_NKGV = p_NHSL.reshape(N, K, (H // K) * S, L) @ v_NKLV
    return o_NKGV.view(N, H, S, -1)


def sdpa(
    q_NHSE: torch.Tensor,
    k_NKLE: torch.Tensor,
    v_NKLV: torch.Tensor,
    *,
    mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` with GQA and a value width up to the q/k width:
    zero columns appended to a narrower v change no output value and keep SDPA on its fused
    kernels (the unfused math path otherwise)."""
    pad = q_NHSE.shape[-1] - v_NKLV.shape[-1]
    o_NHSE = F.scaled_dot_product_attention(
        q_NHSE,
        k_NKLE,
        F.pad(v_NKLV, (0, pad)) if pad > 0 else v_NKLV,
        attn_mask=mask,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=k_NKLE.shape[1] != q_NHSE.shape[1],
    )
    return o_NHSE[..., : v_NKLV.shape[-1]] if pad > 0 else o_NHSE


def dense_attention(
    q_BSHE: torch.Tensor,
    k_BLKE: torch.Tensor,
    v_BLKV: torch.Tensor,
    mask: torch.Tensor | None,
    *,
    sinks: torch.Tensor | None,
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    """``(B, S, H, V)`` attention of ``(B, S, heads, dim)`` inputs under a boolean
    ``(B, 1, S, L)`` mask; ``mask=None`` = plain causal (SDPA's ``is_causal`` kernel, no mask
    tensor)."""
    q, k, v = q_BSHE.transpose(1, 2), k_BLKE.transpose(1, 2), v_BLKV.transpose(1, 2)
    if sinks is None and softcap is None:
        o_BHSV = sdpa(q, k, v, mask=mask, is_causal=mask is None, scale=scale)
    else:
        if mask is None:
            S, L = q.shape[2], k.shape[2]
            mask = torch.ones(S, L, dtype=torch.bool, device=q.device).tril()
        o_BHSV = math_attention(q, k, v, mask, scale=scale, sinks=sinks, softcap=softcap)
    return o_BHSV.transpose(1, 2)
