"""Model zoo (Llama 3, Qwen3), Hugging Face interop, KV-cache decoding, declarative plans."""

from .components import KVCache, RopeConfig, Transformer, TransformerConfig
from .decoding import greedy_generate
from .flops import flops_per_token, matmul_params
from .hf_io import from_hf, to_hf
from .llama3 import Llama3, Llama3Config
from .plan import ModelPlan, PipelineUnit, TensorParallelPlan, fqn_matches
from .qwen3 import Qwen3, Qwen3Config
from .registry import get_model, get_plan, list_models

__version__ = "0.1.0"

__all__ = [
    "KVCache",
    "Llama3",
    "Llama3Config",
    "ModelPlan",
    "PipelineUnit",
    "Qwen3",
    "Qwen3Config",
    "RopeConfig",
    "TensorParallelPlan",
    "Transformer",
    "TransformerConfig",
    "__version__",
    "flops_per_token",
    "fqn_matches",
    "from_hf",
    "get_model",
    "get_plan",
    "greedy_generate",
    "list_models",
    "matmul_params",
    "to_hf",
]
