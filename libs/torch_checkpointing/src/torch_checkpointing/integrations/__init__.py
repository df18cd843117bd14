"""Integrations with other training frameworks, one module per host (``hf``: transformers).

Each imports its host lazily: ``import torch_checkpointing`` never imports one.
"""
