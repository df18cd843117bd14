"""Models of ranks sharing processors (an oversubscribed CPU); not part of the stable API."""

from titan_pipeline.experimental.shared_processors import Contention, simulate_shared

__all__ = ["Contention", "simulate_shared"]
