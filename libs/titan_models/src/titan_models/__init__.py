"""Model zoo (Llama 3, Qwen3, Qwen3-MoE, DeepSeek-V3, Qwen3.5, Qwen3.5-MoE, Kimi Linear, Qwen3-VL,
Qwen3-VL-MoE, Muse Spark Open), Hugging Face interop, KV-cache decoding, declarative plans."""

from .components import (
    AttentionMetadata,
    Constant,
    ContextParallel,
    Float8Recipe,
    Init,
    KVCache,
    LoRAGroupedExperts,
    LoRALinear,
    Normal,
    RopeConfig,
    SoftCappedLinear,
    Transformer,
    TransformerConfig,
    apply_lora,
    attend,
    attention_backends,
    init_state,
    is_lora_param,
    lora_delta,
    lora_weights,
    merge_lora,
    quantize_modules,
    register_attention_backend,
    resolve_attention_backend,
)
from .config_fields import config_field_types, replace_config
from .decoding import greedy_generate
from .deepseek_v3 import DeepSeekV3, DeepSeekV3Config
from .deepseek_v4 import DeepSeekV4, DeepSeekV4Config
from .flops import flops_per_token, matmul_params, vision_flops
from .fqn import fqn_matches
from .gpt_oss import GptOss, GptOssConfig
from .hf_io import HFExport, from_hf, hf_export, hf_model_config, load_hf_state, to_hf
from .kimi_k25 import KimiK25, KimiK25Config, KimiK25VisionConfig
from .kimi_linear import KimiLinear, KimiLinearConfig
from .llama3 import Llama3, Llama3Config
from .mtp import mtp_loss
from .muse_glimmer import MuseGlimmer, MuseGlimmerConfig
from .muse_spark import MuseSpark, MuseSparkConfig
from .plan import ModelPlan, PipelineUnit, TensorParallelPlan, check_tensor_parallel
from .qwen3 import Qwen3, Qwen3Config
from .qwen3_5 import Qwen3_5, Qwen3_5Config
from .qwen3_5_moe import Qwen3_5Moe, Qwen3_5MoeConfig
from .qwen3_moe import Qwen3Moe, Qwen3MoeConfig
from .qwen3_vl import Qwen3VL, Qwen3VLConfig, Qwen3VLVisionConfig
from .qwen3_vl_moe import Qwen3VLMoe, Qwen3VLMoeConfig
from .registry import get_model, get_plan, list_models

__version__ = "0.1.0"

__all__ = [
    "AttentionMetadata",
    "Constant",
    "ContextParallel",
    "DeepSeekV3",
    "DeepSeekV3Config",
    "DeepSeekV4",
    "DeepSeekV4Config",
    "Float8Recipe",
    "GptOss",
    "GptOssConfig",
    "HFExport",
    "Init",
    "KVCache",
    "KimiK25",
    "KimiK25Config",
    "KimiK25VisionConfig",
    "KimiLinear",
    "KimiLinearConfig",
    "Llama3",
    "Llama3Config",
    "LoRAGroupedExperts",
    "LoRALinear",
    "ModelPlan",
    "MuseGlimmer",
    "MuseGlimmerConfig",
    "MuseSpark",
    "MuseSparkConfig",
    "Normal",
    "PipelineUnit",
    "Qwen3",
    "Qwen3Config",
    "Qwen3Moe",
    "Qwen3MoeConfig",
    "Qwen3VL",
    "Qwen3VLConfig",
    "Qwen3VLMoe",
    "Qwen3VLMoeConfig",
    "Qwen3VLVisionConfig",
    "Qwen3_5",
    "Qwen3_5Config",
    "Qwen3_5Moe",
    "Qwen3_5MoeConfig",
    "RopeConfig",
    "SoftCappedLinear",
    "TensorParallelPlan",
    "Transformer",
    "TransformerConfig",
    "__version__",
    "apply_lora",
    "attend",
    "attention_backends",
    "check_tensor_parallel",
    "config_field_types",
    "flops_per_token",
    "fqn_matches",
    "from_hf",
    "get_model",
    "get_plan",
    "greedy_generate",
    "hf_export",
    "hf_model_config",
    "init_state",
    "is_lora_param",
    "list_models",
    "load_hf_state",
    "lora_delta",
    "lora_weights",
    "matmul_params",
    "merge_lora",
    "mtp_loss",
    "quantize_modules",
    "register_attention_backend",
    "replace_config",
    "resolve_attention_backend",
    "to_hf",
    "vision_flops",
]
