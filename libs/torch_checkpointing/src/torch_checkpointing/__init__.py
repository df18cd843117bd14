"""Async distributed checkpoints with one metadata exchange, atomic commits, resharding, HF export."""

__version__ = "0.1.0"

__all__ = ["__version__"]
