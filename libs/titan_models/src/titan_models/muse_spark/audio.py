"""The Muse Spark Open audio tower: raw mono waveforms → one text-width token per
``prod(patch_sizes)`` samples (80 ms at 24 kHz, released), no attention and no spectrogram.

A pyramid of stages; stage ``i``:

    x = rms_norm(w_patch · fold(x, patch_sizes[i]))         # p consecutive steps → one
    for each of depths[i] blocks:
        x = x + mlp(rms_norm(causal_depthwise_conv(x)))     # GELU MLP of width · mlp_ratio

then ``rms_norm → projection → rms_norm`` to the text width. ``fold`` concatenates ``p``
consecutive steps step-major (feature ``j·C + c`` is channel ``c`` of step ``j``), the first
stage's one channel being the waveform. The convolutions see only the past (left padding
of ``k − 1``), so a clip's tokens never depend on the samples after them, and each clip is
its own row (nothing crosses clips). Every RMSNorm has a learned scale (plain, not
centred), in fp32 as transformers computes it.

Shapes: A clips, N samples per clip, S steps of a stage, C channels, O text width.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..components import RMSNorm
from ..components.init import Constant, Init, Normal, prefixed
from ..components.vision import VisionFeedForward
from ..components.vision.encoder import linear_init
from .config import MuseSparkAudioConfig


class PatchFold(nn.Module):
    """``p`` consecutive steps of ``C`` channels → one step of ``out_dim`` (linear + RMSNorm)."""

    def __init__(self, *, in_dim: int, out_dim: int, patch: int, eps: float) -> None:
        super().__init__()
        self.patch = patch
        self.proj = nn.Linear(in_dim * patch, out_dim)
        self.norm = RMSNorm(out_dim, eps=eps)

    def forward(self, x_ASC: torch.Tensor) -> torch.Tensor:
        A, S, C = x_ASC.shape
        return self.norm(self.proj(x_ASC.reshape(A, S // self.patch, self.patch * C)))

    def param_init(self, *, std: float) -> dict[str, Init]:
        return prefixed("proj", linear_init(self.proj, std)) | prefixed(
            "norm", self.norm.param_init()
        )


class ConvBlock(nn.Module):
    """``x + mlp(rms_norm(conv(x)))`` with a causal depthwise convolution."""

    def __init__(self, *, dim: int, kernel: int, hidden_dim: int, activation: str, eps: float):
        super().__init__()
        self.conv = nn.Conv1d(dim, dim, kernel, groups=dim)
        self.norm = RMSNorm(dim, eps=eps)
        self.feed_forward = VisionFeedForward(dim=dim, hidden_dim=hidden_dim, activation=activation)

    def forward(self, x_ASC: torch.Tensor) -> torch.Tensor:
        past = F.pad(x_ASC.transpose(1, 2), (self.conv.kernel_size[0] - 1, 0))
        h_ASC = self.conv(past).transpose(1, 2)
        return x_ASC + self.feed_forward(self.norm(h_ASC))

    def param_init(self, *, std: float, out_std: float) -> dict[str, Init]:
        inits: dict[str, Init] = {"conv.weight": Normal(std), "conv.bias": Constant(0.0)}
        inits |= prefixed("norm", self.norm.param_init())
        return inits | prefixed(
            "feed_forward", self.feed_forward.param_init(std=std, out_std=out_std)
        )


class AudioStage(nn.Module):
    """One resolution of the pyramid: a ``PatchFold`` then ``ConvBlock``s."""

    def __init__(self, config: MuseSparkAudioConfig, index: int) -> None:
        super().__init__()
        c, width = config, config.hidden_sizes[index]
        self.patch_embed = PatchFold(
            in_dim=1 if index == 0 else c.hidden_sizes[index - 1],
            out_dim=width,
            patch=c.patch_sizes[index],
            eps=c.norm_eps,
        )
        self.blocks = nn.ModuleList(
            ConvBlock(
                dim=width,
                kernel=c.conv_kernel_size,
                hidden_dim=int(width * c.mlp_ratio),
                activation=c.activation,
                eps=c.norm_eps,
            )
            for _ in range(c.depths[index])
        )

    def forward(self, x_ASC: torch.Tensor) -> torch.Tensor:
        x_ASC = self.patch_embed(x_ASC)
        for block in self.blocks:
            x_ASC = block(x_ASC)
        return x_ASC


class MuseSparkAudioTower(nn.Module):
    """Waveforms ``(A, N)`` → ``(A, N / prod(patch_sizes), O)`` (see the module docstring)."""

    def __init__(self, config: MuseSparkAudioConfig, *, out_dim: int) -> None:
        """``out_dim``: the text width the tokens are projected to."""
        super().__init__()
        self.config = c = config
        self.stages = nn.ModuleList(AudioStage(c, i) for i in range(len(c.depths)))
        self.norm = RMSNorm(c.hidden_sizes[-1], eps=c.norm_eps)
        self.projection = nn.Linear(c.hidden_sizes[-1], out_dim)
        self.out_norm = RMSNorm(out_dim, eps=c.norm_eps)

    def forward(self, audio_AN: torch.Tensor) -> torch.Tensor:
        step = self.config.samples_per_token
        if audio_AN.dim() != 2 or audio_AN.shape[1] % step:
            raise ValueError(
                f"audio_values must be (clips, samples) with samples a multiple of "
                f"{step} (samples per audio token; pad the clip on the right), got "
                f"{tuple(audio_AN.shape)}"
            )
        x_ASC = audio_AN.to(self.projection.weight.dtype)[..., None]
        for stage in self.stages:
            x_ASC = stage(x_ASC)
        return self.out_norm(self.projection(self.norm(x_ASC)))

    def param_init(self, *, std: float, out_std: float = 0.0) -> dict[str, Init]:
        """Linears and convolutions Normal ``std`` (the blocks' MLP outputs ``std /
        √(2·blocks)``), biases zero, RMSNorms one."""
        blocks_out = std / math.sqrt(2 * sum(self.config.depths))
        inits: dict[str, Init] = {}
        for i, stage in enumerate(self.stages):
            assert isinstance(stage, AudioStage)
            inits |= prefixed(f"stages.{i}.patch_embed", stage.patch_embed.param_init(std=std))
            for j, block in enumerate(stage.blocks):
                assert isinstance(block, ConvBlock)
                inits |= prefixed(
                    f"stages.{i}.blocks.{j}", block.param_init(std=std, out_std=blocks_out)
                )
        inits |= prefixed("norm", self.norm.param_init())
        inits |= prefixed("projection", linear_init(self.projection, std))
        return inits | prefixed("out_norm", self.out_norm.param_init())


def audio_token_mask(num_tokens: int, lengths_A: torch.Tensor, samples_per_token: int):
    """``(A, num_tokens)`` True for the tokens of each clip's real samples (``lengths_A``
    samples, right-padded): ``⌈length / samples_per_token⌉`` tokens per clip."""
    counts_A = (lengths_A + samples_per_token - 1) // samples_per_token
    return torch.arange(num_tokens, device=lengths_A.device)[None, :] < counts_A[:, None]


__all__ = ["MuseSparkAudioTower", "audio_token_mask"]
