"""Muse Glimmer: a dense GQA decoder with iRoPE, sliding / global layers, post-norms, a
soft-capped head, and its vision tower."""

from ..family import ModelFamily
from .config import MUSE_GLIMMER_FLAVORS, MuseGlimmerConfig, MuseGlimmerVisionConfig
from .hf import MuseGlimmerHFAdapter
from .model import MuseGlimmer
from .plan import plan
from .vision import MuseGlimmerVisionTower

FAMILY = ModelFamily(
    name="muse_glimmer",
    model_cls=MuseGlimmer,
    config_cls=MuseGlimmerConfig,
    flavors=MUSE_GLIMMER_FLAVORS,
    hf_adapter=MuseGlimmerHFAdapter(),
    plan=plan,
)

__all__ = [
    "FAMILY",
    "MUSE_GLIMMER_FLAVORS",
    "MuseGlimmer",
    "MuseGlimmerConfig",
    "MuseGlimmerHFAdapter",
    "MuseGlimmerVisionConfig",
    "MuseGlimmerVisionTower",
    "plan",
]
