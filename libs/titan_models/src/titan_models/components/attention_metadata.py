"""What every attention layer of one forward shares: ``AttentionMetadata``.

Built once per forward (``Transformer.run_blocks``) on the tokens' device and handed to every
layer, so document boundaries, positions and each backend's mask structures (a dense mask, a
FlexAttention ``BlockMask``, a tile plan) are computed once per batch, not once per layer.
Linear-attention operators read the same document boundaries (``cu_seqlens``).

Masks are described without an ``S × S`` tensor: query ``i`` sees key ``j`` iff
``start[i] <= j <= i`` and, in a sliding-window layer, ``i - j < window``; ``start[i]`` is the
index where query ``i``'s document begins (0 without documents). In a KV-cache step ``i`` and
``j`` are cache slots (a row's token index since the cache was empty). A *bidirectional*
batch (vision encoders: every image a document) drops ``j <= i``: a query sees every token of
its own document, ``start[j] == start[i]``.

Shapes: B batch, S queries per row, T = B·S tokens, N documents (all rows together).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .context_parallel import ContextParallelShard


@dataclass(kw_only=True, slots=True, eq=False)
class CacheStep:
    """Where one forward's tokens go in a ``KVCache`` and which cached keys they see."""

    slots: torch.Tensor
    """``(B, S)`` cache slot of every new token (its index in the row's sequence)."""
    lengths: torch.Tensor
    """``(B,)`` tokens each row held before this step."""
    kv_len: int
    """Full-capacity layers attend to slots ``[0, kv_len)`` (the used part of the buffers)."""
    reads_cache: bool
    """False when every row was empty: the step attends to its own tokens only, through the
    run's backend as a training forward would (a prefill)."""
    ring_sizes: Mapping[int, int] = field(default_factory=dict)
    """Window → ring size of the layers of that window whose cache keeps only the last
    ``ring`` tokens (sliding-window eviction); windows not listed hold full buffers."""
    input_lengths: torch.Tensor | None = None
    """``(B,)`` real tokens per row (right-padded prompts); ``None``: all ``S``."""
    starts: torch.Tensor | None = None
    """``(B, S)`` slot where each new token's document begins."""


@dataclass(kw_only=True, slots=True, eq=False)
class AttentionMetadata:
    """Per-batch inputs of every attention layer (see the module docstring).

    Build it with ``from_document_ids``, ``from_lengths``, ``causal`` or ``for_cache_step``
    (``build_attention_metadata`` is the model's entry point, KV cache included). Backends memoise what they derive from it per
    window (``prepared``), so a structure is built once per batch however many layers use it.
    """

    batch_size: int
    """B: rows."""
    seq_len: int
    """S: queries per row."""
    positions: torch.Tensor
    """``(B, S)`` RoPE positions (position inside the document by default)."""
    starts: torch.Tensor | None
    """``(B, S)`` index (slot, with a cache) where each query's document begins; ``None`` when
    every row is one document starting at index 0."""
    boundaries: torch.Tensor | None = None
    """``cu_seqlens`` when known at construction (else derived from ``starts`` on first use)."""
    backend: str = "sdpa"
    """Name of the registered attention backend the layers use (``attention_backends()``)."""
    cache: CacheStep | None = None
    """Set when the forward reads/writes a KV cache."""
    bidirectional: bool = False
    """A query sees every token of its document, not only those before it (an encoder: no
    causal mask, no sliding window, no KV cache)."""
    context_parallel: ContextParallelShard | None = None
    """Set when the rows are one rank's shard of longer sequences (``shard_metadata``): the
    group, and the documents in global indices. ``starts`` is then ``None`` and
    ``cu_seqlens`` holds the row boundaries only: the ``context_parallel`` backend reads the
    masks from here."""
    _memo: dict[Any, Any] = field(default_factory=dict, repr=False)

    # --- constructors ---------------------------------------------------------------------

    @classmethod
    def causal(
        cls,
        batch_size: int,
        seq_len: int,
        device: torch.device | str,
        *,
        positions: torch.Tensor | None = None,
        backend: str = "sdpa",
    ) -> AttentionMetadata:
        """Every row one causal sequence ``0 .. S-1``."""
        if positions is None:
            positions = torch.arange(seq_len, device=device).expand(batch_size, seq_len)
        _check_shape("positions", positions, (batch_size, seq_len))
        cu = torch.arange(batch_size + 1, device=device, dtype=torch.int32) * seq_len
        return cls(
            batch_size=batch_size,
            seq_len=seq_len,
            positions=positions,
            starts=None,
            boundaries=cu,
            backend=backend,
        )

    @classmethod
    def from_document_ids(
        cls,
        document_ids: torch.Tensor,
        *,
        positions: torch.Tensor | None = None,
        backend: str = "sdpa",
        bidirectional: bool = False,
    ) -> AttentionMetadata:
        """Packed documents: ``document_ids`` ``(B, S)``, a run of one id per document,
        non-decreasing along each row (checked on the host for CPU tensors; on an accelerator
        by a device-side assertion, so no host sync). Positions restart at 0 in every document
        unless given. ``bidirectional``: no causal mask inside a document."""
        ids = check_document_ids(document_ids)
        B, S = ids.shape
        starts = document_starts(ids)
        if positions is None:
            positions = torch.arange(S, device=ids.device) - starts
        _check_shape("positions", positions, (B, S))
        return cls(
            batch_size=B,
            seq_len=S,
            positions=positions,
            starts=starts,
            backend=backend,
            bidirectional=bidirectional,
        )

    @classmethod
    def from_lengths(
        cls,
        lengths: Sequence[Sequence[int]],
        seq_len: int,
        device: torch.device | str,
        *,
        positions: torch.Tensor | None = None,
        backend: str = "sdpa",
        bidirectional: bool = False,
    ) -> AttentionMetadata:
        """Packed documents given as lengths per row (each row's lengths sum to ``seq_len``;
        0 = an empty document). ``bidirectional``: no causal mask inside a document (the
        images of a vision encoder's batch)."""
        rows = [list(row) for row in lengths]
        for b, row in enumerate(rows):
            if any(not isinstance(n, int) or isinstance(n, bool) or n < 0 for n in row):
                raise ValueError(f"document lengths of row {b} must be ints >= 0, got {row}")
            if sum(row) != seq_len:
                raise ValueError(
                    f"document lengths of row {b} sum to {sum(row)}, not seq_len={seq_len}: "
                    "every token must belong to one document"
                )
        B = len(rows)
        sizes = [n for row in rows for n in row]
        flat = torch.tensor(sizes, dtype=torch.int64)
        # Document d of the flattened order gets id d: runs are non-decreasing in every row
        # (built from host ints, so also under FakeTensorMode).
        ids = torch.tensor([d for d, n in enumerate(sizes) for _ in range(n)]).view(B, seq_len)
        ids = ids.to(device)
        starts = document_starts(ids)
        if positions is None:
            positions = torch.arange(seq_len, device=ids.device) - starts
        _check_shape("positions", positions, (B, seq_len))
        cu = torch.cat([flat.new_zeros(1), flat.cumsum(0)]).to(torch.int32)
        single = all(sum(n > 0 for n in row) == 1 for row in rows)  # plain causal per row
        return cls(
            batch_size=B,
            seq_len=seq_len,
            positions=positions,
            starts=None if single else starts,
            boundaries=cu.to(device),
            backend=backend,
            bidirectional=bidirectional,
        )

    @classmethod
    def for_cache_step(
        cls,
        step: CacheStep,
        *,
        positions: torch.Tensor | None = None,
        backend: str = "sdpa",
    ) -> AttentionMetadata:
        """A forward that writes ``step.slots`` of a KV cache (``KVCache.begin`` makes the step;
        a caller driving the cache buffers itself can make its own ``CacheStep``)."""
        B, S = step.slots.shape
        starts = step.starts
        if positions is None:
            positions = step.slots if starts is None else step.slots - starts
        _check_shape("positions", positions, (B, S))
        cu = None  # a packed prefill (slots = indices): derived from the starts when asked
        if starts is None or step.reads_cache:
            cu = torch.arange(B + 1, device=step.slots.device, dtype=torch.int32) * S
        return cls(
            batch_size=B,
            seq_len=S,
            positions=positions,
            starts=starts,
            boundaries=cu,
            backend=backend,
            cache=step,
        )

    # --- derived structures ---------------------------------------------------------------

    @property
    def cu_seqlens(self) -> torch.Tensor:
        """int32 document boundaries in the flattened ``(B·S)`` tokens, row boundaries
        included (``[0, S, 2S, ...]`` without documents); empty documents repeat a boundary.
        Derived from ``starts`` on first use with a static ``B·S + 1`` entries (the ``N + 1``
        boundaries, then empty documents at the end), on the device: the number of
        documents is never read on the host."""
        if self.boundaries is None:
            if self.starts is None:
                S, device = self.seq_len, self.positions.device
                rows = torch.arange(self.batch_size + 1, device=device, dtype=torch.int32)
                self.boundaries = rows * S
            else:
                self.boundaries = _cu_seqlens(self.starts)
        return self.boundaries

    @property
    def num_tokens(self) -> int:
        """T = B·S."""
        return self.batch_size * self.seq_len

    def document_lengths(self) -> list[int]:
        """Host list of the documents' lengths in flattened order (empty ones included);
        one device→host copy per batch, memoised: for host-planned kernels (``varlen``'s
        tiles on CPU), not for an accelerator's step."""
        if "lengths" not in self._memo:
            self._memo["lengths"] = self.cu_seqlens.diff().tolist()
        return self._memo["lengths"]

    @property
    def max_seqlen(self) -> int:
        """Longest document (host int, as varlen kernels want it)."""
        return max(self.document_lengths(), default=0)

    def prepared(self, key: Any, build: Callable[[], Any]) -> Any:
        """``build()``'s result, once per batch for each ``key`` (a backend's per-window mask
        structure)."""
        if key not in self._memo:
            self._memo[key] = build()
        return self._memo[key]

    def key_slots(self, window: int | None) -> torch.Tensor:
        """``(B, L)`` slot of every key a cached layer of ``window`` attends to: the used
        part of a full buffer, or a ring's slots (-1 where empty) followed by the new tokens."""
        step = self.cache
        assert step is not None
        ring = step.ring_sizes.get(window) if window is not None else None
        device = step.slots.device
        if ring is None:
            return torch.arange(step.kv_len, device=device).expand(self.batch_size, -1)
        last_B1 = step.lengths[:, None] - 1
        held_BR = last_B1 - torch.remainder(last_B1 - torch.arange(ring, device=device), ring)
        return torch.cat([held_BR.clamp(min=-1), step.slots], dim=1)

    def dense_mask(self, window: int | None) -> torch.Tensor:
        """``(B, 1, S, L)`` boolean mask (True = attend) with every rule applied: the dense
        reference and the decode path; O(S·L) memory."""
        if self.cache is not None and self.cache.reads_cache:
            q_BS = self.cache.slots
            k_BL = self.key_slots(window)
        else:
            q_BS = torch.arange(self.seq_len, device=self.positions.device).expand(
                self.batch_size, -1
            )
            k_BL = q_BS
        k_B1L, q_BS1 = k_BL[:, None, :], q_BS[:, :, None]
        if self.bidirectional:  # same document (no cache, no window: refused by ``attend``)
            if self.starts is None:
                return torch.ones_like(k_B1L <= q_BS1)[:, None]
            return (self.starts[:, None, :] == self.starts[:, :, None])[:, None]
        mask_BSL = k_B1L <= q_BS1
        if self.starts is not None:
            mask_BSL = mask_BSL & (k_B1L >= self.starts[:, :, None])
        else:
            mask_BSL = mask_BSL & (k_B1L >= 0)
        if window is not None:
            mask_BSL = mask_BSL & (q_BS1 - k_B1L < window)
        return mask_BSL[:, None]


def positions_from_document_ids(document_ids_BS: torch.Tensor) -> torch.Tensor:
    """Each token's position inside its document: 0 at every change of document id."""
    S = document_ids_BS.shape[1]
    return torch.arange(S, device=document_ids_BS.device) - document_starts(document_ids_BS)


def document_starts(ids_BS: torch.Tensor) -> torch.Tensor:
    """Index where each token's document begins (a change of id starts a document)."""
    B, S = ids_BS.shape
    index_BS = torch.arange(S, device=ids_BS.device).expand(B, S)
    is_start_BS = torch.ones_like(ids_BS, dtype=torch.bool)
    is_start_BS[:, 1:] = ids_BS[:, 1:] != ids_BS[:, :-1]
    return torch.where(is_start_BS, index_BS, 0).cummax(dim=1).values


def _cu_seqlens(starts_BS: torch.Tensor) -> torch.Tensor:
    """Document boundaries in the flattened tokens, padded to a static ``T + 1`` entries:
    the ``N + 1`` boundaries, then ``T`` repeated (empty documents). The number of documents
    is data; the size is not, so nothing is read on the host."""
    B, S = starts_BS.shape
    T = B * S
    index_BS = torch.arange(S, device=starts_BS.device).expand(B, S)
    flat_index = torch.arange(T, device=starts_BS.device)
    is_start_T = (starts_BS == index_BS).flatten()
    # Starts keep their index, every other token sorts last as T: the starts in order.
    keys_T = torch.sort(torch.where(is_start_T, flat_index, T)).values
    return torch.cat([keys_T, keys_T.new_full((1,), T)]).to(torch.int32)


def check_document_ids(document_ids: torch.Tensor) -> torch.Tensor:
    if not isinstance(document_ids, torch.Tensor) or document_ids.dim() != 2:
        shape = tuple(document_ids.shape) if isinstance(document_ids, torch.Tensor) else None
        raise ValueError(f"document_ids must be a (B, S) tensor, got shape {shape}")
    if document_ids.is_floating_point() or document_ids.dtype == torch.bool:
        raise TypeError(f"document_ids must be an integer tensor, got {document_ids.dtype}")
    drops_BS = document_ids[:, 1:] < document_ids[:, :-1]
    if document_ids.device.type == "meta":
        return document_ids  # shapes only (fake backends): nothing to check
    if document_ids.device.type != "cpu":  # no host read: the device asserts
        torch._assert_async(~drops_BS.any(), "document_ids must be non-decreasing along each row")
        return document_ids
    if bool(drops_BS.any()):
        b, i = (int(x) for x in drops_BS.nonzero()[0])
        raise ValueError(
            f"document_ids must be non-decreasing along each row (a document is one run of "
            f"one id): row {b} goes from {int(document_ids[b, i])} to "
            f"{int(document_ids[b, i + 1])} at position {i + 1}"
        )
    return document_ids


def _check_shape(name: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(tensor.shape)}")
