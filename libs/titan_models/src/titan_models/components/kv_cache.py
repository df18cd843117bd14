"""Static key/value cache for incremental decoding, one row per sequence.

Rows advance independently: row ``b`` holds ``lengths[b]`` tokens, and the next forward writes
its ``S`` new tokens at slots ``lengths[b] .. lengths[b] + S - 1`` (which are also their
positions). Ragged prompts are right-padded to a common ``S`` and prefilled with
``input_lengths``; the padding is written past each row's length, stays invisible to every query
(a query sees slots up to its own) and is overwritten by the next step.

The two buffers of a layer are keys and values for grouped-query attention, and the
compressed latent and the shared rope key for multi-head latent attention (one "head" each, of
widths ``kv_lora_rank`` and ``qk_rope_head_dim``): ``value_dim`` sets the second one's width.

A linear-attention layer (hybrid models: Qwen3.5, Kimi Linear) holds a ``LayerRecurrentState``
instead: fixed-size tensors (its short convolutions' last inputs and the delta-rule state) that
the layer reads and overwrites each step, whatever the number of cached tokens.

Shapes: B batch, S new tokens, K kv heads, L cache capacity, D head dim (value dim for v).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

StateSpec = tuple[tuple[int, ...], torch.dtype | None]
"""Shape of one recurrent state tensor without the batch dimension, and its dtype (``None``:
the cache's dtype)."""


class LayerKVCache:
    """One attention layer's buffers ``(B, K, L, D)``."""

    def __init__(self, parent: KVCache, k_BKLD: torch.Tensor, v_BKLD: torch.Tensor) -> None:
        self._parent = parent
        self.k_BKLD = k_BKLD
        self.v_BKLD = v_BKLD

    def update(
        self, k_BSKD: torch.Tensor, v_BSKD: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this step's keys/values; return every visible slot's, ``(B, K, kv_len, D)``."""
        step = self._parent._step
        assert step is not None, "KVCache.begin() must run before a layer updates the cache"
        slots_BS, kv_len, _ = step
        rows_BS = torch.arange(slots_BS.shape[0], device=slots_BS.device)[:, None]
        # Advanced indices on dims 0 and 2 around a slice put (B, S) first: the value is (B,S,K,D).
        self.k_BKLD[rows_BS, :, slots_BS] = k_BSKD.to(self.k_BKLD.dtype)
        self.v_BKLD[rows_BS, :, slots_BS] = v_BSKD.to(self.v_BKLD.dtype)
        return self.k_BKLD[:, :, :kv_len], self.v_BKLD[:, :, :kv_len]


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
        return step[2]


class KVCache:
    """Per-layer key/value buffers (or recurrent states) plus the number of cached tokens of
    every row."""

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
        recurrent: Mapping[int, Sequence[StateSpec]] | None = None,
    ) -> None:
        """``layers``: the attention layers; ``value_dim``: width of their second buffer
        (``head_dim`` by default); ``recurrent``: the linear-attention layers and the specs of
        their state tensors (zero-initialised)."""
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
        shape = (batch_size, num_kv_heads, max_seq_len)
        self.max_seq_len = max_seq_len
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.layers = {
            i: LayerKVCache(
                self,
                torch.zeros((*shape, head_dim), dtype=dtype, device=device),
                torch.zeros((*shape, value_dim), dtype=dtype, device=device),
            )
            for i in layers
        }
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
        self._step: tuple[torch.Tensor, int, torch.Tensor | None] | None = None

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]

    def bytes_per_token(self) -> int:
        """Cache bytes one token occupies, summed over the attention layers (both buffers)."""
        return (
            sum(
                (layer.k_BKLD[:, :, 0].numel() + layer.v_BKLD[:, :, 0].numel())
                * layer.k_BKLD.element_size()
                for layer in self.layers.values()
                if isinstance(layer, LayerKVCache)
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

    def begin(self, seq_len: int, input_lengths: torch.Tensor | None = None) -> torch.Tensor:
        """Start a forward of ``seq_len`` new tokens per row (the first ``input_lengths[b]`` of
        them real); return their slots ``(B, S)``."""
        # One host sync per forward (not per layer) to bound the attended keys to the used part.
        kv_len = int(self.lengths.max()) + seq_len
        if kv_len > self.max_seq_len:
            raise ValueError(
                f"KVCache overflow: a row holds {kv_len - seq_len} tokens and {seq_len} more "
                f"do not fit in max_seq_len={self.max_seq_len}"
            )
        slots_BS = self.lengths[:, None] + torch.arange(seq_len, device=self.lengths.device)
        self._step = (slots_BS, kv_len, input_lengths)
        return slots_BS

    def attention_mask(self, slots_BS: torch.Tensor) -> torch.Tensor:
        """``(B, 1, S, kv_len)`` boolean mask: a query sees the slots up to its own."""
        assert self._step is not None
        kv_len = self._step[1]
        keys_L = torch.arange(kv_len, device=slots_BS.device)
        return (keys_L[None, None, :] <= slots_BS[:, :, None]).unsqueeze(1)

    def end(self, input_lengths: torch.Tensor | None) -> None:
        """Commit the step: each row grows by its ``input_lengths`` (all ``S`` by default)."""
        assert self._step is not None
        slots_BS = self._step[0]
        if input_lengths is None:
            self.lengths += slots_BS.shape[1]
        else:
            self.lengths += input_lengths.to(self.lengths)
        self._step = None

    def reset(self) -> None:
        """Forget every row's tokens (the buffers are reused, recurrent states zeroed)."""
        self.lengths.zero_()
        for layer in self.layers.values():
            if isinstance(layer, LayerRecurrentState):
                for state in layer.states:
                    state.zero_()
        self._step = None
