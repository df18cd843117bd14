"""Model families by name: ``get_model``, ``list_models`` and look-ups for HF interop."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch.nn as nn

from . import (
    deepseek_v3,
    deepseek_v4,
    gpt_oss,
    kimi_k25,
    kimi_linear,
    llama3,
    muse_glimmer,
    muse_spark,
    qwen3,
    qwen3_5,
    qwen3_5_moe,
    qwen3_moe,
    qwen3_vl,
    qwen3_vl_moe,
)
from .components import TransformerConfig
from .family import ModelClass, ModelFamily
from .plan import ModelPlan, with_capabilities

# A new family is a folder with a FAMILY and one entry here.
FAMILIES: dict[str, ModelFamily[Any]] = {
    f.name: f
    for f in (
        llama3.FAMILY,
        qwen3.FAMILY,
        qwen3_moe.FAMILY,
        deepseek_v3.FAMILY,
        gpt_oss.FAMILY,
        deepseek_v4.FAMILY,
        qwen3_5.FAMILY,
        qwen3_5_moe.FAMILY,
        kimi_linear.FAMILY,
        qwen3_vl.FAMILY,
        qwen3_vl_moe.FAMILY,
        kimi_k25.FAMILY,
        muse_glimmer.FAMILY,
        muse_spark.FAMILY,
    )
}


def list_models() -> dict[str, list[str]]:
    """Every family and its flavours, e.g. ``{"llama3": ["debug", "1B", ...], ...}``."""
    return {name: list(f.flavors) for name, f in FAMILIES.items()}


def get_model(family: str, flavor: str, **overrides: Any) -> tuple[ModelClass, TransformerConfig]:
    """The model class and the flavour's config with ``overrides`` applied.

    Returns the class rather than an instance so the caller chooses where it is built::

        model_cls, config = get_model("llama3", "8B")
        with torch.device("meta"):
            model = model_cls(config)
        model.init_weights(device="cuda")
    """
    fam = _family(family)
    if flavor not in fam.flavors:
        raise ValueError(
            f"unknown flavor {flavor!r} of model family {family!r}; known: {list(fam.flavors)}"
        )
    config = fam.flavors[flavor]
    unknown = sorted(set(overrides) - set(config.field_names()))
    if unknown:
        raise ValueError(
            f"unknown {type(config).__name__} field(s) {unknown}; known: {config.field_names()}"
        )
    return fam.model_cls, dataclasses.replace(config, **overrides)


def get_plan(config: TransformerConfig) -> ModelPlan:
    """The declarative parallelism plan for a config of any registered family, with what the
    model supports (TP divisors, experts, CP's smallest chunk, refused axes) filled in."""
    return with_capabilities(family_of(config).plan(config), config)


def family_of(obj: nn.Module | TransformerConfig) -> ModelFamily:
    """The family of a model instance or config (by exact class)."""
    for fam in FAMILIES.values():
        if type(obj) in (fam.model_cls, fam.config_cls):
            return fam
    raise ValueError(
        f"{type(obj).__name__} belongs to no registered model family; known: {list(FAMILIES)}"
    )


def family_for_hf(model_type: object) -> ModelFamily:
    """The family that reads HF checkpoints of ``model_type``."""
    for fam in FAMILIES.values():
        if model_type in fam.hf_adapter.model_types:
            return fam
    known = [t for f in FAMILIES.values() for t in f.hf_adapter.model_types]
    raise ValueError(f"HF config field model_type={model_type!r} is not supported; known: {known}")


def _family(name: str) -> ModelFamily:
    if name not in FAMILIES:
        raise ValueError(f"unknown model family {name!r}; known: {list(FAMILIES)}")
    return FAMILIES[name]
