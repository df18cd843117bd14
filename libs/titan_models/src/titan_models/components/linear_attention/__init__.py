"""Linear-attention operators (the gated delta rule: chunked, recurrent, Triton) and the token
mixers built on them (Gated DeltaNet, Kimi Delta Attention)."""

from .delta_attention import DeltaRuleAttention, GatedDeltaNet, KimiDeltaAttention, l2_normalize
from .delta_rule import (
    DELTA_RULE_BACKENDS,
    chunk_delta_rule,
    document_segments,
    recurrent_delta_rule,
)
from .short_conv import ShortConvolution

__all__ = [
    "DELTA_RULE_BACKENDS",
    "DeltaRuleAttention",
    "GatedDeltaNet",
    "KimiDeltaAttention",
    "ShortConvolution",
    "chunk_delta_rule",
    "document_segments",
    "l2_normalize",
    "recurrent_delta_rule",
]
