"""Model zoo (Llama 3, Qwen3, Qwen3-MoE, DeepSeek-V3), HF interop, declarative sharding plans."""

__version__ = "0.1.0"

__all__ = ["__version__"]
