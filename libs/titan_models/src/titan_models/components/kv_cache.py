"""Static key/value cache for incremental decoding, one row per sequence.

Rows advance independently: row ``b`` holds ``lengths[b]`` tokens, and the next forward writes
its ``S`` new tokens at slots ``lengths[b] .. lengths[b] + S - 1``. Ragged prompts are
right-padded to a common ``S`` and prefilled with ``input_lengths``; the padding is written past
each row's length, stays invisible to every query (a query sees slots up to its own) and is
overwritten by the next step.

A prefill may pack several documents into a row (``document_ids``): attention stays inside
each, positions restart in each, and later steps continue the row's last document.

A sliding-window layer (window W) keeps a *ring* of the last W - 1 tokens instead of a full
buffer (eviction): a step attends to the ring followed by its own new tokens, then writes the
newest real tokens over the oldest ones. ``AttentionMetadata.key_slots`` says which slot
each attended key is.

The two buffers of a layer are keys and values for grouped-query attention, and the
compressed latent and the shared rope key for multi-head latent attention (one "head" each, of
widths ``kv_lora_rank`` and ``qk_rope_head_dim``): ``value_dim`` sets the second one's width.

A linear-attention layer (hybrid models: Qwen3.5, Kimi Linear) holds a ``LayerRecurrentState``
instead: fixed-size tensors (its short convolutions' last inputs and the delta-rule state) that
the layer reads and overwrites each step, whatever the number of cached tokens.

Shapes: B batch, S new tokens, K kv heads, L cache capacity (ring size + 1 for a ring), D head
dim (value dim for v), R ring size.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from .attention_metadata import CacheStep

StateSpec = tuple[tuple[int, ...], torch.dtype | None]
"""Shape of one recurrent state tensor without the batch dimension, and its dtype (``None``:
the cache's dtype)."""


class LayerKVCache:
    """One attention layer's buffers ``(B, K, L, D)``: a full buffer, or a ring of ``ring``
    slots plus one scratch slot that takes the writes a step must not keep."""

    def __init__(
        self,
        parent: KVCache,
        k_BKLD: torch.Tensor,
        v_BKLD: torch.Tensor,
        ring: int | None = None,
    ) -> None:
        self._parent = parent
        self.k_BKLD = k_BKLD
        self.v_BKLD = v_BKLD
        self.ring = ring

    def update(
        self, k_BSKD: torch.Tensor, v_BSKD: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this step's keys/values; return every key this step attends to,
        ``(B, K, L, D)``: the used part of a full buffer, or the ring then the new tokens."""
        step = self._parent._step
        assert step is not None, "KVCache.begin() must run before a layer updates the cache"
        rows_BS = torch.arange(step.slots.shape[0], device=step.slots.device)[:, None]
        if self.ring is None:
            # Advanced indices on dims 0 and 2 around a slice put (B, S) first: values (B,S,K,D).
            self.k_BKLD[rows_BS, :, step.slots] = k_BSKD.to(self.k_BKLD.dtype)
            self.v_BKLD[rows_BS, :, step.slots] = v_BSKD.to(self.v_BKLD.dtype)
            return self.k_BKLD[:, :, : step.kv_len], self.v_BKLD[:, :, : step.kv_len]
        R = self.ring
        k_BKLD = torch.cat([self.k_BKLD[:, :, :R], k_BSKD.transpose(1, 2).to(self.k_BKLD)], 2)
        v_BKLD = torch.cat([self.v_BKLD[:, :, :R], v_BSKD.transpose(1, 2).to(self.v_BKLD)], 2)
        # Keep the last R real tokens of each row; padding and older tokens go to scratch
        # slot R (read by no one), so a ring never loses a token it still needs.
        new_B1 = step.input_lengths[:, None] if step.input_lengths is not None else None
        t_S = torch.arange(step.slots.shape[1], device=step.slots.device)
        n_BS = new_B1 if new_B1 is not None else step.slots.shape[1]
        keep_BS = (t_S < n_BS) & (t_S >= n_BS - R)
        index_BS = torch.where(keep_BS, step.slots % R, R)
        self.k_BKLD[rows_BS, :, index_BS] = k_BSKD.to(self.k_BKLD.dtype)
        self.v_BKLD[rows_BS, :, index_BS] = v_BSKD.to(self.v_BKLD.dtype)
        return k_BKLD, v_BKLD


class LayerRecurrentState:
    """One linear-attention layer's fixed-size decode state: ``states[i]`` of shape ``(B, ...)``
    as the layer declared them (``recurrent_state_specs``). The layer reads them, computes the
    state after this step's tokens and writes it back with ``copy_``."""

    def __init__(self, parent: KVCache, states: list[torch.Tensor]) -> None:
        self._parent = parent
        self.states = states

    def step_lengths(self) -> torch.Tensor | None:
        """How many of this step's ``S`` tokens each row really has (``input_lengths``), or
        ``None`` when all of them: tokens past a row's length must leave its state unchanged."""
        step = self._parent._step
        assert step is not None, "KVCache.begin() must run before a layer reads its state"
        return step.input_lengths


class KVCache:
    """Per-layer key/value buffers (or recurrent states), the number of cached tokens of every
    row, and each row's current document (for packed prefills).

    ``static=True``: every step attends to the whole capacity of the full buffers (the unused
    slots masked) and ``begin`` reads nothing back to the host, so every decode step has the
    same shapes and control flow: one ``torch.compile`` graph (or CUDA graph) serves them all.
    Overflow is then a device-side assert instead of a ``ValueError``."""

    def __init__(
        self,
        *,
        layers: list[int],
        batch_size: int,
        max_seq_len: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        value_dim: int | None = None,
        windows: Mapping[int, int | None] | None = None,
        recurrent: Mapping[int, Sequence[StateSpec]] | None = None,
        static: bool = False,
    ) -> None:
        """``layers``: the attention layers; ``value_dim``: width of their second buffer
        (``head_dim`` by default); ``windows``: layer → sliding window (a layer whose window
        W - 1 < ``max_seq_len`` keeps a ring of W - 1 tokens); ``recurrent``: the
        linear-attention layers and the specs of their state tensors (zero-initialised);
        ``static``: see the class docstring."""
        value_dim = head_dim if value_dim is None else value_dim
        for name, value in (
            ("batch_size", batch_size),
            ("max_seq_len", max_seq_len),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
            ("value_dim", value_dim),
        ):
            if value < 1:
                raise ValueError(f"KVCache {name} must be >= 1, got {value}")
        self.max_seq_len = max_seq_len
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)
        self._doc_id = torch.zeros(batch_size, dtype=torch.long, device=device)
        self._doc_start = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.ring_sizes: dict[int, int] = {}
        self.layers: dict[int, LayerKVCache | LayerRecurrentState] = {}
        for i in layers:
            window = (windows or {}).get(i)
            ring = window - 1 if window is not None and window - 1 < max_seq_len else None
            if ring is not None:
                assert window is not None  # a ring only for a window
                self.ring_sizes[window] = ring
            shape = (batch_size, num_kv_heads, max_seq_len if ring is None else ring + 1)
            self.layers[i] = LayerKVCache(
                self,
                torch.zeros((*shape, head_dim), dtype=dtype, device=device),
                torch.zeros((*shape, value_dim), dtype=dtype, device=device),
                ring,
            )
        for i, specs in (recurrent or {}).items():
            if i in self.layers:
                raise ValueError(f"KVCache layer {i} is both an attention and a recurrent layer")
            self.layers[i] = LayerRecurrentState(
                self,
                [
                    torch.zeros((batch_size, *shape), dtype=dt or dtype, device=device)
                    for shape, dt in specs
                ],
            )
        self.static = static
        self._filled = False  # a step was committed (static mode's "reads the cache")
        self._packed = False  # a prefill packed documents: track each row's current one
        self._step: CacheStep | None = None
        self._step_docs: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]

    def bytes_per_token(self) -> int:
        """Cache bytes one more token occupies, summed over the attention layers with full
        buffers (both buffers; a ring's size does not grow with the sequence)."""
        return (
            sum(
                (layer.k_BKLD[:, :, 0].numel() + layer.v_BKLD[:, :, 0].numel())
                * layer.k_BKLD.element_size()
                for layer in self.layers.values()
                if isinstance(layer, LayerKVCache) and layer.ring is None
            )
            // self.batch_size
        )

    def state_bytes_per_row(self) -> int:
        """Bytes of the fixed-size recurrent states of one row, summed over layers."""
        return (
            sum(
                t.numel() * t.element_size()
                for layer in self.layers.values()
                if isinstance(layer, LayerRecurrentState)
                for t in layer.states
            )
            // self.batch_size
        )

    def begin(
        self,
        seq_len: int,
        *,
        input_lengths: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> CacheStep:
        """Start a forward of ``seq_len`` new tokens per row (``input_lengths`` of them real;
        ``document_ids`` ``(B, S)`` for a packed prefill, non-decreasing, the first one >= the
        row's current document). One host sync, to bound the attended keys (none when
        ``static``)."""
        full = any(isinstance(c, LayerKVCache) and c.ring is None for c in self.layers.values())
        if self.static:
            kv_len, reads_cache = self.max_seq_len, self._filled
            if full:
                torch._assert_async(
                    self.lengths.max() + seq_len <= self.max_seq_len,
                    f"KVCache overflow: {seq_len} more tokens do not fit in "
                    f"max_seq_len={self.max_seq_len}",
                )
        else:
            kv_len = int(self.lengths.max()) + seq_len
            reads_cache = kv_len > seq_len
            if kv_len > self.max_seq_len and full:
                raise ValueError(
                    f"KVCache overflow: a row holds {kv_len - seq_len} tokens and {seq_len} "
                    f"more do not fit in max_seq_len={self.max_seq_len}"
                )
        B = self.batch_size
        device = self.lengths.device
        slots_BS = self.lengths[:, None] + torch.arange(seq_len, device=device)
        if document_ids is None and not self._packed:  # one document per row, from slot 0
            self._step = CacheStep(
                slots=slots_BS,
                lengths=self.lengths.clone(),
                kv_len=min(kv_len, self.max_seq_len),
                reads_cache=reads_cache,
                ring_sizes=self.ring_sizes,
                input_lengths=input_lengths,
            )
            return self._step
        self._packed = True
        if document_ids is None:
            docs_BS = self._doc_id[:, None].expand(B, seq_len)
        else:
            if tuple(document_ids.shape) != (B, seq_len):
                raise ValueError(
                    f"document_ids must have shape {(B, seq_len)}, got {tuple(document_ids.shape)}"
                )
            docs_BS = document_ids.to(device=device, dtype=torch.long)
        previous_BS = torch.cat([self._doc_id[:, None], docs_BS[:, :-1]], dim=1)
        if document_ids is not None and bool((docs_BS < previous_BS).any()):
            raise ValueError(
                "document_ids must be non-decreasing along each row, starting at or after the "
                "row's current document in the cache (a document is one run of one id)"
            )
        opened_BS = torch.where(docs_BS != previous_BS, slots_BS, -1).cummax(dim=1).values
        starts_BS = torch.where(opened_BS >= 0, opened_BS, self._doc_start[:, None])
        self._step = CacheStep(
            slots=slots_BS,
            lengths=self.lengths.clone(),
            kv_len=min(kv_len, self.max_seq_len),
            reads_cache=reads_cache,
            ring_sizes=self.ring_sizes,
            input_lengths=input_lengths,
            starts=starts_BS,
        )
        self._step_docs = docs_BS
        return self._step

    def end(self, input_lengths: torch.Tensor | None = None) -> None:
        """Commit the step: each row grows by its ``input_lengths`` (all ``S`` by default) and
        continues the document of its last real token."""
        step = self._step
        assert step is not None
        S = step.slots.shape[1]
        n_B = (
            torch.full_like(self.lengths, S)
            if input_lengths is None
            else input_lengths.to(self.lengths)
        )
        if step.starts is not None:
            assert self._step_docs is not None  # set with the step's document starts
            last_B1 = (n_B - 1)[:, None]
            self._doc_id = self._step_docs.gather(1, last_B1)[:, 0].clone()
            self._doc_start = step.starts.gather(1, last_B1)[:, 0].clone()
        self.lengths += n_B
        self._filled = True
        self._step = self._step_docs = None

    def reset(self) -> None:
        """Forget every row's tokens (the buffers are reused, recurrent states zeroed)."""
        self.lengths.zero_()
        self._doc_id.zero_()
        self._doc_start.zero_()
        self._packed = False
        self._filled = False
        self._step = self._step_docs = None
        for layer in self.layers.values():
            if isinstance(layer, LayerRecurrentState):
                for state in layer.states:
                    state.zero_()
