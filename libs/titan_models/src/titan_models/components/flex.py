"""The ``flex`` attention backend: FlexAttention over a ``BlockMask`` built once per batch and
window from the ``AttentionMetadata`` (causal, inside the document, inside the window);
softcap as a ``score_mod``; sinks by rescaling the output with the returned log-sum-exp.

``flex_attention`` and ``create_block_mask`` are compiled once per process (un-compiled,
FlexAttention materialises the scores). torch has no FlexAttention backward on CPU (and its
CPU compile is inference-only): a backward there is refused with the backends to use instead.

Shapes: B batch, S queries, L keys, H query heads, K kv heads, E head dim, V value dim.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .attention_metadata import AttentionMetadata

_NO_FLEX_BACKWARD = ("cpu",)
"""Device types whose torch build has no FlexAttention backward (torch 2.13-2.15)."""


def has_backward(device: torch.device) -> bool:
    """Whether FlexAttention runs forward and backward on ``device`` in this torch build."""
    return device.type not in _NO_FLEX_BACKWARD


_EAGER_FLEX = False
"""Run ``flex_attention`` un-compiled (tests on CPU: same semantics, scores materialised;
compiling it there takes minutes and supports inference only)."""

_compiled: dict[Callable[..., Any], Callable[..., Any]] = {}


def flex_compile(fn: Callable[..., Any], **options: Any) -> Callable[..., Any]:
    """``fn`` under ``torch.compile(fn, **options)``, compiled once per process; ``fn`` itself
    when ``_EAGER_FLEX``. FlexAttention's functions go through here (this backend's and the
    context-parallel tiles')."""
    if _EAGER_FLEX:
        return fn
    if fn not in _compiled:
        _compiled[fn] = torch.compile(fn, **options)
    return _compiled[fn]


def _flex_functions() -> tuple[Callable[..., Any], Callable[..., Any]]:
    """``(flex_attention, create_block_mask)``, compiled once per process unless
    ``_EAGER_FLEX``."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    return flex_compile(flex_attention, dynamic=False), flex_compile(create_block_mask)


def prepare(meta: AttentionMetadata, window: int | None) -> Any:
    """The batch's ``BlockMask`` for one window: causal (unless bidirectional), inside the
    document, inside the window (per row with documents; one for all rows without)."""
    starts = meta.starts
    bidirectional = meta.bidirectional

    def mask_mod(b, h, q_idx, kv_idx):
        if bidirectional:
            visible = kv_idx >= 0
            if starts is not None:
                visible = visible & (starts[b, kv_idx] == starts[b, q_idx])
            return visible
        visible = kv_idx <= q_idx
        if starts is not None:
            visible = visible & (kv_idx >= starts[b, q_idx])
        if window is not None:
            visible = visible & (q_idx - kv_idx < window)
        return visible

    _, create_block_mask = _flex_functions()
    rows = meta.batch_size if starts is not None else None
    S = meta.seq_len
    return create_block_mask(mask_mod, rows, None, S, S, device=meta.positions.device)


def forward(
    q_BSHE: torch.Tensor,
    k_BLKE: torch.Tensor,
    v_BLKV: torch.Tensor,
    meta: AttentionMetadata,
    block_mask: Any,
    *,
    window: int | None,
    sinks: torch.Tensor | None,
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    """The ``flex`` backend's forward over ``prepare``'s ``BlockMask`` (which holds the
    window already)."""
    from torch.nn.attention.flex_attention import AuxRequest

    del meta, window  # both are in the BlockMask

    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q_BSHE, k_BLKE, v_BLKV, sinks)
    )
    if needs_grad and q_BSHE.device.type in _NO_FLEX_BACKWARD:
        raise ValueError(
            f"attention backend 'flex' cannot run backward on {q_BSHE.device.type} (torch's "
            "FlexAttention has no backward there); use attention_backend='varlen' (packed "
            "documents, linear memory) or 'sdpa' (dense reference)"
        )
    flex_attention, _ = _flex_functions()
    score_mod = None
    if softcap is not None:

        def score_mod(score, b, h, q_idx, kv_idx):
            return softcap * torch.tanh(score / softcap)

    q, k, v = q_BSHE.transpose(1, 2), k_BLKE.transpose(1, 2), v_BLKV.transpose(1, 2)
    kwargs = dict(score_mod=score_mod, block_mask=block_mask, scale=scale)
    kwargs["enable_gqa"] = k.shape[1] != q.shape[1]
    if sinks is None:
        return flex_attention(q, k, v, **kwargs).transpose(1, 2)
    o_BHSV, aux = flex_attention(q, k, v, return_aux=AuxRequest(lse=True), **kwargs)
    # A sink adds exp(sink) to the softmax denominator: rescale by exp(lse) / (exp(lse) +
    # exp(sink)) = sigmoid(lse - sink).
    keep_BHS = torch.sigmoid(aux.lse - sinks.to(aux.lse.dtype)[None, :, None])
    return (o_BHSV * keep_BHS[..., None].to(o_BHSV.dtype)).transpose(1, 2)
