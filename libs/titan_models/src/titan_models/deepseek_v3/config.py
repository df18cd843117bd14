"""DeepSeek-V3 configuration and flavours (hyper-parameters of the public HF checkpoints)."""

from __future__ import annotations

from dataclasses import dataclass

from ..components import RopeConfig, TransformerConfig, YarnRopeScaling
from ..components.moe import check_moe_fields


@dataclass(kw_only=True, slots=True)
class DeepSeekV3Config(TransformerConfig):
    """DeepSeek-V3: MLA attention; ``first_k_dense`` SwiGLU blocks, then MoE blocks with shared
    experts and group-limited sigmoid routing; optional multi-token-prediction modules.

    The inherited ``num_kv_heads`` must equal ``num_heads`` (MLA has a key and value per head)
    and ``head_dim`` must be ``qk_nope_head_dim + qk_rope_head_dim`` (the query/key width);
    ``ffn_hidden_dim`` is the hidden width of the dense blocks.
    """

    norm_eps: float = 1e-6
    """Epsilon of the block, final and MTP RMSNorms."""
    q_lora_rank: int
    """Width of the query latent; 0 = queries projected straight from the input (V2-Lite)."""
    kv_lora_rank: int
    """Width of the key/value latent (what the KV cache stores per token, with the rope key)."""
    qk_nope_head_dim: int
    """Per-head query/key width without position information."""
    qk_rope_head_dim: int
    """Per-head query width (and shared key width) that carries RoPE."""
    v_head_dim: int
    """Per-head value width."""
    latent_norm_eps: float = 1e-6
    """Epsilon of the RMSNorms on the q and kv latents (HF and the reference use 1e-6)."""
    num_experts: int
    """Routed experts per MoE layer (HF ``n_routed_experts``)."""
    num_experts_per_tok: int
    """Routed experts per token (top-k)."""
    moe_hidden_dim: int
    """Hidden width of one routed (and of one shared) expert (HF ``moe_intermediate_size``)."""
    num_shared_experts: int = 1
    """Shared experts, run as one SwiGLU of width ``num_shared_experts · moe_hidden_dim``."""
    first_k_dense: int
    """Leading blocks with a dense SwiGLU instead of a MoE (HF ``first_k_dense_replace``)."""
    num_expert_groups: int = 1
    """Expert groups for group-limited routing (HF ``n_group``)."""
    topk_groups: int = 1
    """Groups a token may route into (HF ``topk_group``)."""
    route_scale: float = 1.0
    """Multiplier of the routing weights (HF ``routed_scaling_factor``)."""
    norm_topk_prob: bool = True
    """Renormalise the selected sigmoid scores to sum to one before ``route_scale``."""
    bias_update_rate: float = 0.001
    """Aux-loss-free balancing step γ (``dist_moe.update_expert_biases`` once per step)."""
    aux_loss_coef: float = 0.0001
    """Weight α of the sequence-wise balance loss (attached through autograd; 0 = none)."""
    num_mtp_modules: int = 0
    """Multi-token-prediction modules (0 = none); module k predicts token i+1+k at position i."""
    mtp_loss_weight: float = 0.3
    """λ of the MTP loss, ``λ · mean over modules`` (the paper: 0.3, then 0.1)."""

    def __post_init__(self) -> None:
        TransformerConfig.__post_init__(self)
        check_moe_fields(self)
        name = type(self).__name__
        for field in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}.{field} must be an int >= 1, got {value!r}")
        for field in ("q_lora_rank", "num_shared_experts", "num_mtp_modules"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name}.{field} must be an int >= 0, got {value!r}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"{name}.qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")
        if self.head_dim != self.qk_nope_head_dim + self.qk_rope_head_dim:
            raise ValueError(
                f"{name}.head_dim={self.head_dim} must equal qk_nope_head_dim + qk_rope_head_dim "
                f"= {self.qk_nope_head_dim + self.qk_rope_head_dim}"
            )
        if self.num_kv_heads != self.num_heads:
            raise ValueError(
                f"{name}.num_kv_heads={self.num_kv_heads} must equal num_heads={self.num_heads} "
                "(MLA has no grouped-query sharing)"
            )
        if not 0 <= self.first_k_dense <= self.num_layers:
            raise ValueError(
                f"{name}.first_k_dense must be in [0, num_layers={self.num_layers}], "
                f"got {self.first_k_dense!r}"
            )
        if self.num_expert_groups < 1 or self.num_experts % self.num_expert_groups:
            raise ValueError(
                f"{name}.num_expert_groups={self.num_expert_groups} must be >= 1 and divide "
                f"num_experts={self.num_experts}"
            )
        if not 1 <= self.topk_groups <= self.num_expert_groups:
            raise ValueError(
                f"{name}.topk_groups must be in [1, num_expert_groups={self.num_expert_groups}], "
                f"got {self.topk_groups!r}"
            )
        reachable = self.topk_groups * (self.num_experts // self.num_expert_groups)
        if self.num_experts_per_tok > reachable:
            raise ValueError(
                f"{name}.num_experts_per_tok={self.num_experts_per_tok} must be <= topk_groups "
                f"* experts per group = {reachable}"
            )
        for field in ("route_scale", "latent_norm_eps"):
            if not getattr(self, field) > 0:
                raise ValueError(f"{name}.{field} must be > 0, got {getattr(self, field)!r}")
        for field in ("bias_update_rate", "mtp_loss_weight"):
            if not getattr(self, field) >= 0:
                raise ValueError(f"{name}.{field} must be >= 0, got {getattr(self, field)!r}")

    @property
    def rotary_dim(self) -> int:
        """Only the ``qk_rope_head_dim`` part of a head is rotated."""
        return self.qk_rope_head_dim

    def attention_params(self) -> int:
        """Matmul weights of one MLA layer."""
        c, H = self, self.num_heads
        q = c.dim * H * c.head_dim
        if c.q_lora_rank:
            q = c.dim * c.q_lora_rank + c.q_lora_rank * H * c.head_dim
        kv = c.dim * (c.kv_lora_rank + c.qk_rope_head_dim)
        kv += c.kv_lora_rank * H * (c.qk_nope_head_dim + c.v_head_dim)
        return q + kv + H * c.v_head_dim * c.dim

    def matmul_params(self) -> int:
        """Active weights: attention, dense or (router + top-k + shared) FFNs, the head; and per
        MTP module its ``eh_proj``, block and another pass through the head."""
        c = self
        moe = c.dim * c.num_experts
        moe += (c.num_experts_per_tok + c.num_shared_experts) * 3 * c.dim * c.moe_hidden_dim
        dense = 3 * c.dim * c.ffn_hidden_dim
        head = c.dim * c.vocab_size
        trunk = c.num_layers * c.attention_params() + c.first_k_dense * dense
        trunk += (c.num_layers - c.first_k_dense) * moe
        mtp = 2 * c.dim * c.dim + c.attention_params() + moe + head
        return trunk + head + c.num_mtp_modules * mtp

    def attention_flops(self, seq_len: int) -> int:
        """``6·L·H·(E_qk + E_v)·T``, the MTP modules' attention included."""
        layers = self.num_layers + self.num_mtp_modules
        return 6 * layers * self.num_heads * (self.head_dim + self.v_head_dim) * seq_len


_V3_ROPE = RopeConfig(
    theta=10_000.0,
    scaling=YarnRopeScaling(
        factor=40.0,
        original_max_seq_len=4096,
        beta_fast=32.0,
        beta_slow=1.0,
        mscale=1.0,
        mscale_all_dim=1.0,
    ),
)

DEEPSEEK_V3_FLAVORS: dict[str, DeepSeekV3Config] = {
    # Tiny: a training step in well under a second on a CPU. Query LoRA, 8 experts in 4 groups
    # (top-2 of 2 groups), one dense block, one MTP module, YaRN with the mscale correction.
    "debug": DeepSeekV3Config(
        vocab_size=2048,
        dim=128,
        num_layers=3,
        num_heads=4,
        num_kv_heads=4,
        head_dim=48,
        ffn_hidden_dim=256,
        q_lora_rank=64,
        kv_lora_rank=32,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        moe_hidden_dim=64,
        num_shared_experts=1,
        first_k_dense=1,
        num_expert_groups=4,
        topk_groups=2,
        route_scale=2.5,
        num_mtp_modules=1,
        rope=RopeConfig(
            theta=10_000.0,
            scaling=YarnRopeScaling(
                factor=4.0, original_max_seq_len=512, mscale=1.0, mscale_all_dim=1.0
            ),
        ),
        max_seq_len=2048,
    ),
    # moonshotai/Moonlight-16B-A3B (the DeepSeek-V3 architecture at DeepSeek-V2-Lite's shape:
    # no query LoRA, 64 experts top-6, 2 shared, one dense block).
    "16B": DeepSeekV3Config(
        vocab_size=163_840,
        dim=2048,
        num_layers=27,
        num_heads=16,
        num_kv_heads=16,
        head_dim=192,
        ffn_hidden_dim=11264,
        q_lora_rank=0,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        num_experts=64,
        num_experts_per_tok=6,
        moe_hidden_dim=1408,
        num_shared_experts=2,
        first_k_dense=1,
        route_scale=2.446,
        norm_eps=1e-5,
        rope=RopeConfig(theta=50_000.0),
        max_seq_len=8192,
    ),
    # deepseek-ai/DeepSeek-V3 (and V3-0324 / R1: same architecture)
    "671B": DeepSeekV3Config(
        vocab_size=129_280,
        dim=7168,
        num_layers=61,
        num_heads=128,
        num_kv_heads=128,
        head_dim=192,
        ffn_hidden_dim=18432,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        num_experts=256,
        num_experts_per_tok=8,
        moe_hidden_dim=2048,
        num_shared_experts=1,
        first_k_dense=3,
        num_expert_groups=8,
        topk_groups=4,
        route_scale=2.5,
        num_mtp_modules=1,
        rope=_V3_ROPE,
        max_seq_len=163_840,
    ),
}
