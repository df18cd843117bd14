"""The decoding cache of compressed attention: a sliding ring of raw keys per layer, and per
compressor a ring of the raw projections its unfinished windows still need plus the buffer of
the entries it has emitted.

Built on ``KVCache`` (slots, ragged rows, rings): the raw-key ring is a window-``W`` layer's
ring of ``W - 1`` tokens (K = V, one shared head); a compressor of rate ``m`` keeps the last
``m - 1`` (HCA) or ``2m - 1`` (CSA, overlapping windows) raw projections in the same kind of
ring, and an ``(B, capacity, E)`` entry buffer, ``capacity = max_seq_len // m``. A step
appends the entries whose windows its real tokens complete (``cache_layout``); an entry of a
window ending at slot ``t`` is row ``(t + 1) / m - 1``, visible to queries at slots ``>= t``.

One document per row (positions are slots): packed prefills are refused.

Shapes: B batch, S new tokens, R ring, F raw projection width, E entry width, C capacity.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from .attention_metadata import CacheStep
from .compressed_attention import EntryLayout, KVCompressor, cache_layout
from .kv_cache import KVCache, LayerKVCache


class CompressorCache:
    """One compressor's state: a ring of its raw ``(value, gate)`` projections and its
    emitted entries."""

    def __init__(
        self,
        parent: KVCache,
        compressor: KVCompressor,
        *,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        B = parent.batch_size
        width = compressor.wkv.out_features
        R = compressor.ring
        self.rate, self.capacity = compressor.rate, capacity
        self.raw = LayerKVCache(
            parent,
            torch.zeros(B, 1, R + 1, width, dtype=dtype, device=device),
            torch.zeros(B, 1, R + 1, width, dtype=dtype, device=device),
            ring=R,
        )
        # One scratch row past the capacity takes the writes of unfinished windows.
        self.entries_BCE = torch.zeros(
            B, capacity + 1, compressor.head_dim, dtype=dtype, device=device
        )

    def layout(self, step: CacheStep) -> EntryLayout:
        """Where this step's new entries come from and which entries each query sees."""
        assert self.raw.ring is not None
        return cache_layout(step, self.rate, self.raw.ring, self.capacity)

    def update(
        self, compressor: KVCompressor, x_BSD: torch.Tensor, layout: EntryLayout
    ) -> torch.Tensor:
        """Store this step's raw projections, append the entries it completes, and return the
        entries the step's queries may see, ``(B, C, E)`` (``C = layout.visible.shape[-1]``)."""
        kv_BSF, gate_BSF = compressor.project(x_BSD)
        kv_B1LF, gate_B1LF = self.raw.update(kv_BSF[:, :, None], gate_BSF[:, :, None])
        new_BKE = compressor.pool(kv_B1LF[:, 0], gate_B1LF[:, 0], layout)
        rows_B1 = torch.arange(new_BKE.shape[0], device=new_BKE.device)[:, None]
        self.entries_BCE[rows_B1, layout.slots] = new_BKE.to(self.entries_BCE.dtype)
        return self.entries_BCE[:, : layout.visible.shape[-1]]

    def nbytes_per_token(self) -> float:
        """Entry bytes per cached token (one entry per ``rate`` tokens)."""
        row = self.entries_BCE[0, 0]
        return row.numel() * row.element_size() / self.rate


@dataclass(slots=True)
class CompressedLayerCache:
    """What one compressed-attention layer reads and writes in a decoding step."""

    local: LayerKVCache
    """The ring of the last ``W - 1`` raw keys (stored as keys and values)."""
    compressor: CompressorCache | None = None
    """The layer's entries (CSA / HCA layers)."""
    indexer: CompressorCache | None = None
    """The lightning indexer's entries (CSA layers)."""


class CompressedKVCache(KVCache):
    """``KVCache`` plus the compressors' state of every layer (see the module docstring)."""

    def __init__(
        self,
        *,
        compressors: Mapping[int, tuple[KVCompressor | None, KVCompressor | None]],
        **kv_cache: object,
    ) -> None:
        """``compressors``: layer → (its compressor, its indexer's compressor), None where the
        layer has none; ``kv_cache``: ``KVCache``'s arguments (the rings of raw keys)."""
        super().__init__(**kv_cache)  # type: ignore[arg-type]
        first = next(iter(self.layers.values()))
        assert isinstance(first, LayerKVCache)  # compressed layers are attention layers
        dtype, device = first.k_BKLD.dtype, first.k_BKLD.device
        self.compressed: dict[int, CompressedLayerCache] = {}
        for i, local in self.layers.items():
            main, index = compressors.get(i, (None, None))
            assert isinstance(local, LayerKVCache)
            self.compressed[i] = CompressedLayerCache(
                local=local,
                compressor=self._state(main, dtype, device),
                indexer=self._state(index, dtype, device),
            )

    def _state(
        self, compressor: KVCompressor | None, dtype: torch.dtype, device: torch.device
    ) -> CompressorCache | None:
        if compressor is None:
            return None
        capacity = self.max_seq_len // compressor.rate
        return CompressorCache(self, compressor, capacity=capacity, dtype=dtype, device=device)

    def begin(
        self,
        seq_len: int,
        *,
        input_lengths: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> CacheStep:
        """As ``KVCache.begin``, refusing packed documents and any row past ``max_seq_len``
        (the entry buffers hold that many tokens' entries)."""
        if document_ids is not None:
            raise ValueError(
                "compressed attention's cache holds one document per row: document_ids cannot "
                "be combined with kv_cache (prefill each document in its own row)"
            )
        held = int(self.lengths.max())
        if held + seq_len > self.max_seq_len:
            raise ValueError(
                f"KVCache overflow: a row holds {held} tokens and {seq_len} more do not fit in "
                f"max_seq_len={self.max_seq_len}"
            )
        return super().begin(seq_len, input_lengths=input_lengths)

    def bytes_per_token(self) -> int:
        """Bytes one more token adds: the compressed entries, amortised over their windows
        (the rings do not grow)."""
        per_token = sum(
            state.nbytes_per_token()
            for layer in self.compressed.values()
            for state in (layer.compressor, layer.indexer)
            if state is not None
        )
        return round(per_token) + super().bytes_per_token()


__all__ = ["CompressedKVCache", "CompressedLayerCache", "CompressorCache"]
