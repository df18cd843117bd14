"""Compressed attention (DeepSeek-V4 §2.3): KV compression, the lightning indexer and the
sparse attention over a sliding window plus compressed entries.

**Compression.** Every ``m`` consecutive tokens of a document (a *window*, aligned at the
document's start) become one compressed key/value *entry*: per channel, a softmax over the
window's gate logits (plus a learned bias per position in the window) weighs the window's
projected values, the sum is RMS-normalised and rotated (RoPE at the window's first
position). Heavily compressed attention (HCA, ``m`` = 128) pools each window on its own; compressed sparse
attention (CSA, ``m`` = 4) *overlaps* windows: each token projects two series, and entry ``w``
pools the previous window's first series with its own window's second (``2m`` tokens, stride
``m``; the first window of a document has no previous one). An entry exists once its whole
window has been seen, and a query sees the entries whose windows end at or before it, in its
own document.

**Selection.** HCA queries attend to every visible entry. CSA queries attend to the
``top_k`` visible entries of the *lightning indexer*: its own (narrower) compressor and
``Hi`` query heads score entry ``c`` for query ``t`` as
``Σ_h w_{t,h} · relu(q_{t,h} · k_c) / √Ei`` (``w`` a learned per-token head weight). The
selection is a discrete choice: no gradient flows through it (as in transformers; the
paper trains the indexer with a separate distillation loss, not implemented here).

**Attention.** One softmax over the query's sliding window of raw keys (its own document,
``W`` tokens), its compressed entries and a learned sink per head; keys are their own values
(one shared K=V head). ``compressed_sparse_attention`` runs it in query chunks over the band of
keys each chunk can see, gathering each query's selected entries: the work per query is
``W + top_k`` (CSA) or ``W + S/m`` (HCA) keys, never ``S``; chunks are recomputed in the
backward pass instead of stored when there is more than one.

``EntryLayout`` says where a batch's entries come from: ``training_layout`` reads document
boundaries off ``AttentionMetadata``, ``cache_layout`` the cache slots of a decoding step (one
document per row).

Shapes: B batch, S queries, L keys (band or cache), C entries, W window tokens (m or 2m),
E head dim, F projected width (E, or 2E with overlap), H heads, K selected entries,
Hi / Ei indexer heads / head dim, R rotary dims.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .attention_metadata import AttentionMetadata, CacheStep
from .init import Constant, Init, Normal, prefixed
from .norm import RMSNorm
from .rope import RotaryEmbedding, apply_rotary_tail

_SCORE_ELEMENTS = 1 << 24
"""Indexer scores computed at once (query chunks): bounds its memory at any length."""


@dataclass(frozen=True, slots=True)
class EntryLayout:
    """Where the entries of one forward lie in the source tokens, for one compression rate."""

    ends: torch.Tensor
    """``(B, C)`` index of each entry's last token: in the row (no cache) or its cache slot."""
    valid: torch.Tensor
    """``(B, C)`` whether the entry exists (a full window of real tokens)."""
    has_previous: torch.Tensor
    """``(B, C)`` whether the window before it lies in the same document (CSA overlap)."""
    positions: torch.Tensor
    """``(B, C)`` RoPE position of each entry: its window's first position."""
    visible: torch.Tensor
    """``(B, S, C)`` which entries each query may see (valid, ended, same document)."""
    slots: torch.Tensor | None = None
    """Cache steps: ``(B, C)`` the cache row each new entry goes to (``capacity`` = none)."""
    lengths: torch.Tensor | None = None
    """Cache steps: ``(B,)`` tokens each row held before the step (the source is then
    ``[ring | the step's tokens]``, see ``source``)."""
    ring: int = 0
    """Cache steps: raw tokens the ring holds."""

    def source(self, index_BCW: torch.Tensor) -> torch.Tensor:
        """Where tokens (by row index, or cache slot) are in the source buffer: the row itself,
        or ``[ring (slot % ring) | new tokens]``."""
        index_BCW = index_BCW.clamp(min=0)  # before a document: masked by the caller
        if self.lengths is None:
            return index_BCW
        lengths_B11 = self.lengths[:, None, None]
        new = index_BCW >= lengths_B11
        return torch.where(new, self.ring + index_BCW - lengths_B11, index_BCW % self.ring)


def training_layout(meta: AttentionMetadata, rate: int) -> EntryLayout:
    """Entries of a forward without a cache: windows of ``rate`` tokens from each document's
    start; entry ``c`` of a row is its ``c``-th complete window (``S // rate`` at most)."""
    B, S = meta.batch_size, meta.seq_len
    device = meta.positions.device
    index_BS = torch.arange(S, device=device).expand(B, S)
    starts_BS = meta.starts if meta.starts is not None else torch.zeros_like(index_BS)
    in_doc_BS = index_BS - starts_BS
    is_end_BS = (in_doc_BS + 1) % rate == 0
    C = S // rate
    column_BS = torch.where(is_end_BS, is_end_BS.cumsum(1) - 1, C)  # non-ends: a scratch column
    ends_BC = torch.zeros(B, C + 1, dtype=torch.long, device=device)
    ends_BC = ends_BC.scatter(1, column_BS, index_BS)[:, :C]
    valid_BC = torch.zeros(B, C + 1, dtype=torch.bool, device=device)
    valid_BC = valid_BC.scatter(1, column_BS, is_end_BS)[:, :C]
    firsts_BC = (ends_BC - rate + 1).clamp(min=0)
    has_previous_BC = valid_BC & (in_doc_BS.gather(1, ends_BC) >= 2 * rate - 1)
    visible_BSC = (
        valid_BC[:, None, :]
        & (ends_BC[:, None, :] <= index_BS[:, :, None])
        & (firsts_BC[:, None, :] >= starts_BS[:, :, None])
    )
    return EntryLayout(
        ends=ends_BC,
        valid=valid_BC,
        has_previous=has_previous_BC,
        positions=meta.positions.gather(1, firsts_BC),
        visible=visible_BSC,
    )


def cache_layout(step: CacheStep, rate: int, ring: int, capacity: int) -> EntryLayout:
    """Entries completed by a cache step (one document per row, positions = slots): the
    windows ending at new real tokens, read from ``[ring of the last ring raw tokens | the
    step's tokens]``; ``visible`` covers the first ``kv_len // rate`` rows of the entry buffer
    (its ``capacity`` rows, then a scratch row)."""
    lengths_B = step.lengths
    S = step.slots.shape[1]
    device = lengths_B.device
    real_B = step.input_lengths if step.input_lengths is not None else torch.full_like(lengths_B, S)
    first_end_B = (lengths_B + rate) // rate * rate - 1  # first slot >= length ending a window
    ends_slot_BK = first_end_B[:, None] + rate * torch.arange(S // rate + 1, device=device)
    valid_BK = ends_slot_BK < (lengths_B + real_B)[:, None]
    entries = min(step.kv_len // rate, capacity)
    rows_C = torch.arange(entries, device=device)
    visible_BSC = (rows_C + 1) * rate - 1 <= step.slots[:, :, None]
    return EntryLayout(
        ends=ends_slot_BK,
        valid=valid_BK,
        has_previous=valid_BK & (ends_slot_BK >= 2 * rate - 1),
        positions=ends_slot_BK - rate + 1,
        visible=visible_BSC,
        slots=torch.where(valid_BK, (ends_slot_BK + 1) // rate - 1, capacity),
        lengths=lengths_B,
        ring=ring,
    )


class KVCompressor(nn.Module):
    """Gated pooling of ``rate``-token windows into entries of width ``head_dim`` (see the module
    docstring); ``overlap``: CSA's two series over ``2·rate`` tokens."""

    def __init__(
        self,
        dim: int,
        head_dim: int,
        rate: int,
        *,
        overlap: bool,
        rotary: RotaryEmbedding,
        norm_eps: float,
    ) -> None:
        """``rotary``: the (interleaved) RoPE of the entries, rotating their last channels."""
        super().__init__()
        if rate < 2:
            raise ValueError(f"compression rate must be >= 2, got {rate}")
        width = (2 if overlap else 1) * head_dim
        self.head_dim, self.rate, self.overlap, self.rotary = head_dim, rate, overlap, rotary
        self.wkv = nn.Linear(dim, width, bias=False)
        self.wgate = nn.Linear(dim, width, bias=False)
        self.position_bias = nn.Parameter(torch.empty(rate, width))
        self.norm = RMSNorm(head_dim, eps=norm_eps)

    @property
    def ring(self) -> int:
        """Raw tokens a cache keeps for the windows still to complete."""
        return (2 if self.overlap else 1) * self.rate - 1

    def project(self, x_BSD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The per-token values and gate logits ``(B, S, F)`` the windows pool."""
        return self.wkv(x_BSD), self.wgate(x_BSD)

    def pool(
        self, kv_BLF: torch.Tensor, gate_BLF: torch.Tensor, layout: EntryLayout
    ) -> torch.Tensor:
        """Entries ``(B, C, E)`` of the windows ``layout`` names in the source tokens."""
        m, E = self.rate, self.head_dim
        bias_mF = self.position_bias
        span_m = torch.arange(m, device=kv_BLF.device)
        window_BCm = layout.ends[..., None] - (m - 1) + span_m
        # Windows that do not exist (past a row's real tokens) read a clamped index: their
        # entries are invalid and go to the cache's scratch row.
        last = kv_BLF.shape[1] - 1
        current_BCm = layout.source(window_BCm).clamp(max=last)
        if not self.overlap:
            kv_BCmE = _gather(kv_BLF, current_BCm)
            gate_BCmE = _gather(gate_BLF, current_BCm) + bias_mF
        else:
            previous_BCm = layout.source(window_BCm - m).clamp(max=last)
            kv_BCmE = torch.cat(
                [_gather(kv_BLF[..., :E], previous_BCm), _gather(kv_BLF[..., E:], current_BCm)], 2
            )
            gate_prev = _gather(gate_BLF[..., :E], previous_BCm) + bias_mF[:, :E]
            gate_prev = gate_prev.masked_fill(~layout.has_previous[..., None, None], float("-inf"))
            gate_cur = _gather(gate_BLF[..., E:], current_BCm) + bias_mF[:, E:]
            gate_BCmE = torch.cat([gate_prev, gate_cur], dim=2)
        weights = gate_BCmE.softmax(dim=2, dtype=torch.float32).to(kv_BCmE.dtype)
        entries_BCE = self.norm((kv_BCmE * weights).sum(dim=2))
        rope = self.rotary(layout.positions, entries_BCE.dtype)
        return apply_rotary_tail(entries_BCE[:, :, None], rope, interleaved=True)[:, :, 0]

    def forward(self, x_BSD: torch.Tensor, layout: EntryLayout) -> torch.Tensor:
        """Entries of this forward's own tokens (no cache)."""
        kv_BSF, gate_BSF = self.project(x_BSD)
        return self.pool(kv_BSF, gate_BSF, layout)

    def param_init(self, *, std: float, out_std: float = 0.0) -> dict[str, Init]:
        """Projections N(0, std²), position bias 0 (as transformers), norm 1."""
        inits: dict[str, Init] = {"wkv.weight": Normal(std), "wgate.weight": Normal(std)}
        inits["position_bias"] = Constant(0.0)
        return inits | prefixed("norm", self.norm.param_init())


def _gather(x_BLF: torch.Tensor, index_BCW: torch.Tensor) -> torch.Tensor:
    B, C, W = index_BCW.shape
    flat = index_BCW.reshape(B, C * W, 1).expand(B, C * W, x_BLF.shape[-1])
    return x_BLF.gather(1, flat).view(B, C, W, -1)


class LightningIndexer(nn.Module):
    """CSA's entry selection (see the module docstring): its own overlapping compressor of
    width ``head_dim``, ``num_heads`` query heads from the query latent, per-token head
    weights, top-``top_k`` of the visible entries."""

    def __init__(
        self,
        dim: int,
        q_lora_rank: int,
        *,
        num_heads: int,
        head_dim: int,
        rate: int,
        top_k: int,
        rotary: RotaryEmbedding,
        norm_eps: float,
    ) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.top_k = num_heads, head_dim, top_k
        self.rotary = rotary
        self.wq_b = nn.Linear(q_lora_rank, num_heads * head_dim, bias=False)
        self.weights_proj = nn.Linear(dim, num_heads, bias=False)
        self.compressor = KVCompressor(
            dim, head_dim, rate, overlap=True, rotary=rotary, norm_eps=norm_eps
        )

    @torch.no_grad()
    def select(
        self,
        x_BSD: torch.Tensor,
        q_latent_BSQ: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        keys_BCE: torch.Tensor,
        visible_BSC: torch.Tensor,
    ) -> torch.Tensor:
        """``(B, S, K)`` chosen entries per query (``K = min(top_k, C)``), -1 where fewer are
        visible. ``rope``: the queries' tables (the compressed layers' RoPE)."""
        B, S, _ = x_BSD.shape
        C = keys_BCE.shape[1]
        q_BSHE = self.wq_b(q_latent_BSQ).view(B, S, self.num_heads, self.head_dim)
        q_BSHE = apply_rotary_tail(q_BSHE, rope, interleaved=True).float()
        w_BSH = self.weights_proj(x_BSD).float() * self.num_heads**-0.5
        keys_BEC = keys_BCE.float().transpose(1, 2)
        step = max(1, _SCORE_ELEMENTS // max(1, B * self.num_heads * C))
        scores = []
        for s0 in range(0, S, step):
            q = q_BSHE[:, s0 : s0 + step]
            s_BsHC = torch.relu(q.reshape(B, -1, self.head_dim) @ keys_BEC)
            s_BsHC = s_BsHC.view(B, q.shape[1], self.num_heads, C) * self.head_dim**-0.5
            scores.append((s_BsHC * w_BSH[:, s0 : s0 + step, :, None]).sum(dim=2))
        scores_BSC = torch.cat(scores, dim=1).masked_fill(~visible_BSC, float("-inf"))
        top = scores_BSC.topk(min(self.top_k, C), dim=-1)
        return torch.where(top.values > float("-inf"), top.indices, -1)

    def param_init(self, *, std: float, out_std: float = 0.0) -> dict[str, Init]:
        inits: dict[str, Init] = {"wq_b.weight": Normal(std), "weights_proj.weight": Normal(std)}
        return inits | prefixed("compressor", self.compressor.param_init(std=std))


def compressed_sparse_attention(
    q_BSHE: torch.Tensor,
    kv_BLE: torch.Tensor,
    *,
    window: int,
    q_index: torch.Tensor,
    kv_index: torch.Tensor | None,
    starts: torch.Tensor | None,
    entries_BCE: torch.Tensor,
    visible_BSC: torch.Tensor | None = None,
    selected_BSK: torch.Tensor | None = None,
    sinks: torch.Tensor,
    scale: float,
    query_chunk: int = 512,
) -> torch.Tensor:
    """One softmax over each query's sliding window of raw K=V keys, its compressed entries and
    a sink per head; ``(B, S, H, E)``.

    Args:
        q_BSHE: queries; kv_BLE: the raw keys (= values) of the one shared head.
        window: a query sees itself and the ``window - 1`` keys before it.
        q_index, kv_index: ``(B, S)`` / ``(B, L)`` index of every query / key in one space
            (cache slots; -1: an empty key). ``kv_index=None``: the keys are the queries' own
            tokens (``L = S``, index = place in the row), and each query chunk reads only the
            band of keys it can see.
        starts: ``(B, S)`` index where each query's document begins (None: 0).
        entries_BCE: compressed entries (keys = values).
        visible_BSC: HCA: which entries each query sees (all of them, ``C`` keys).
        selected_BSK: CSA: the entries each query sees, by index (-1: none).
        sinks: ``(H,)`` sink logits; scale: score scale.
        query_chunk: queries per chunk (memory ``O(chunk · (chunk + W + K))`` per head).
    """
    if (visible_BSC is None) == (selected_BSK is None):
        raise ValueError("pass exactly one of visible_BSC (HCA) and selected_BSK (CSA)")
    S = q_BSHE.shape[1]
    chunks = range(0, S, query_chunk)
    recompute = len(chunks) > 1 and torch.is_grad_enabled()
    outs = []
    for s0 in chunks:
        s1 = min(S, s0 + query_chunk)
        if kv_index is None:  # training: the band [s0 - W + 1, s1) of the queries' own tokens
            l0 = max(0, s0 - window + 1)
            keys_BLE = kv_BLE[:, l0:s1]
            k_index = torch.arange(l0, s1, device=kv_BLE.device).expand(kv_BLE.shape[0], -1)
        else:
            keys_BLE, k_index = kv_BLE, kv_index
        q_idx = q_index[:, s0:s1, None]
        k_idx = k_index[:, None, :]
        local_BQL = (k_idx <= q_idx) & (q_idx - k_idx < window)
        local_BQL &= k_idx >= (starts[:, s0:s1, None] if starts is not None else 0)
        args = (
            q_BSHE[:, s0:s1],
            keys_BLE,
            local_BQL,
            entries_BCE,
            visible_BSC[:, s0:s1] if visible_BSC is not None else None,
            selected_BSK[:, s0:s1] if selected_BSK is not None else None,
            sinks,
            scale,
        )
        if recompute:
            outs.append(checkpoint(_attend_chunk, *args, use_reentrant=False))
        else:
            outs.append(_attend_chunk(*args))
    return torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]


def _attend_chunk(
    q_BQHE: torch.Tensor,
    k_BLE: torch.Tensor,
    local_BQL: torch.Tensor,
    entries_BCE: torch.Tensor,
    visible_BQC: torch.Tensor | None,
    selected_BQK: torch.Tensor | None,
    sinks_H: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    B, Q, H, E = q_BQHE.shape
    L = k_BLE.shape[1]
    q_BXE = q_BQHE.reshape(B, Q * H, E)  # X = Q·H rows share the one K=V head
    s_local = (q_BXE @ k_BLE.transpose(1, 2)).view(B, Q, H, L) * scale
    s_local = s_local.masked_fill(~local_BQL[:, :, None], float("-inf"))
    picked_BQKE = None
    if selected_BQK is not None:
        K = selected_BQK.shape[-1]
        picked_BQKE = entries_BCE.gather(
            1, selected_BQK.clamp(min=0).reshape(B, Q * K, 1).expand(B, Q * K, E)
        ).view(B, Q, K, E)
        s_entries = (q_BQHE @ picked_BQKE.transpose(2, 3)) * scale  # (B, Q, H, K)
        s_entries = s_entries.masked_fill((selected_BQK < 0)[:, :, None], float("-inf"))
    else:
        assert visible_BQC is not None  # dense entries come with their visibility
        C = entries_BCE.shape[1]
        s_entries = (q_BXE @ entries_BCE.transpose(1, 2)).view(B, Q, H, C) * scale
        s_entries = s_entries.masked_fill(~visible_BQC[:, :, None], float("-inf"))
    sink_BQH1 = sinks_H.to(s_local.dtype).view(1, 1, H, 1).expand(B, Q, H, 1)
    p = torch.cat([s_local, s_entries, sink_BQH1], dim=-1).softmax(dim=-1)
    p_local, p_entries = p[..., :L], p[..., L : L + s_entries.shape[-1]]
    o_BQHE = (p_local.reshape(B, Q * H, L) @ k_BLE).view(B, Q, H, E)
    if picked_BQKE is not None:  # the selected entries
        return o_BQHE + p_entries @ picked_BQKE
    return o_BQHE + (p_entries.reshape(B, Q * H, -1) @ entries_BCE).view(B, Q, H, E)


__all__ = [
    "EntryLayout",
    "KVCompressor",
    "LightningIndexer",
    "cache_layout",
    "compressed_sparse_attention",
    "training_layout",
]
