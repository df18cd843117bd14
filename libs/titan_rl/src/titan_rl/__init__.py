"""RL post-training with the same model code in trainer and generator."""

__version__ = "0.1.0"

__all__ = ["__version__"]
