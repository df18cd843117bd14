"""MoE routing, grouped experts, expert-parallel dispatch (local, all-to-all, symmetric memory), Triton kernels."""

__version__ = "0.1.0"

__all__ = ["__version__"]
