"""Vision transformer blocks: pre-norm LayerNorm blocks of bidirectional attention with 2-D
rotary positions and a GELU MLP, over the patches of every image of a batch at once.

The images of a batch are concatenated into one row of ``N`` patches and attend through the
attention interface (``attend``) with a bidirectional ``AttentionMetadata`` in which every
image (every frame of a video) is one document: a patch sees every patch of its own image and
nothing of the others, whichever backend runs (varlen tiles / flash varlen, FlexAttention,
dense SDPA). ``vision_attention_metadata`` builds it from the patch grids.

The fused ``wqkv`` projection holds each head's q, k and v rows together (``(H, 3, E)`` row
order), so a column-wise tensor-parallel split hands every rank whole heads; the head count is
read off the projection at run time.

Shapes: N patches, D width, H heads, E head dim, F MLP hidden width.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..attention_metadata import AttentionMetadata
from ..backends import attend, prepare_attention, resolve_attention_backend
from ..init import ONES, Constant, Init, Normal, prefixed
from ..rope import apply_rotary

_ACTIVATIONS = {
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
}


def vision_activation(name: str):
    """The MLP activation called ``name`` in HF vision configs; ``ValueError`` otherwise."""
    if name not in _ACTIVATIONS:
        raise ValueError(
            f"vision hidden_act={name!r} is not supported; known: {sorted(_ACTIVATIONS)}"
        )
    return _ACTIVATIONS[name]


def layer_norm_init(norm: nn.LayerNorm) -> dict[str, Init]:
    """A LayerNorm's identity start: weight one, bias zero."""
    inits: dict[str, Init] = {"weight": ONES}
    if norm.bias is not None:
        inits["bias"] = Constant(0.0)
    return inits


def linear_init(linear: nn.Linear, std: float) -> dict[str, Init]:
    """Normal ``std`` weight, zero bias."""
    inits: dict[str, Init] = {"weight": Normal(std)}
    if linear.bias is not None:
        inits["bias"] = Constant(0.0)
    return inits


def vision_attention_metadata(
    grids: Sequence[Sequence[int]], device: torch.device | str, *, backend: str = "auto"
) -> AttentionMetadata:
    """Bidirectional metadata over the concatenated patches of ``grids`` (``(t, h, w)`` per
    image): every frame of every image one document of ``h·w`` patches."""
    lengths = [int(h) * int(w) for t, h, w in grids for _ in range(int(t))]
    name = resolve_attention_backend(backend, device)
    meta = AttentionMetadata.from_lengths(
        [lengths], sum(lengths), device, backend=name, bidirectional=True
    )
    prepare_attention(meta, (None,))
    return meta


class VisionAttention(nn.Module):
    """Bidirectional multi-head attention with a fused, biased ``wqkv`` and 2-D RoPE."""

    def __init__(self, *, dim: int, num_heads: int) -> None:
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"vision dim={dim} must be a multiple of num_heads={num_heads}")
        self.head_dim = dim // num_heads
        self.backend: str | None = None
        """This layer's attention backend instead of the run's (``None``: the run's)."""
        self.wqkv = nn.Linear(dim, 3 * dim, bias=True)
        self.wo = nn.Linear(dim, dim, bias=True)

    def forward(
        self,
        x_BND: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        B, N, _ = x_BND.shape
        q, k, v = self.wqkv(x_BND).view(B, N, -1, 3, self.head_dim).unbind(3)
        q, k = apply_rotary(q, rope), apply_rotary(k, rope)
        o_BNHE = attend(q, k, v, meta, backend=self.backend)
        return self.wo(o_BNHE.reshape(B, N, -1))

    def param_init(self, *, std: float, out_std: float) -> dict[str, Init]:
        """Normal ``std`` for ``wqkv``, ``out_std`` for the residual output ``wo``; biases 0."""
        return prefixed("wqkv", linear_init(self.wqkv, std)) | prefixed(
            "wo", linear_init(self.wo, out_std)
        )


class VisionFeedForward(nn.Module):
    """``w2(act(w1(x)))`` with biases (the ViT MLP)."""

    def __init__(self, *, dim: int, hidden_dim: int, activation: str) -> None:
        super().__init__()
        self.act = vision_activation(activation)
        self.w1 = nn.Linear(dim, hidden_dim, bias=True)
        self.w2 = nn.Linear(hidden_dim, dim, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.act(self.w1(x)))

    def param_init(self, *, std: float, out_std: float) -> dict[str, Init]:
        """Normal ``std`` into the hidden layer, ``out_std`` out of it; biases 0."""
        return prefixed("w1", linear_init(self.w1, std)) | prefixed(
            "w2", linear_init(self.w2, out_std)
        )


class VisionBlock(nn.Module):
    """``h = x + attn(ln(x)); out = h + mlp(ln(h))`` over the patches of a batch."""

    def __init__(
        self, *, dim: int, num_heads: int, hidden_dim: int, norm_eps: float, activation: str
    ) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(dim, eps=norm_eps)
        self.attention = VisionAttention(dim=dim, num_heads=num_heads)
        self.ffn_norm = nn.LayerNorm(dim, eps=norm_eps)
        self.feed_forward = VisionFeedForward(dim=dim, hidden_dim=hidden_dim, activation=activation)

    def forward(
        self,
        x_BND: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        h_BND = x_BND + self.attention(self.attention_norm(x_BND), rope, meta)
        return h_BND + self.feed_forward(self.ffn_norm(h_BND))

    def param_init(self, *, std: float, out_std: float) -> dict[str, Init]:
        inits = prefixed("attention_norm", layer_norm_init(self.attention_norm))
        inits |= prefixed("ffn_norm", layer_norm_init(self.ffn_norm))
        for name in ("attention", "feed_forward"):
            inits |= prefixed(name, getattr(self, name).param_init(std=std, out_std=out_std))
        return inits


class InterpolatedPositionEmbedding(nn.Module):
    """A learned square grid of ``side × side`` position embeddings, resampled bilinearly
    (corners aligned) to each image's patch grid: patch (r, c) of an ``h × w`` grid reads the
    table at ``(r·(side-1)/(h-1), c·(side-1)/(w-1))``."""

    def __init__(self, *, num_embeddings: int, dim: int) -> None:
        super().__init__()
        side = round(num_embeddings**0.5)
        if side * side != num_embeddings:
            raise ValueError(f"num_position_embeddings={num_embeddings} must be a square")
        self.side = side
        self.weight = nn.Parameter(torch.empty(num_embeddings, dim))

    def forward(self, coords_N2: torch.Tensor, sizes_N2: torch.Tensor) -> torch.Tensor:
        """``(N, D)`` embeddings of patches at ``coords`` (row, column) of grids ``sizes``
        (rows, columns of each patch's image)."""
        last = self.side - 1
        scale = torch.where(sizes_N2 > 1, last / (sizes_N2 - 1).clamp(min=1), 0.0)
        at_N2 = coords_N2 * scale  # fractional table coordinates
        low = at_N2.floor().long().clamp(max=last)
        high = (low + 1).clamp(max=last)
        frac = at_N2 - low
        out = 0
        for rows, row_w in ((low[:, 0], 1 - frac[:, 0]), (high[:, 0], frac[:, 0])):
            for cols, col_w in ((low[:, 1], 1 - frac[:, 1]), (high[:, 1], frac[:, 1])):
                weight_N1 = (row_w * col_w)[:, None].to(self.weight.dtype)
                out = out + self.weight[rows * self.side + cols] * weight_N1
        assert isinstance(out, torch.Tensor)  # the four corners added
        return out

    def param_init(self, *, std: float, out_std: float = 0.0) -> dict[str, Init]:
        return {"weight": Normal(std)}
