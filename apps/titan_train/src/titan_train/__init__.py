"""Typed recipes, trainer loop and CLI composing every Titan library."""

__version__ = "0.1.0"

__all__ = ["__version__"]
