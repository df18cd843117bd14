"""Grouped-query attention with optional QK-norm, through the ``attend`` interface.

Shapes: B batch, S queries, L keys, D model dim, H query heads, K kv heads, E head dim.
The head counts are read off the projections at run time (``view(B, S, -1, E)``), so a
tensor-parallel plan that shards the projections by heads needs no change here.
"""

from __future__ import annotations

import torch
from torch import nn

from .attention_metadata import AttentionMetadata
from .backends import attend, prepare_attention, resolve_attention_backend
from .context_parallel import ContextParallel, shard_metadata
from .init import Constant, Init, Normal, prefixed
from .kv_cache import KVCache, LayerKVCache
from .norm import RMSNorm
from .rope import apply_rotary


class AttentionSinks(nn.Linear):
    """Learned attention sinks: one logit per query head (gpt-oss, DeepSeek-V4), an extra
    softmax term that takes probability mass and adds nothing to the output (``attend``'s
    ``sinks``).

    Stored as the ``(H, 1)`` weight of a ``1 → H`` linear and read by calling the module, so a
    tensor-parallel plan shards it by heads exactly like the query projection
    (``ColwiseParallel``): each rank gets the sinks of its local heads.
    """

    def __init__(self, num_heads: int) -> None:
        super().__init__(1, num_heads, bias=False)

    def forward(self, like: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """``(H,)`` sink logits (the local heads' under tensor parallelism), in ``like``'s
        dtype and device."""
        # A (1, 1) input, not (1,): matmul of a vector ends in an in-place squeeze, which
        # selective activation checkpointing refuses as a mutation of the saved product.
        return super().forward(like.new_ones(1, 1, dtype=self.weight.dtype)).view(-1)


class Attention(nn.Module):
    """Causal GQA: ``wq``/``wk``/``wv`` → [QK-norm] → RoPE → SDPA → ``wo``."""

    def __init__(
        self,
        *,
        dim: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        qk_norm_eps: float | None = None,
        qk_norm_offset: float = 0.0,
        softmax_scale: float | None = None,
        output_gate: bool = False,
        window: int | None = None,
        softcap: float | None = None,
        bias: bool = False,
        sinks: bool = False,
    ) -> None:
        """``qk_norm_eps``: RMSNorm q and k per head (Qwen3) with this eps; ``None`` for none.
        ``qk_norm_offset``: 1 for zero-centred QK-norm weights (Qwen3.5). ``output_gate``: ``wq``
        also yields a per-channel sigmoid gate of the attention output (Qwen3.5's gated
        attention; each head's rows are its query then its gate). ``window``: sliding window of
        this layer (``attend``); ``softcap``: logit soft cap; ``bias``: biases on the four
        projections (gpt-oss); ``sinks``: a learned sink logit per head (``AttentionSinks``,
        gpt-oss)."""
        super().__init__()
        self.head_dim = head_dim
        self.softmax_scale = softmax_scale
        self.output_gate = output_gate
        self.window = window
        self.softcap = softcap
        self.backend: str | None = None
        """This layer's attention backend instead of the run's (``None``: the run's)."""
        q_rows = num_heads * head_dim * (2 if output_gate else 1)
        self.wq = nn.Linear(dim, q_rows, bias=bias)
        self.wk = nn.Linear(dim, num_kv_heads * head_dim, bias=bias)
        self.wv = nn.Linear(dim, num_kv_heads * head_dim, bias=bias)
        self.wo = nn.Linear(num_heads * head_dim, dim, bias=bias)
        self.sinks = AttentionSinks(num_heads) if sinks else None
        norm = None if qk_norm_eps is None else {"eps": qk_norm_eps, "offset": qk_norm_offset}
        self.q_norm = RMSNorm(head_dim, **norm) if norm is not None else None
        self.k_norm = RMSNorm(head_dim, **norm) if norm is not None else None

    def forward(
        self,
        x_BSD: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        kv_cache: LayerKVCache | None = None,
    ) -> torch.Tensor:
        """``meta``: the batch's masks and positions (``build_attention_metadata``)."""
        B, S, _ = x_BSD.shape
        gate_BSHE = None
        if self.output_gate:
            q_BSHE, gate_BSHE = self.wq(x_BSD).view(B, S, -1, 2 * self.head_dim).chunk(2, dim=-1)
        else:
            q_BSHE = self.wq(x_BSD).view(B, S, -1, self.head_dim)
        k_BSKE = self.wk(x_BSD).view(B, S, -1, self.head_dim)
        v_BSKE = self.wv(x_BSD).view(B, S, -1, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:  # both or neither
            q_BSHE, k_BSKE = self.q_norm(q_BSHE), self.k_norm(k_BSKE)
        q_BSHE, k_BSKE = apply_rotary(q_BSHE, rope), apply_rotary(k_BSKE, rope)
        k_BLKE, v_BLKE = cached_keys(kv_cache, meta, k_BSKE, v_BSKE)
        o_BSHE = attend(
            q_BSHE,
            k_BLKE,
            v_BLKE,
            meta,
            window=self.window,
            sinks=self.sinks(q_BSHE) if self.sinks is not None else None,
            scale=self.softmax_scale,
            softcap=self.softcap,
            backend=self.backend,
        )
        if gate_BSHE is not None:
            o_BSHE = o_BSHE * torch.sigmoid(gate_BSHE)
        return self.wo(o_BSHE.reshape(B, S, -1))

    def param_init(self, *, std: float, out_std: float) -> dict[str, Init]:
        """Normal ``std`` for q/k/v (and the sinks), ``out_std`` for the residual output
        ``wo``; biases zero; norms to one."""
        inits: dict[str, Init] = {f"{n}.weight": Normal(std) for n in ("wq", "wk", "wv")}
        inits["wo.weight"] = Normal(out_std)
        if self.wq.bias is not None:
            inits |= {f"{n}.bias": Constant(0.0) for n in ("wq", "wk", "wv", "wo")}
        if self.sinks is not None:
            inits["sinks.weight"] = Normal(std)
        for name in ("q_norm", "k_norm"):
            if getattr(self, name) is not None:
                inits |= prefixed(name, getattr(self, name).param_init())
        return inits


def cached_keys(
    kv_cache: LayerKVCache | None,
    meta: AttentionMetadata,
    k_BSKE: torch.Tensor,
    v_BSKV: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values a layer attends to, ``(B, L, K, ·)``: its own tokens' (no cache,
    or a prefill into an empty one), else the cache's after storing this step's."""
    if kv_cache is None:
        return k_BSKE, v_BSKV
    k_BKLE, v_BKLV = kv_cache.update(k_BSKE, v_BSKV)
    if meta.cache is None or not meta.cache.reads_cache:
        return k_BSKE, v_BSKV
    return k_BKLE.transpose(1, 2), v_BKLV.transpose(1, 2)


def build_attention_metadata(
    batch_size: int,
    seq_len: int,
    device: torch.device,
    *,
    positions: torch.Tensor | None,
    document_ids: torch.Tensor | None,
    kv_cache: KVCache | None,
    input_lengths: torch.Tensor | None = None,
    backend: str = "auto",
    windows: tuple[int | None, ...] = (None,),
    context_parallel: ContextParallel | None = None,
) -> AttentionMetadata:
    """The ``AttentionMetadata`` of one forward, with the backend's structures for each of
    the model's ``windows`` built now (outside any compiled block).

    - ``kv_cache``: tokens go to the rows' next free slots (``KVCache.begin``); a query sees
      the slots of its document up to its own; positions continue each row's document.
    - ``document_ids``: causal within a document, nothing across (packed sequences);
      positions restart at 0 in every document unless given.
    - neither: plain causal attention over ``0 .. S-1``.
    - ``context_parallel``: the rows are this rank's shard of longer sequences (positions
      and document ids are the shard's too); the ``context_parallel`` backend attends.
    """
    if context_parallel is not None:
        if backend not in ("auto", "context_parallel"):
            raise ValueError(
                f"attention_backend={backend!r} cannot attend across context-parallel shards; "
                "use 'auto' or 'context_parallel'"
            )
        if kv_cache is not None:
            raise ValueError("a KV cache under context parallelism is not supported")
        meta = shard_metadata(
            context_parallel,
            batch_size,
            seq_len,
            device,
            positions=positions,
            document_ids=document_ids,
        )
        prepare_attention(meta, windows)
        return meta
    name = resolve_attention_backend(backend, device)
    if kv_cache is not None:
        if kv_cache.batch_size != batch_size:
            raise ValueError(
                f"kv_cache has batch_size={kv_cache.batch_size}, the input has {batch_size}"
            )
        step = kv_cache.begin(seq_len, input_lengths=input_lengths, document_ids=document_ids)
        meta = AttentionMetadata.for_cache_step(step, positions=positions, backend=name)
    elif document_ids is not None:
        if tuple(document_ids.shape) != (batch_size, seq_len):
            raise ValueError(
                f"document_ids must have shape {(batch_size, seq_len)}, "
                f"got {tuple(document_ids.shape)}"
            )
        meta = AttentionMetadata.from_document_ids(document_ids, positions=positions, backend=name)
    else:
        meta = AttentionMetadata.causal(
            batch_size, seq_len, device, positions=positions, backend=name
        )
    prepare_attention(meta, windows)
    return meta
