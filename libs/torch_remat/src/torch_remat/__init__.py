"""Fine-grained activation rematerialisation: policies, regions, CPU offload, memory-budget planner."""

__version__ = "0.1.0"

__all__ = ["__version__"]
