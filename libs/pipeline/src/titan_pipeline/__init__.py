"""Pipeline schedules as data: generator, validator, simulator and runtime."""

__version__ = "0.1.0"

__all__ = ["__version__"]
