"""The ``varlen`` attention backend: packed documents with no ``S × S`` tensor.

Three implementations of one contract (``attention_backends.attend``), chosen by what the
device offers, all linear in S for a fixed number of documents or a fixed window:

- torch's varlen flash attention (``torch.nn.attention.varlen.varlen_attn``) over the
  flattened tokens and the batch's ``cu_seqlens`` (built on the device, static size), where
  it runs: CUDA, fp16/bf16, no sinks, no softcap;
- elsewhere on an accelerator (fp32, sinks, softcap): the ``flex`` backend, whose block
  mask is built on the device from the documents' starts;
- on CPU (no flash kernel, no FlexAttention backward): SDPA over tiles planned once per
  batch and window on the host, where the tensors already are (nothing waits):

  * a document no longer than the window (any document without one) is one *causal piece*;
    pieces are grouped by length (rounded up to 2^k or 3·2^(k-1), so a group pads at most a
    third) and each group is one SDPA call with ``is_causal`` on ``(pieces, H, Lq, E)``:
    padding sits after the real tokens, where causality hides it;
  * a document longer than the window W is a causal piece of its first W tokens and *band
    pieces* of W queries each, every one attending to its own W tokens and the W before them
    through one shared ``(W, 2W)`` band mask: one SDPA call for all band pieces.

  A bidirectional batch (an encoder's) makes every document one piece attended in full:
  SDPA with a key-padding mask instead of ``is_causal``.

  Sinks ride along as one extra key per piece (a zero key with score ``sink_h`` through an
  extra head-dim column, and a zero value); softcap, which SDPA cannot express, takes
  explicit scores in query chunks under activation checkpointing (memory linear in the
  document length, compute like the dense path).

The host plan reads the document lengths once per batch (memoised on the
``AttentionMetadata``); on an accelerator nothing is read back. The forward is excluded from
``torch.compile`` (the tiles' shapes are data), so a compiled block breaks its graph around
it.

Shapes: B batch, S sequence, T = B·S tokens, H query heads, K kv heads, E q/k head dim,
V value dim; a group: m pieces of Lq queries and Lk keys; C = the window.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from . import flex
from .attention_metadata import AttentionMetadata
from .dense_attention import math_attention, sdpa

_QUERY_CHUNK = 256
"""Queries per checkpointed chunk on the softcap (explicit scores) path."""
_MIN_PIECE = 16
"""Shortest padded causal piece (tiny documents share one group)."""


@dataclass(slots=True)
class _Group:
    """Pieces attended by one SDPA call."""

    band: bool
    """Band pieces (keys = the previous W tokens and their own) or causal pieces."""
    q_index: torch.Tensor
    """``(m, Lq)`` flattened token of every query row (padding clamped to a real token)."""
    k_index: torch.Tensor | None
    """``(m, 2C)`` flattened token of every key of a band piece; ``None`` for causal pieces
    (their keys are their queries)."""
    valid: torch.Tensor
    """Positions in the flattened ``(m·Lq)`` query rows that are real tokens."""
    key_mask: torch.Tensor | None = None
    """``(m, Lq)`` real keys of bidirectional pieces (they see their whole document, so the
    padding after it must be masked); ``None`` for causal pieces."""


@dataclass(slots=True)
class _Plan:
    direct: bool
    """Each row is one document inside the window: SDPA's causal kernel on ``(B, H, S, E)``."""
    groups: list[_Group]
    inverse: torch.Tensor
    """``(T,)`` where each token's output row is in the concatenated group outputs."""
    band_mask: torch.Tensor | None
    """``(C, 2C)`` query ↔ key visibility inside a band piece."""


def prepare(meta: AttentionMetadata, window: int | None) -> None:
    """Nothing ahead of the forward: the plan is built at its first use (which path runs
    depends on the layer's dtype and options)."""
    return None


@torch.compiler.disable
def forward(
    q_BSHE: torch.Tensor,
    k_BSKE: torch.Tensor,
    v_BSKV: torch.Tensor,
    meta: AttentionMetadata,
    prepared: None,
    *,
    window: int | None,
    sinks: torch.Tensor | None,
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    """The ``varlen`` backend's forward (see the module docstring)."""
    if k_BSKE.shape[1] != q_BSHE.shape[1]:
        raise ValueError(
            f"attention backend 'varlen' attends a sequence to itself: got {q_BSHE.shape[1]} "
            f"queries and {k_BSKE.shape[1]} keys per row"
        )
    if _flash_varlen_runs(q_BSHE, sinks, softcap):
        return _flash_varlen(q_BSHE, k_BSKE, v_BSKV, meta, window=window, scale=scale)
    on_accelerator = q_BSHE.device.type != "meta" and flex.has_backward(q_BSHE.device)
    if on_accelerator:  # no host plan, no host read (meta tensors: the plan's shapes only)
        block_mask = meta.prepared(("flex", window), lambda: flex.prepare(meta, window))
        options = dict(window=window, sinks=sinks, scale=scale, softcap=softcap)
        return flex.forward(q_BSHE, k_BSKE, v_BSKV, meta, block_mask, **options)
    plan = meta.prepared(("varlen-plan", window), lambda: _plan(meta, window))
    if plan.direct and sinks is None and softcap is None:
        q, k, v = q_BSHE.transpose(1, 2), k_BSKE.transpose(1, 2), v_BSKV.transpose(1, 2)
        causal = not meta.bidirectional
        return sdpa(q, k, v, is_causal=causal, scale=scale).transpose(1, 2)
    return _tiled(q_BSHE, k_BSKE, v_BSKV, plan, sinks=sinks, scale=scale, softcap=softcap)


# --- torch's varlen flash attention ---------------------------------------------------------


def _flash_varlen_runs(q: torch.Tensor, sinks: torch.Tensor | None, softcap: float | None) -> bool:
    """Where ``varlen_attn`` has a kernel (flash/cuDNN: CUDA, half precision) for our options."""
    return (
        q.device.type == "cuda"
        and q.dtype in (torch.float16, torch.bfloat16)
        and q.shape[-1] <= 256
        and sinks is None
        and softcap is None
    )


def _flash_varlen(q_BSHE, k_BSKE, v_BSKV, meta, *, window, scale):
    from torch.nn.attention.varlen import varlen_attn

    B, S, H, E = q_BSHE.shape
    K, V = k_BSKE.shape[2], v_BSKV.shape[-1]
    v = v_BSKV if V == E else torch.nn.functional.pad(v_BSKV, (0, E - V))
    # S bounds every document (they never cross rows): no host read of the longest one.
    cu, longest = meta.cu_seqlens, S
    o_THE = varlen_attn(
        q_BSHE.reshape(B * S, H, E),
        k_BSKE.reshape(B * S, K, E),
        v.reshape(B * S, K, E),
        cu,
        cu,
        longest,
        longest,
        scale=scale,
        window_size=(-1, -1) if meta.bidirectional else (-1 if window is None else window - 1, 0),
        enable_gqa=K != H,
    )
    assert isinstance(o_THE, torch.Tensor)  # no aux outputs asked for
    return o_THE[..., :V].reshape(B, S, H, V)


# --- the tile plan ---------------------------------------------------------------------------


def _padded_length(n: int) -> int:
    """The group a piece of ``n`` tokens joins: the next 2^k or 3·2^(k-1) (at least 16)."""
    size = _MIN_PIECE
    while size < n:
        size = size * 3 // 2 if (size & (size - 1)) == 0 else size * 4 // 3
    return size


def _plan(meta: AttentionMetadata, window: int | None) -> _Plan:
    S, T = meta.seq_len, meta.num_tokens
    device = meta.positions.device
    if meta.starts is None:
        docs = [(b * S, S) for b in range(meta.batch_size)]
    else:
        lengths = meta.document_lengths()
        offsets = [0]
        for n in lengths:
            offsets.append(offsets[-1] + n)
        docs = [(o, n) for o, n in zip(offsets, lengths, strict=False) if n > 0]
    causal: dict[int, list[tuple[int, int]]] = {}
    band: list[tuple[int, int]] = []
    for start, n in docs:
        head = n if window is None else min(n, window)
        causal.setdefault(_padded_length(head), []).append((start, head))
        if window is not None:
            band += [(start + j, min(window, n - j)) for j in range(window, n, window)]

    groups = [
        _causal_group(pieces, T, bidirectional=meta.bidirectional)
        for _, pieces in sorted(causal.items())
    ]
    band_mask = None
    if band:
        assert window is not None  # bands only under a window
        groups.append(_band_group(band, window, T))
        qq, kk = torch.arange(window)[:, None], torch.arange(2 * window)[None, :]
        band_mask = (kk > qq) & (kk <= qq + window)  # key kk is token kk - W of the piece
    order = torch.cat([g.q_index.flatten()[g.valid] for g in groups])
    assert order.numel() == T, "the pieces must cover every token once"
    inverse = torch.empty(T, dtype=torch.long)
    inverse[order] = torch.arange(T)
    direct = meta.starts is None and (window is None or window >= S)
    return _Plan(
        direct=direct,
        groups=[_to(g, device) for g in groups],
        inverse=inverse.to(device),
        band_mask=None if band_mask is None else band_mask.to(device),
    )


def _causal_group(pieces: list[tuple[int, int]], T: int, *, bidirectional: bool) -> _Group:
    starts = torch.tensor([s for s, _ in pieces])
    lengths = torch.tensor([n for _, n in pieces])
    Lq = int(lengths.max())
    q_index = (starts[:, None] + torch.arange(Lq)).clamp(max=T - 1)
    real = torch.arange(Lq)[None, :] < lengths[:, None]
    valid = real.flatten().nonzero().flatten()
    key_mask = real if bidirectional else None
    return _Group(band=False, q_index=q_index, k_index=None, valid=valid, key_mask=key_mask)


def _band_group(pieces: list[tuple[int, int]], C: int, T: int) -> _Group:
    starts = torch.tensor([s for s, _ in pieces])
    lengths = torch.tensor([n for _, n in pieces])
    q_index = (starts[:, None] + torch.arange(C)).clamp(max=T - 1)
    # A band piece starts at least W tokens into its document, so its keys never start
    # before the document does.
    k_index = (starts[:, None] - C + torch.arange(2 * C)).clamp(max=T - 1)
    valid = (torch.arange(C)[None, :] < lengths[:, None]).flatten().nonzero().flatten()
    return _Group(band=True, q_index=q_index, k_index=k_index, valid=valid)


def _to(group: _Group, device: torch.device) -> _Group:
    return _Group(
        band=group.band,
        q_index=group.q_index.to(device),
        k_index=None if group.k_index is None else group.k_index.to(device),
        valid=group.valid.to(device),
        key_mask=None if group.key_mask is None else group.key_mask.to(device),
    )


# --- attention over the plan -----------------------------------------------------------------


def _tiled(q_BSHE, k_BSKE, v_BSKV, plan: _Plan, *, sinks, scale, softcap) -> torch.Tensor:
    B, S, H, E = q_BSHE.shape
    K, V = k_BSKE.shape[2], v_BSKV.shape[-1]
    q_THE = q_BSHE.reshape(B * S, H, E)
    k_TKE = k_BSKE.reshape(B * S, K, E)
    v_TKV = v_BSKV.reshape(B * S, K, V)
    sink_key = None
    if sinks is not None and softcap is None:
        # One extra q/k column: 0 on every real key, so their scores do not change, and
        # sink_h / scale on query head h against a sink key [0, ..., 0, 1]: score sink_h.
        sink_THE = (sinks.to(q_THE.dtype) / scale)[None, :, None].expand(B * S, H, 1)
        q_THE = torch.cat([q_THE, sink_THE], dim=-1)
        k_TKE = torch.cat([k_TKE, k_TKE.new_zeros(B * S, K, 1)], dim=-1)
        sink_key = k_TKE.new_zeros(E + 1)
        sink_key[-1] = 1
    outputs = []
    for group in plan.groups:
        k_index = group.k_index if group.band else group.q_index
        q = q_THE[group.q_index].transpose(1, 2)  # (m, H, Lq, E)
        k = k_TKE[k_index].transpose(1, 2)  # (m, K, Lk, E)
        v = v_TKV[k_index].transpose(1, 2)
        band_mask = plan.band_mask if group.band else None
        if group.key_mask is not None:  # bidirectional: every real key of the piece
            band_mask = group.key_mask[:, None, None, :]
        if softcap is not None:
            o = _explicit(q, k, v, band_mask, sinks=sinks, scale=scale, softcap=softcap)
        else:
            o = _sdpa_piece(q, k, v, band_mask, sink_key=sink_key, scale=scale)
        outputs.append(o.transpose(1, 2).reshape(-1, H, V)[group.valid])
    return torch.cat(outputs)[plan.inverse].view(B, S, H, V)


def _sdpa_piece(q, k, v, band_mask, *, sink_key, scale):
    """One group through SDPA; with sinks, the sink key goes first (and, for causal pieces,
    a dummy query in front keeps ``is_causal`` aligned: real query i sees keys 0..i+1)."""
    m, K = k.shape[0], k.shape[1]
    if sink_key is not None:
        k = torch.cat([sink_key.expand(m, K, 1, -1), k], dim=2)
        v = torch.cat([v.new_zeros(m, K, 1, v.shape[-1]), v], dim=2)
        if band_mask is not None:
            ones = band_mask.new_ones((*band_mask.shape[:-1], 1))
            band_mask = torch.cat([ones, band_mask], dim=-1)
        else:
            q = torch.cat([q.new_zeros(m, q.shape[1], 1, q.shape[-1]), q], dim=2)
    if band_mask is not None:
        return sdpa(q, k, v, mask=band_mask, scale=scale)
    o = sdpa(q, k, v, is_causal=True, scale=scale)
    return o[:, :, 1:] if sink_key is not None else o


def _explicit(q, k, v, band_mask, *, sinks, scale, softcap):
    """Explicit scores (softcap) in chunks, each recomputed in backward: a chunk's scores are
    the only ones alive at a time."""
    options = dict(scale=scale, sinks=sinks, softcap=softcap)
    chunks = []
    if band_mask is not None and band_mask.dim() == 4:  # bidirectional: a key mask per piece
        for c0 in range(0, q.shape[2], _QUERY_CHUNK):
            chunk = q[:, :, c0 : c0 + _QUERY_CHUNK]
            chunks.append(_checkpointed(chunk, k, v, band_mask, options))
        return torch.cat(chunks, dim=2)
    if band_mask is not None:  # every piece has 2C keys: chunk the pieces
        per_chunk = max(1, _QUERY_CHUNK // band_mask.shape[0])
        for p in range(0, q.shape[0], per_chunk):
            sl = slice(p, p + per_chunk)
            chunks.append(_checkpointed(q[sl], k[sl], v[sl], band_mask, options))
        return torch.cat(chunks, dim=0)
    Lq = q.shape[2]
    for c0 in range(0, Lq, _QUERY_CHUNK):
        c1 = min(c0 + _QUERY_CHUNK, Lq)
        causal = (
            torch.arange(c1, device=q.device)[None, :]
            <= torch.arange(c0, c1, device=q.device)[:, None]
        )
        chunks.append(_checkpointed(q[:, :, c0:c1], k[:, :, :c1], v[:, :, :c1], causal, options))
    return torch.cat(chunks, dim=2)


def _checkpointed(q, k, v, mask, options):
    if not torch.is_grad_enabled():
        return math_attention(q, k, v, mask, **options)
    return checkpoint(math_attention, q, k, v, mask, use_reentrant=False, **options)
