"""DeepSeek-V4 configuration and flavours (V4-Flash and V4-Pro as published)."""

from __future__ import annotations

from dataclasses import dataclass

from ..components import RopeConfig, TransformerConfig, YarnRopeScaling
from ..components.moe import check_moe_fields

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
HASH_MOE, MOE = "hash_moe", "moe"
SCORE_FUNCS = ("sqrtsoftplus", "sigmoid", "softmax")


@dataclass(kw_only=True, slots=True)
class DeepSeekV4Config(TransformerConfig):
    """DeepSeek-V4: per layer a sliding window of raw keys plus (CSA) the indexer's top-k of
    4×-compressed entries or (HCA) every 128×-compressed entry, one shared K=V head with a
    learned sink per query head and a grouped output projection; ``hc_mult`` hyper-connected
    residual streams; a MoE in every block (hash-routed first layers), with one clamped shared
    expert.

    Inherited fields: ``num_kv_heads`` must be 1, ``sliding_window`` is the window of every
    layer (``sliding_window_layers`` None), ``rope`` is the plain RoPE of the sliding-only
    layers, ``ffn_hidden_dim`` mirrors ``moe_hidden_dim`` (no dense MLP),
    ``attention_backend`` is unused (the attention is its own operator).
    """

    norm_eps: float = 1e-6
    """Epsilon of every RMSNorm (and of the hyper-connections' normalisation)."""
    rope_dim: int
    """Channels of a head that carry RoPE (its last ones; HF ``qk_rope_head_dim``)."""
    compress_rope: RopeConfig
    """RoPE of the compressed layers (their queries, keys and entries; YaRN)."""
    q_lora_rank: int
    """Width of the query latent."""
    o_groups: int
    """Head groups of the grouped output projection."""
    o_lora_rank: int
    """Output features per group of the grouped output projection."""
    layer_types: tuple[str, ...]
    """Per layer: ``sliding_attention``, ``compressed_sparse_attention`` or
    ``heavily_compressed_attention``."""
    csa_rate: int = 4
    """Tokens per compressed entry in CSA layers (m)."""
    hca_rate: int = 128
    """Tokens per compressed entry in HCA layers (m')."""
    index_heads: int
    """Query heads of the lightning indexer."""
    index_head_dim: int
    """Head width of the lightning indexer (its entries' width)."""
    index_topk: int
    """Compressed entries each CSA query attends to."""
    hc_mult: int = 4
    """Hyper-connection residual streams."""
    hc_sinkhorn_iters: int = 20
    """Sinkhorn-Knopp iterations of the stream-mixing matrix."""
    hc_eps: float = 1e-6
    """Floor of the hyper-connection weights and Sinkhorn sums."""
    num_experts: int
    """Routed experts per MoE layer (HF ``n_routed_experts``)."""
    num_experts_per_tok: int
    """Routed experts per token (top-k)."""
    moe_hidden_dim: int
    """Hidden width of a routed expert and of the shared expert."""
    num_shared_experts: int = 1
    """Shared experts (one SwiGLU of ``num_shared_experts · moe_hidden_dim``)."""
    score_func: str = "sqrtsoftplus"
    """Router scores: ``sqrtsoftplus``, ``sigmoid`` or ``softmax``."""
    route_scale: float = 1.5
    """Multiplier of the renormalised routing weights (HF ``routed_scaling_factor``)."""
    mlp_layer_types: tuple[str, ...]
    """Per layer: ``hash_moe`` (experts looked up from the token id) or ``moe`` (learned)."""
    swiglu_limit: float = 10.0
    """Clamp of every expert's gate (above) and up projection (both sides)."""
    bias_update_rate: float = 0.001
    """Aux-loss-free balancing step of the learned routers (``update_expert_biases``)."""
    aux_loss_coef: float = 0.0001
    """Sequence-wise balance loss of the learned routers in training (0: none)."""
    attention_query_chunk: int = 512
    """Queries per chunk of the compressed attention (bounds its memory; see
    ``compressed_sparse_attention``)."""

    def __post_init__(self) -> None:
        TransformerConfig.__post_init__(self)
        check_moe_fields(self)
        name = type(self).__name__
        for field in (
            "rope_dim",
            "q_lora_rank",
            "o_groups",
            "o_lora_rank",
            "index_heads",
            "index_head_dim",
            "index_topk",
            "hc_mult",
            "hc_sinkhorn_iters",
            "attention_query_chunk",
        ):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}.{field} must be an int >= 1, got {value!r}")
        for field in ("csa_rate", "hca_rate"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 2:
                raise ValueError(f"{name}.{field} must be an int >= 2, got {value!r}")
        if self.num_kv_heads != 1:
            raise ValueError(
                f"{name}.num_kv_heads={self.num_kv_heads} must be 1 (one shared K=V head)"
            )
        if self.rope_dim % 2 or self.rope_dim > min(self.head_dim, self.index_head_dim):
            raise ValueError(
                f"{name}.rope_dim={self.rope_dim} must be even and <= head_dim and index_head_dim"
            )
        if self.num_heads % self.o_groups:
            raise ValueError(
                f"{name}.o_groups={self.o_groups} must divide num_heads={self.num_heads}"
            )
        if self.sliding_window is None or self.sliding_window_layers is not None:
            raise ValueError(
                f"{name}.sliding_window must be set (every layer's window) and "
                f"sliding_window_layers None, got {self.sliding_window!r} / "
                f"{self.sliding_window_layers!r}"
            )
        for field, allowed in (("layer_types", LAYER_TYPES), ("mlp_layer_types", (HASH_MOE, MOE))):
            values = tuple(getattr(self, field))
            bad = sorted(set(values) - set(allowed))
            if len(values) != self.num_layers or bad:
                raise ValueError(
                    f"{name}.{field} must name one of {list(allowed)} per layer "
                    f"({self.num_layers}), got {list(values)}"
                )
        if self.score_func not in SCORE_FUNCS:
            raise ValueError(
                f"{name}.score_func must be one of {list(SCORE_FUNCS)}, got {self.score_func!r}"
            )
        if self.num_shared_experts < 0:
            raise ValueError(f"{name}.num_shared_experts must be >= 0")
        for field in ("route_scale", "swiglu_limit", "hc_eps"):
            if not getattr(self, field) > 0:
                raise ValueError(f"{name}.{field} must be > 0, got {getattr(self, field)!r}")
        if not isinstance(self.compress_rope, RopeConfig):
            raise ValueError(f"{name}.compress_rope must be a RopeConfig")

    @property
    def rotary_dim(self) -> int:
        """Only the last ``rope_dim`` channels of a head rotate."""
        return self.rope_dim

    def layer_rate(self, index: int) -> int | None:
        """Compression rate of layer ``index`` (None: sliding window only)."""
        kind = self.layer_types[index]
        return {SLIDING: None, CSA: self.csa_rate, HCA: self.hca_rate}[kind]

    def _layer_params(self, index: int) -> tuple[int, int]:
        """(trained matmul weights, forward-only indexer weights) of block ``index``."""
        c, H, E, D = self, self.num_heads, self.head_dim, self.dim
        attention = D * c.q_lora_rank + c.q_lora_rank * H * E + D * E
        attention += H * E * c.o_lora_rank + c.o_groups * c.o_lora_rank * D
        kind = c.layer_types[index]
        if kind != SLIDING:
            attention += 2 * D * E * (2 if kind == CSA else 1)
        indexer = 0
        if kind == CSA:
            indexer = 4 * D * c.index_head_dim + c.q_lora_rank * c.index_heads * c.index_head_dim
            indexer += D * c.index_heads
        hyper = 2 * (2 + c.hc_mult) * c.hc_mult * c.hc_mult * D
        moe = D * c.num_experts
        moe += (c.num_experts_per_tok + c.num_shared_experts) * 3 * D * c.moe_hidden_dim
        return attention + hyper + moe, indexer

    def matmul_params(self) -> int:
        """Active weights that take a gradient: attention (compressors included), the
        hyper-connection maps, router + top-k + shared experts, head (and its stream collapse).
        The lightning indexers are forward-only (no gradient reaches them): their FLOPs are in
        ``attention_flops``."""
        trunk = sum(self._layer_params(i)[0] for i in range(self.num_layers))
        return trunk + self.dim * self.vocab_size + self.hc_mult * self.hc_mult * self.dim

    def attention_flops(self, seq_len: int) -> int:
        """Attention as executed, per token: ``12·H·E`` per attended key (``min(W, T)`` raw
        keys, plus ``min(top_k, T / m)`` entries in CSA or ``T / m'`` in HCA layers), and the
        lightning indexers' forward: ``2·`` their weights and ``2·Hi·Ei`` per scored entry."""
        T, total = seq_len, 0
        window = self.sliding_window
        assert window is not None  # required by __post_init__
        for i in range(self.num_layers):
            keys = min(window, T)
            kind = self.layer_types[i]
            if kind == CSA:
                keys += min(self.index_topk, T // self.csa_rate)
                indexer = self._layer_params(i)[1]
                total += 2 * indexer + 2 * self.index_heads * self.index_head_dim * (
                    T // self.csa_rate
                )
            elif kind == HCA:
                keys += T // self.hca_rate
            total += 12 * self.num_heads * self.head_dim * keys
        return total


def _flash_layer_types(n: int) -> tuple[str, ...]:
    """V4-Flash: two sliding-only layers, then CSA on even and HCA on odd layers."""
    return tuple(SLIDING if i < 2 else (CSA if i % 2 == 0 else HCA) for i in range(n))


def _pro_layer_types(n: int) -> tuple[str, ...]:
    """V4-Pro (transformers' default schedule): two HCA layers, then HCA / CSA alternating."""
    return (HCA, HCA, *(CSA if i % 2 else HCA for i in range(n - 2)))


def _hash_first(n: int, hashed: int = 3) -> tuple[str, ...]:
    return tuple(HASH_MOE if i < hashed else MOE for i in range(n))


_COMPRESS_ROPE = RopeConfig(
    theta=160_000.0,
    scaling=YarnRopeScaling(factor=16.0, original_max_seq_len=65_536, attention_factor=1.0),
)


def _published(**kw) -> DeepSeekV4Config:
    n = kw["num_layers"]
    return DeepSeekV4Config(
        vocab_size=129_280,
        num_kv_heads=1,
        head_dim=512,
        rope_dim=64,
        rope=RopeConfig(theta=10_000.0),
        compress_rope=_COMPRESS_ROPE,
        sliding_window=128,
        index_heads=64,
        index_head_dim=128,
        num_experts_per_tok=6,
        mlp_layer_types=_hash_first(n),
        max_seq_len=1_048_576,
        **kw,
    )


DEEPSEEK_V4_FLAVORS: dict[str, DeepSeekV4Config] = {
    # Tiny: one layer of each kind (sliding, CSA over 4, HCA over 16), 2 streams, a hash layer.
    "debug": DeepSeekV4Config(
        vocab_size=2048,
        dim=128,
        num_layers=4,
        num_heads=4,
        num_kv_heads=1,
        head_dim=64,
        ffn_hidden_dim=64,
        rope_dim=16,
        rope=RopeConfig(theta=10_000.0),
        compress_rope=RopeConfig(
            theta=160_000.0,
            scaling=YarnRopeScaling(factor=4.0, original_max_seq_len=512, attention_factor=1.0),
        ),
        q_lora_rank=64,
        o_groups=2,
        o_lora_rank=32,
        layer_types=(SLIDING, CSA, HCA, CSA),
        csa_rate=4,
        hca_rate=16,
        sliding_window=16,
        index_heads=2,
        index_head_dim=32,
        index_topk=8,
        hc_mult=2,
        num_experts=8,
        num_experts_per_tok=2,
        moe_hidden_dim=64,
        mlp_layer_types=(HASH_MOE, MOE, MOE, MOE),
        max_seq_len=2048,
    ),
    # deepseek-ai/DeepSeek-V4-Flash (284B total, 13B active)
    "flash": _published(
        dim=4096,
        num_layers=43,
        num_heads=64,
        ffn_hidden_dim=2048,
        q_lora_rank=1024,
        o_groups=8,
        o_lora_rank=1024,
        layer_types=_flash_layer_types(43),
        index_topk=512,
        num_experts=256,
        moe_hidden_dim=2048,
    ),
    # deepseek-ai/DeepSeek-V4-Pro (1.6T total, 49B active)
    "pro": _published(
        dim=7168,
        num_layers=61,
        num_heads=128,
        ffn_hidden_dim=3072,
        q_lora_rank=1536,
        o_groups=16,
        o_lora_rank=1024,
        layer_types=_pro_layer_types(61),
        index_topk=1024,
        num_experts=384,
        moe_hidden_dim=3072,
    ),
}
