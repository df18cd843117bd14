"""Training FLOPs per token, for model-FLOPs utilisation (MFU)."""

from __future__ import annotations

from collections.abc import Sequence

from .components import TransformerConfig


def matmul_params(config: TransformerConfig) -> int:
    """Weights that take part in a matmul per token: every projection plus the output head.

    The embedding lookup is a gather, not a matmul; the head counts even when tied to it.
    Norm weights are negligible and left out. For a mixture of experts only the *active*
    weights count: the router, the shared experts and ``top_k`` routed experts per MoE layer
    (plus DeepSeek-V3's MTP modules when it has them: they run in every training step).
    """
    return config.matmul_params()


def flops_per_token(config: TransformerConfig, seq_len: int) -> int:
    """Forward + backward FLOPs for one token of a ``seq_len`` training sequence.

    ``6·N + 12·L·H·E·T`` (Kaplan et al. 2020; Chowdhery et al. 2022, App. B), where ``N`` is
    ``matmul_params`` (2 FLOPs per weight forward, 4 backward), and the attention term counts
    ``q·kᵀ`` and ``p·v`` (2·T·H·E each, forward, per layer) times 3 for the backward: ``L``
    layers, ``H`` query heads, ``E`` head dim, ``T = seq_len``. As in PaLM and torchtitan the
    attention term ignores causal masking (a causal kernel does about half of it). With MLA
    the two products use their own widths: ``6·L·H·(E_qk + E_v)·T``.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    return 6 * matmul_params(config) + config.attention_flops(seq_len)


def vision_flops(config: TransformerConfig, image_grid_thw: Sequence[Sequence[int]]) -> int:
    """Forward + backward FLOPs of a vision-language model's vision tower on images of patch
    grids ``(t, h, w)``: ``6·N`` per patch and per merged token (``N``: the tower's matmul
    weights each sees) plus bidirectional attention, ``12·L·D·n²`` per frame of ``n = h·w``
    patches. The text tokens' share, image placeholders included, is ``flops_per_token``."""
    if not hasattr(config, "vision_flops"):
        raise ValueError(f"{type(config).__name__} has no vision tower")
    return config.vision_flops([tuple(g) for g in image_grid_thw])
