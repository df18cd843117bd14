"""Titan inside other training frameworks. Each host has its own module, imported on demand
(nothing here imports a host): ``titan_train.integrations.verl`` is a veRL training engine."""

__all__: list[str] = []
