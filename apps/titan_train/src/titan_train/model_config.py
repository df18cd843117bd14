"""The model class and config of a job: a family's flavour or an HF folder, with the
``model.*`` fields applied (``model.config`` last)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TypeAlias, cast

import titan_models
from titan_train.config import JobConfig
from titan_train.config_file import model_config_changes
from titan_train.data.tokenizers import Tokenizer

__all__ = ["ModelClass", "model_config"]

ModelClass: TypeAlias = Callable[[titan_models.TransformerConfig], titan_models.Transformer]
"""A family's model class, built as ``model_cls(config)``."""


def model_config(
    cfg: JobConfig, tokenizer: Tokenizer
) -> tuple[ModelClass, titan_models.TransformerConfig]:
    """The model class and config: from the HF folder when initialising from one, else the
    family's flavour (vocabulary from the tokenizer unless set); ``model.config`` fields set
    last."""
    if cfg.checkpoint.init_from_hf:
        model_cls, config = titan_models.hf_model_config(cfg.checkpoint.init_from_hf)
        config = dataclasses.replace(config, attention_backend=cfg.model.attention_backend)
        source = f"checkpoint.init_from_hf={cfg.checkpoint.init_from_hf!r}"
    else:
        overrides = {
            "vocab_size": cfg.model.vocab_size or tokenizer.vocab_size,
            "attention_backend": cfg.model.attention_backend,
        }
        if cfg.model.num_mtp_modules >= 0:
            overrides["num_mtp_modules"] = cfg.model.num_mtp_modules
        model_cls, config = titan_models.get_model(cfg.model.family, cfg.model.flavor, **overrides)
        source = f"{cfg.model.family} {cfg.model.flavor}"
    config = _set_fields(config, cfg)
    if config.vocab_size < tokenizer.vocab_size:
        raise ValueError(
            f"the model ({source}) has vocab_size={config.vocab_size}, smaller than the "
            f"tokenizer's {tokenizer.vocab_size} (data.tokenizer={cfg.data.tokenizer!r})"
        )
    # titan_models types the class as type[Transformer], whose own constructor also takes the
    # blocks; every family's class is built from its config alone.
    return cast(ModelClass, model_cls), config


def _set_fields(
    config: titan_models.TransformerConfig, cfg: JobConfig
) -> titan_models.TransformerConfig:
    if not cfg.model.config:
        return config
    changed = titan_models.replace_config(config, model_config_changes(config, cfg.model.config))
    assert isinstance(changed, type(config))  # replace_config keeps the config's class
    return changed
