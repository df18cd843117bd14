"""The decoder-only language model every family builds on: embedding → blocks → norm → head.

A family supplies its config (a ``TransformerConfig`` subclass with its flavours) and the
blocks; everything else — the forward pass, the per-batch attention metadata (packed
documents, positions, the KV cache step), meta-device construction and the initialisation
scheme — lives here once.

Shapes: B batch, S sequence, D model dim, V vocabulary.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, cast

import torch
from torch import nn

from .attention import Attention, build_attention_metadata
from .attention_metadata import AttentionMetadata
from .backends import check_attention_backend
from .context_parallel import ContextParallel
from .feedforward import FeedForward
from .init import Constant, Init, Normal, init_state, prefixed
from .kv_cache import KVCache, LayerKVCache, LayerRecurrentState
from .norm import RMSNorm
from .rope import RopeConfig, RopeTables, RotaryEmbedding


@dataclass(kw_only=True, slots=True)
class TransformerConfig:
    """Hyper-parameters shared by the dense decoder families."""

    vocab_size: int
    """Rows of the token embedding and of the output head."""
    dim: int
    """Width of the residual stream (HF ``hidden_size``)."""
    num_layers: int
    """Number of transformer blocks."""
    num_heads: int
    """Query heads per attention layer."""
    num_kv_heads: int
    """Key/value heads per attention layer (grouped-query attention when < ``num_heads``)."""
    head_dim: int
    """Width of one attention head (need not equal ``dim // num_heads``)."""
    ffn_hidden_dim: int
    """Hidden width of the SwiGLU feed-forward (HF ``intermediate_size``)."""
    rope: RopeConfig
    """Rotary embedding frequencies."""
    max_seq_len: int
    """Longest context the model is meant for (HF ``max_position_embeddings``)."""
    norm_eps: float = 1e-5
    """Epsilon of every RMSNorm."""
    tie_embeddings: bool = False
    """Share the output head's weight with the token embedding."""
    init_std: float = 0.02
    """Standard deviation of the weight initialisation (see ``Transformer.init_weights``)."""
    sliding_window: int | None = None
    """Window W of the sliding-window layers: a query sees itself and the W - 1 tokens before
    it (inside its document); ``None``: every layer attends to the whole causal prefix."""
    sliding_window_layers: tuple[int, ...] | None = None
    """Indices of the layers that use ``sliding_window`` (``None``: all of them, Mistral)."""
    attention_backend: str = "auto"
    """Attention backend of a forward (``titan_models.attention_backends()``): ``sdpa``
    (dense reference), ``flex``, ``varlen``; ``auto`` = flex on CUDA, varlen elsewhere."""

    def __post_init__(self) -> None:
        positive = ("vocab_size", "dim", "num_layers", "num_heads", "num_kv_heads", "head_dim")
        for name in (*positive, "ffn_hidden_dim", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{type(self).__name__}.{name} must be an int >= 1, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"{type(self).__name__}.num_heads={self.num_heads} must be a multiple of "
                f"num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"{type(self).__name__}.head_dim must be even, got {self.head_dim}")
        if not isinstance(self.rope, RopeConfig):
            raise ValueError(
                f"{type(self).__name__}.rope must be a RopeConfig, got {type(self.rope).__name__}"
            )
        for name in ("norm_eps", "init_std"):
            if not getattr(self, name) > 0:
                raise ValueError(
                    f"{type(self).__name__}.{name} must be > 0, got {getattr(self, name)!r}"
                )
        _check_windows(self)
        check_attention_backend(self.attention_backend, f"{type(self).__name__}.attention_backend")

    @classmethod
    def field_names(cls) -> list[str]:
        """The names ``dataclasses.replace`` accepts."""
        return [f.name for f in fields(cls)]

    def layer_window(self, index: int) -> int | None:
        """Sliding window of layer ``index`` (``None``: full causal attention)."""
        if self.sliding_window is None:
            return None
        if self.sliding_window_layers is None or index in self.sliding_window_layers:
            return self.sliding_window
        return None

    def attention_windows(self) -> tuple[int | None, ...]:
        """The distinct windows of the layers (``None`` = full attention)."""
        return tuple(dict.fromkeys(self.layer_window(i) for i in range(self.num_layers)))

    @property
    def rotary_dim(self) -> int:
        """Width of the rotated part of a query/key head (all of it here)."""
        return self.head_dim

    @property
    def norm_offset(self) -> float:
        """Added to every block/final RMSNorm weight to form its scale (1: zero-centred)."""
        return 0.0

    def matmul_params(self) -> int:
        """Weights that take part in a matmul per token (see ``titan_models.matmul_params``)."""
        attention = self.dim * (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        attention += self.num_heads * self.head_dim * self.dim
        return self.num_layers * (attention + 3 * self.dim * self.ffn_hidden_dim) + (
            self.dim * self.vocab_size
        )

    def attention_flops(self, seq_len: int) -> int:
        """Forward + backward FLOPs of ``q·kᵀ`` and ``p·v`` per token (no causal discount)."""
        return 12 * self.num_layers * self.num_heads * self.head_dim * seq_len


class TransformerBlock(nn.Module):
    """Pre-norm residual block: ``h = x + attn(norm(x)); out = h + ffn(norm(h))``."""

    def __init__(
        self,
        *,
        dim: int,
        norm_eps: float,
        attention: nn.Module,
        feed_forward: nn.Module,
        norm_offset: float = 0.0,
    ) -> None:
        """``attention``: the token mixer (softmax attention, or a recurrent mixer such as
        ``GatedDeltaNet`` that reads the documents off the metadata)."""
        super().__init__()
        self.attention_norm = RMSNorm(dim, eps=norm_eps, offset=norm_offset)
        self.attention = attention
        self.ffn_norm = RMSNorm(dim, eps=norm_eps, offset=norm_offset)
        self.feed_forward = feed_forward

    def forward(
        self,
        x_BSD: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        kv_cache: LayerKVCache | LayerRecurrentState | None = None,
    ) -> torch.Tensor:
        h_BSD = x_BSD + self.attention(self.attention_norm(x_BSD), rope, meta, kv_cache)
        return h_BSD + self.feed_forward(self.ffn_norm(h_BSD))

    def param_init(self, *, std: float, out_std: float) -> dict[str, Init]:
        inits: dict[str, Init] = {}
        for name in ("attention_norm", "ffn_norm", "attention", "feed_forward"):
            inits |= prefixed(name, getattr(self, name).param_init(std=std, out_std=out_std))
        return inits


def gqa_attention(config: TransformerConfig, *, qk_norm: bool, layer: int = 0) -> Attention:
    """The GQA attention of the Llama 3 / Qwen3 blocks (with per-head QK-norm for Qwen3) for
    layer index ``layer`` (its sliding window)."""
    return Attention(
        dim=config.dim,
        num_heads=config.num_heads,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        qk_norm_eps=config.norm_eps if qk_norm else None,
        window=config.layer_window(layer),
    )


def dense_blocks(config: TransformerConfig, *, qk_norm: bool) -> list[TransformerBlock]:
    """``num_layers`` blocks of GQA attention + SwiGLU (Llama 3; with ``qk_norm``, Qwen3)."""
    return [
        TransformerBlock(
            dim=config.dim,
            norm_eps=config.norm_eps,
            attention=gqa_attention(config, qk_norm=qk_norm, layer=i),
            feed_forward=FeedForward(dim=config.dim, hidden_dim=config.ffn_hidden_dim),
        )
        for i in range(config.num_layers)
    ]


class Transformer(nn.Module):
    """Decoder-only causal LM. Build it on the meta device and call ``init_weights(device=...)``.

    Module names follow torchtitan (``tok_embeddings``, ``layers.<i>``, ``norm``, ``output``);
    ``layers`` is a ``ModuleDict`` keyed by the layer index so a pipeline stage that drops
    blocks (or the embedding / head, set to ``None``) keeps every FQN unchanged.
    """

    def __init__(
        self,
        config: TransformerConfig,
        blocks: Sequence[nn.Module],
        extra_modules: Mapping[str, nn.Module | None] | None = None,
    ) -> None:
        """``extra_modules``: a family's modules beside the stack (DeepSeek-V3's ``mtp``),
        registered after ``output`` and initialised as the family's ``_extra_param_inits``
        says."""
        super().__init__()
        if len(blocks) != config.num_layers:
            raise ValueError(f"got {len(blocks)} blocks for num_layers={config.num_layers}")
        self.config = config
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleDict({str(i): block for i, block in enumerate(blocks)})
        self.norm: RMSNorm | None = RMSNorm(
            config.dim, eps=config.norm_eps, offset=config.norm_offset
        )
        self.output: nn.Linear | None = nn.Linear(config.dim, config.vocab_size, bias=False)
        for name, module in (extra_modules or {}).items():
            self.add_module(name, module)
        self.rope: RopeTables = RotaryEmbedding(config.rope, config.rotary_dim)
        self.context_parallel: ContextParallel | None = None
        """Set (by a parallelize step) when each call sees this rank's shard of longer
        sequences: tokens, positions and document ids all ``context_parallel.shard(...)``."""
        self._tie()
        if not self.tok_embeddings.weight.is_meta:
            self.init_weights()

    def forward(
        self,
        tokens: torch.Tensor,
        *,
        positions: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        input_lengths: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits ``(B, S, V)`` for token ids ``(B, S)``.

        Args:
            tokens: token ids; hidden states ``(B, S, D)`` on a pipeline stage without the
                embedding. Such a stage returns hidden states when it has no head.
            positions: RoPE positions ``(B, S)``; by default ``0..S-1``, the position inside
                the document with ``document_ids``, or the cache slot with ``kv_cache``.
            document_ids: ``(B, S)`` ids of packed documents; attention stays inside one.
            kv_cache: decode incrementally: attend to the cached tokens and append these.
            input_lengths: with ``kv_cache``, how many of the ``S`` tokens of each row are real
                (right-padded ragged prompts); the rest is written but never attended to.
        """
        h_BSD, _ = self.run_blocks(
            tokens,
            positions=positions,
            document_ids=document_ids,
            kv_cache=kv_cache,
            input_lengths=input_lengths,
        )
        return self.head(h_BSD)

    def run_blocks(
        self,
        tokens: torch.Tensor,
        *,
        positions: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        input_lengths: torch.Tensor | None = None,
        embeddings: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, tuple[tuple[torch.Tensor, torch.Tensor], AttentionMetadata]]:
        """Embedding and blocks: the residual stream ``(B, S, D)`` before the final norm, and
        the ``(rope, attention metadata)`` the blocks used (a family's extra heads reuse them).
        ``embeddings``: the ``(B, S, D)`` input of the blocks when a family made it itself
        (image features at their placeholders); ``tokens`` still give the shape."""
        B, S = tokens.shape[:2]
        check_shape("positions", positions, (B, S))
        if input_lengths is not None:
            check_input_lengths(input_lengths, B, S, kv_cache)
        meta = build_attention_metadata(
            B,
            S,
            tokens.device,
            positions=positions,
            document_ids=document_ids,
            kv_cache=kv_cache,
            input_lengths=input_lengths,
            backend=self.config.attention_backend,
            windows=self.config.attention_windows(),
            context_parallel=self.context_parallel,
        )

        if embeddings is not None:
            h_BSD = embeddings
        else:
            h_BSD = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        rope = self.rope(meta.positions, h_BSD.dtype)
        for index, layer in self.layers.items():
            layer_cache = kv_cache.layers[int(index)] if kv_cache is not None else None
            h_BSD = layer(h_BSD, rope, meta, layer_cache)
        if kv_cache is not None:
            kv_cache.end(input_lengths)
        return h_BSD, (rope, meta)

    def head(self, h_BSD: torch.Tensor) -> torch.Tensor:
        """Final norm and output head (each skipped on a pipeline stage that lacks it)."""
        h_BSD = self.norm(h_BSD) if self.norm is not None else h_BSD
        return self.output(h_BSD) if self.output is not None else h_BSD

    @torch.no_grad()
    def init_weights(
        self,
        device: torch.device | str | None = None,
        *,
        dtype: torch.dtype | None = None,
        seed: int = 0,
    ) -> Transformer:
        """Materialise (if on meta) and initialise every weight; returns ``self``.

        The values are those ``param_inits`` describes, drawn by ``init_state`` as a function
        of (seed, FQN, index): a sharded copy of this model initialised with ``init_state``
        holds, bit for bit, the same weights on the same device type.
        """
        if dtype is not None:
            self.to(dtype=dtype)  # before materialising: a cast on meta allocates nothing
        if device is not None or any(p.is_meta for p in self.parameters()):
            self.to_empty(device=device if device is not None else "cpu")
            self._tie()
        state = dict(self.named_parameters()) | dict(self.named_buffers())  # unsaved buffers too
        init_state(state, self.param_inits(), seed=seed)
        return self

    def param_inits(self) -> dict[str, Init]:
        """How every parameter and buffer of this model (or pipeline stage) starts, by FQN.

        Scheme (GPT-2 / Megatron "scaled init"): with ``std = config.init_std``, the token
        embedding, the output head and every projection into a residual branch (q, k, v, w1,
        w3; MLA's latent projections; a router gate and the experts' gate/up) are drawn from
        N(0, std²); the projections out of a residual branch (``wo``, ``w2``, the experts'
        down projections) from N(0, (std / √(2·num_layers))²), so the residual stream's
        variance stays flat in depth; every RMSNorm weight is 1; buffers (a router's selection
        bias) start at 0, except those a module's ``buffer_inits()`` names (a hash-routing
        table); parameters added to a module from outside (LoRA adapters) start as its
        ``adapter_inits()`` says.
        """
        std = self.config.init_std
        out_std = std / math.sqrt(2 * self.config.num_layers)
        inits: dict[str, Init] = {}
        if self.tok_embeddings is not None:
            inits["tok_embeddings.weight"] = Normal(std)
        for index, layer in self.layers.items():
            block: Any = layer  # a family's block: param_init(std=, out_std=)
            inits |= prefixed(f"layers.{index}", block.param_init(std=std, out_std=out_std))
        if self.norm is not None:
            inits |= prefixed("norm", self.norm.param_init())
        if self.output is not None and not self.config.tie_embeddings:
            inits["output.weight"] = Normal(std)
        inits |= self._extra_param_inits(std=std, out_std=out_std)
        inits |= {name: Constant(0.0) for name, _ in self.named_buffers()}
        for prefix, module in self.named_modules():  # buffers that start elsewhere (hash tables)
            duck: Any = module  # the hooks below are optional, found by hasattr
            if hasattr(module, "buffer_inits"):
                inits |= prefixed(prefix, duck.buffer_inits())
            if hasattr(module, "adapter_inits"):  # parameters added from outside (LoRA)
                inits |= prefixed(prefix, duck.adapter_inits())
        return inits

    def _extra_param_inits(self, *, std: float, out_std: float) -> dict[str, Init]:
        """Hook for modules a family adds beside the blocks (DeepSeek-V3's MTP modules)."""
        return {}

    def new_kv_cache(
        self,
        batch_size: int,
        max_seq_len: int,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        static: bool = False,
    ) -> KVCache:
        """An empty cache for this model's layers (dtype and device of the weights by default):
        key/value buffers for attention layers, fixed-size states for recurrent ones (a token
        mixer with ``recurrent_state_specs()``); ``static``: every step attends to the whole
        capacity, no host sync, see ``KVCache``."""
        weight = next(self.parameters())
        heads, key_dim, value_dim = self.kv_cache_widths()
        recurrent = {
            int(i): cast(Any, layer).attention.recurrent_state_specs()
            for i, layer in self.layers.items()
            if hasattr(layer.attention, "recurrent_state_specs")
        }
        return KVCache(
            layers=[int(i) for i in self.layers if int(i) not in recurrent],
            recurrent=recurrent,
            batch_size=batch_size,
            max_seq_len=max_seq_len,
            num_kv_heads=heads,
            head_dim=key_dim,
            value_dim=value_dim,
            dtype=dtype or weight.dtype,
            device=device or weight.device,
            windows={int(i): self.config.layer_window(int(i)) for i in self.layers},
            static=static,
        )

    def kv_cache_widths(self) -> tuple[int, int, int]:
        """What one layer caches per token: (heads, width of the first buffer, of the second);
        keys and values of every kv head here."""
        return self.config.num_kv_heads, self.config.head_dim, self.config.head_dim

    def _tie(self) -> None:
        # to_empty() replaces each module's parameters separately, which unties them.
        if (
            self.config.tie_embeddings
            and self.output is not None
            and self.tok_embeddings is not None
        ):
            self.output.weight = self.tok_embeddings.weight


def check_shape(name: str, tensor: torch.Tensor | None, shape: tuple[int, ...]) -> None:
    if tensor is not None and tuple(tensor.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(tensor.shape)}")


def _check_windows(config: TransformerConfig) -> None:
    name = type(config).__name__
    window = config.sliding_window
    if window is not None and (
        not isinstance(window, int) or isinstance(window, bool) or window < 1
    ):
        raise ValueError(
            f"{name}.sliding_window must be an int >= 1 (a query sees itself and the window - 1 "
            f"tokens before it) or None, got {window!r}"
        )
    layers = config.sliding_window_layers
    if layers is not None:
        if window is None:
            raise ValueError(f"{name}.sliding_window_layers={layers!r} needs a sliding_window")
        bad = [i for i in layers if not isinstance(i, int) or not 0 <= i < config.num_layers]
        if bad:
            raise ValueError(
                f"{name}.sliding_window_layers has {bad}: layer indices lie in "
                f"[0, {config.num_layers})"
            )


def check_input_lengths(
    input_lengths: torch.Tensor, B: int, S: int, kv_cache: KVCache | None
) -> None:
    if kv_cache is None:
        raise ValueError("input_lengths needs a kv_cache (it says how far each row advances)")
    check_shape("input_lengths", input_lengths, (B,))
    if bool((input_lengths < 1).any()) or bool((input_lengths > S).any()):
        raise ValueError(f"input_lengths must lie in [1, {S}], got {input_lengths.tolist()}")
