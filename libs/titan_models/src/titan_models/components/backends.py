"""One attention interface, ``attend``, over interchangeable backends.

Every backend takes the same inputs — queries, keys and values in ``(B, S, heads, dim)``
layout, the batch's ``AttentionMetadata`` (documents, positions, KV-cache step) and the
layer's mask options (sliding ``window``, per-head ``sinks``, ``scale``, logit ``softcap``) —
and returns the same values within fp32 rounding:

A bidirectional ``AttentionMetadata`` (an encoder's: vision towers, images as documents)
drops the causal rule in every backend: a query sees its whole document.

- ``sdpa``: the dense reference: one boolean ``(B, 1, S, L)`` mask per batch and window and
  ``F.scaled_dot_product_attention`` (explicit scores with sinks or softcap). O(S²) memory
  with documents or windows: for tests and short sequences.
- ``flex``: FlexAttention over a ``BlockMask`` built once per batch and window (fused and
  block-sparse when compiled; the CUDA training default). torch has no FlexAttention
  backward on CPU: asking for one there is an error naming the backends that work.
- ``varlen``: packed documents with no ``S × S`` tensor (``titan_models.components.varlen``):
  torch's varlen flash attention where the device has it, otherwise SDPA over document and
  window tiles. The default off CUDA.
- ``context_parallel``: each rank holds a shard of every sequence and attends to all of it,
  keys and values passed round a ring or all-gathered
  (``titan_models.components.context_parallel``). The only backend for a shard, chosen by
  ``"auto"`` when the model has a ``context_parallel``.

A KV-cache step that reads cached keys (decoding, a chunk of a chunked prefill) runs the
dense path over the ``S × L`` keys it reads in every backend; the first step into an empty
cache (a prefill) attends to its own tokens through the run's backend, like training.

A new backend (a vendor kernel) is one ``register_attention_backend`` call;
``attention_backends()`` lists what is registered, ``"auto"`` picks flex on CUDA and varlen
elsewhere (``context_parallel`` on a shard).

Shapes: B batch, S queries, L keys, H query heads, K kv heads, E q/k head dim, V value dim.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from . import context_parallel, flex, varlen
from .attention_metadata import AttentionMetadata
from .dense_attention import dense_attention


class BackendForward(Protocol):
    """``forward(q_BSHE, k_BLKE, v_BLKV, meta, prepared, *, window, sinks, scale, softcap)``
    → ``o_BSHV``; ``prepared`` is the backend's ``prepare(meta, window)`` result."""

    def __call__(
        self,
        q_BSHE: torch.Tensor,
        k_BLKE: torch.Tensor,
        v_BLKV: torch.Tensor,
        meta: AttentionMetadata,
        prepared: Any,
        /,
        *,
        window: int | None,
        sinks: torch.Tensor | None,
        scale: float,
        softcap: float | None,
    ) -> torch.Tensor: ...


@dataclass(frozen=True, slots=True)
class AttentionBackend:
    """A registered backend: its per-batch preparation and its forward."""

    name: str
    """Registry key (``TransformerConfig.attention_backend``)."""
    forward: BackendForward
    """The attention itself (see ``BackendForward``)."""
    prepare: Callable[[AttentionMetadata, int | None], Any]
    """Per-batch structure for one window (mask, BlockMask, tile plan), built once per batch
    and window and memoised on the metadata; ``lambda meta, window: None`` for none."""


_BACKENDS: dict[str, AttentionBackend] = {}


def register_attention_backend(
    name: str,
    forward: BackendForward,
    *,
    prepare: Callable[[AttentionMetadata, int | None], Any] | None = None,
) -> None:
    """Add a backend under ``name`` (a later registration of the same name replaces it)."""
    if not isinstance(name, str) or not name or name == "auto":
        raise ValueError(
            f"attention backend name must be a non-empty string other than 'auto', got {name!r}"
        )
    _BACKENDS[name] = AttentionBackend(
        name=name, forward=forward, prepare=prepare or (lambda meta, window: None)
    )


def attention_backends() -> list[str]:
    """Registered backend names (plus ``"auto"``, accepted wherever a name is)."""
    return sorted(_BACKENDS)


def resolve_attention_backend(name: str, device: torch.device | str) -> str:
    """``name`` checked against the registry; ``"auto"`` → flex on CUDA, varlen elsewhere."""
    if name == "auto":
        return "flex" if torch.device(device).type == "cuda" else "varlen"
    check_attention_backend(name)
    return name


def check_attention_backend(name: object, field: str = "attention_backend") -> None:
    """``ValueError`` naming ``field`` unless ``name`` is ``"auto"`` or registered."""
    if name != "auto" and name not in _BACKENDS:
        raise ValueError(
            f"{field}={name!r} is not a registered attention backend; known: "
            f"{['auto', *attention_backends()]}"
        )


def prepare_attention(meta: AttentionMetadata, windows: tuple[int | None, ...]) -> None:
    """Build the batch's mask structures for these windows now (each once, memoised), so
    that blocks compiled with ``torch.compile`` only read them."""
    impl = _BACKENDS[meta.backend]
    for window in windows:
        if meta.cache is not None and meta.cache.reads_cache:
            meta.prepared(("cache", window), lambda w=window: meta.dense_mask(w))
        else:
            meta.prepared((meta.backend, window), lambda w=window: impl.prepare(meta, w))


def attend(
    q_BSHE: torch.Tensor,
    k_BLKE: torch.Tensor,
    v_BLKV: torch.Tensor,
    meta: AttentionMetadata,
    *,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Attention output ``(B, S, H, V)`` under the batch's masks and this layer's options.

    Args:
        q_BSHE, k_BLKE, v_BLKV: queries, keys, values; ``H`` a multiple of ``K`` (GQA). Without a
            cache (or into an empty one) keys are the queries' own tokens (``L = S``); in a step
            that reads a cache, the keys ``kv_cache.update`` returned.
        meta: the batch's ``AttentionMetadata``.
        window: sliding window W >= 1: a query sees itself and the W - 1 tokens before it
            (within its document); ``None`` for full causal attention.
        sinks: ``(H,)`` learned per-head logits (gpt-oss): one extra softmax term per head
            that takes probability mass and adds nothing to the output; differentiable.
        scale: score scale, ``1/√E`` by default.
        softcap: logits become ``softcap · tanh(logits / softcap)`` before masking (Gemma 2).
        backend: this layer's backend, instead of the batch's ``meta.backend``.
    """
    H = q_BSHE.shape[2]
    _check_options(window, sinks, softcap, H)
    if meta.bidirectional and (window is not None or meta.cache is not None):
        raise ValueError(
            "bidirectional attention (an encoder's AttentionMetadata) takes no sliding window "
            f"and no KV cache; got window={window!r}, cache={meta.cache is not None}"
        )
    scale = q_BSHE.shape[-1] ** -0.5 if scale is None else scale
    if meta.cache is not None and meta.cache.reads_cache:
        mask = meta.prepared(("cache", window), lambda: meta.dense_mask(window))
        return dense_attention(
            q_BSHE, k_BLKE, v_BLKV, mask, sinks=sinks, scale=scale, softcap=softcap
        )
    name = backend or meta.backend
    impl = _BACKENDS.get(name)
    if impl is None:
        check_attention_backend(name, "backend")
        raise ValueError(f"attention backend {name!r} must be resolved before attending")
    if meta.context_parallel is not None and name != "context_parallel":
        raise ValueError(
            f"attention backend {name!r} cannot attend across context-parallel shards (this "
            "layer's backend); use 'context_parallel' (or leave the layer's backend unset)"
        )
    prepared = meta.prepared((name, window), lambda: impl.prepare(meta, window))
    return impl.forward(
        q_BSHE,
        k_BLKE,
        v_BLKV,
        meta,
        prepared,
        window=window,
        sinks=sinks,
        scale=scale,
        softcap=softcap,
    )


def _check_options(
    window: int | None, sinks: torch.Tensor | None, softcap: float | None, heads: int
) -> None:
    if window is not None and (
        not isinstance(window, int) or isinstance(window, bool) or window < 1
    ):
        raise ValueError(
            f"attention window={window!r} must be an int >= 1 (a query sees itself and the "
            "window - 1 tokens before it) or None for full causal attention"
        )
    if softcap is not None and not softcap > 0:
        raise ValueError(f"attention softcap={softcap!r} must be > 0 or None")
    if sinks is not None and tuple(sinks.shape) != (heads,):
        raise ValueError(
            f"attention sinks must have shape ({heads},) (one per query head), got {tuple(sinks.shape)}"
        )


def _sdpa_prepare(meta: AttentionMetadata, window: int | None) -> torch.Tensor | None:
    if meta.starts is None and (window is None or window >= meta.seq_len):
        return None  # plain causal: no mask tensor at all
    return meta.dense_mask(window)


def _sdpa_forward(q, k, v, meta, mask, *, window, sinks, scale, softcap):
    return dense_attention(
        q, k, v, mask, sinks=sinks, scale=scale, softcap=softcap, causal=not meta.bidirectional
    )


def _register_builtin() -> None:
    register_attention_backend("sdpa", _sdpa_forward, prepare=_sdpa_prepare)
    register_attention_backend("flex", flex.forward, prepare=flex.prepare)
    register_attention_backend("varlen", varlen.forward, prepare=varlen.prepare)
    register_attention_backend(
        "context_parallel", context_parallel.forward, prepare=context_parallel.prepare
    )


_register_builtin()

__all__ = [
    "AttentionBackend",
    "attend",
    "attention_backends",
    "check_attention_backend",
    "prepare_attention",
    "register_attention_backend",
    "resolve_attention_backend",
]
