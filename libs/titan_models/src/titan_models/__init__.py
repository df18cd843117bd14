"""Model zoo (Llama 3, Qwen3, Qwen3-MoE, DeepSeek-V3), Hugging Face interop, KV-cache decoding,
declarative plans."""

from .components import (
    AttentionMetadata,
    Constant,
    ContextParallel,
    ContextParallelComm,
    Init,
    KVCache,
    Normal,
    RopeConfig,
    Transformer,
    TransformerConfig,
    attend,
    attention_backends,
    init_state,
    register_attention_backend,
)
from .decoding import greedy_generate
from .deepseek_v3 import DeepSeekV3, DeepSeekV3Config
from .flops import flops_per_token, matmul_params
from .hf_io import from_hf, hf_model_config, load_hf_state, to_hf
from .llama3 import Llama3, Llama3Config
from .mtp import mtp_loss
from .plan import ModelPlan, PipelineUnit, TensorParallelPlan, fqn_matches
from .qwen3 import Qwen3, Qwen3Config
from .qwen3_moe import Qwen3Moe, Qwen3MoeConfig
from .registry import get_model, get_plan, list_models

__version__ = "0.1.0"

__all__ = [
    "AttentionMetadata",
    "Constant",
    "ContextParallel",
    "ContextParallelComm",
    "DeepSeekV3",
    "DeepSeekV3Config",
    "Init",
    "KVCache",
    "Llama3",
    "Llama3Config",
    "ModelPlan",
    "Normal",
    "PipelineUnit",
    "Qwen3",
    "Qwen3Config",
    "Qwen3Moe",
    "Qwen3MoeConfig",
    "RopeConfig",
    "TensorParallelPlan",
    "Transformer",
    "TransformerConfig",
    "__version__",
    "attend",
    "attention_backends",
    "flops_per_token",
    "fqn_matches",
    "from_hf",
    "get_model",
    "get_plan",
    "greedy_generate",
    "hf_model_config",
    "init_state",
    "list_models",
    "load_hf_state",
    "matmul_params",
    "mtp_loss",
    "register_attention_backend",
    "to_hf",
]
