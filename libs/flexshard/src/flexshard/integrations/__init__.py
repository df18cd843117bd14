"""flexshard inside other frameworks: ``flexshard.integrations.accelerate`` (Hugging Face
Accelerate) and ``flexshard.integrations.hf`` (transformers ``Trainer`` and TRL trainers). Each
imports its host lazily; ``import flexshard`` imports none of them."""
