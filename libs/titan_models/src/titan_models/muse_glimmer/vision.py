"""The Muse Glimmer vision tower and adapter, from ``components.vision`` pieces.

patches (``T·C·P·P``, two frames of a still image) → ``PatchEmbed`` (no bias) + the learned
``s × s`` position table resampled bilinearly to each image (half-pixel centres, zero
padding: ``grid_sample``'s) → LayerNorm → ``num_layers`` pre-LayerNorm blocks with 2-D RoPE,
bidirectional, over one frame (the ``global_layers``) or inside windows of ``s × s`` patches
(the others) → LayerNorm → pixel shuffle of every ``m × m`` block → ``GELU(w2 GELU(w1 x))``
→ ``projection`` to the text width → RMSNorm without a scale.

Layout, as transformers' (and so the checkpoint's): each image's patches row by row; the
position table is read as if the image were ``w × h`` (the reference passes the grid to
``grid_sample`` as (width, height)): patch ``i`` of a frame takes the ``i``-th entry, row by
row, of the table resampled to ``w`` rows and ``h`` columns (the same as (row, column) for a
square image); the rotary angles turn with ``column + 1`` on the first half of a head's
frequencies and ``row + 1`` on the second. The pixel shuffle concatenates a block's patches
channel-major (feature ``d·m² + k`` is channel ``d`` of patch ``k``). Windowed blocks run on
the patches reordered window by window, so every window (and every frame) is one contiguous
attention document.

Shapes: N patches of the batch, D tower width, E head dim, M merged tokens, P adapter width,
O text width.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from ..components.attention_metadata import AttentionMetadata
from ..components.backends import attend, prepare_attention, resolve_attention_backend
from ..components.init import Init, Normal, prefixed
from ..components.norm import unit_rms
from ..components.rope import apply_rotary
from ..components.vision import PatchEmbed, VisionFeedForward, VisionRotaryEmbedding
from ..components.vision.encoder import layer_norm_init, linear_init, vision_activation
from .config import MuseGlimmerVisionConfig

_BLOCK_NORM_EPS = 1e-5
"""Epsilon of the blocks' LayerNorms (fixed in the reference, whatever the config says)."""


def resample_matrix(size: int, side: int) -> torch.Tensor:
    """``(size, side)`` weights of bilinear resampling from ``side`` to ``size`` points with
    half-pixel centres, a tap outside the table contributing nothing (zero padding)."""
    source = (torch.arange(size, dtype=torch.float32) + 0.5) * side / size - 0.5
    low = source.floor()
    matrix = torch.zeros(size, side)
    for tap, weight in ((low, 1 - (source - low)), (low + 1, source - low)):
        inside = (tap >= 0) & (tap <= side - 1)
        rows = torch.arange(size)[inside]
        matrix.index_put_((rows, tap[inside].long()), weight[inside], accumulate=True)
    return matrix


def window_order(grids: Sequence[Sequence[int]], window: int) -> tuple[list[int], list[int]]:
    """The patches of ``grids`` (row by row per frame) reordered window by window (each
    window's patches row by row), and the windows' sizes."""
    order: list[int] = []
    sizes: list[int] = []
    start = 0
    for t, h, w in grids:
        for _ in range(t):
            for r0 in range(0, h, window):
                for c0 in range(0, w, window):
                    rows, cols = range(r0, min(r0 + window, h)), range(c0, min(c0 + window, w))
                    order += [start + r * w + c for r in rows for c in cols]
                    sizes.append(len(rows) * len(cols))
            start += h * w
    return order, sizes


class VisionSelfAttention(nn.Module):
    """Bidirectional multi-head attention with biased q / k / v / output projections and
    2-D RoPE."""

    def __init__(self, *, dim: int, num_heads: int) -> None:
        super().__init__()
        self.head_dim = dim // num_heads
        self.backend: str | None = None
        """This layer's attention backend instead of the run's (``None``: the run's)."""
        self.wq = nn.Linear(dim, dim)
        self.wk = nn.Linear(dim, dim)
        self.wv = nn.Linear(dim, dim)
        self.wo = nn.Linear(dim, dim)

    def forward(
        self, x_BND: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata
    ) -> torch.Tensor:
        B, N, _ = x_BND.shape
        q, k, v = (
            proj(x_BND).view(B, N, -1, self.head_dim) for proj in (self.wq, self.wk, self.wv)
        )
        q, k = apply_rotary(q, rope), apply_rotary(k, rope)
        return self.wo(attend(q, k, v, meta, backend=self.backend).reshape(B, N, -1))

    def param_init(self, *, std: float, out_std: float) -> dict[str, Init]:
        """Normal ``std`` into the heads, ``out_std`` for the residual ``wo``; biases 0."""
        inits: dict[str, Init] = {}
        for name in ("wq", "wk", "wv"):
            inits |= prefixed(name, linear_init(getattr(self, name), std))
        return inits | prefixed("wo", linear_init(self.wo, out_std))


class VisionEncoderBlock(nn.Module):
    """``h = x + attn(ln(x)); out = h + mlp(ln(h))``."""

    def __init__(self, *, dim: int, num_heads: int, hidden_dim: int, activation: str) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(dim, eps=_BLOCK_NORM_EPS)
        self.attention = VisionSelfAttention(dim=dim, num_heads=num_heads)
        self.ffn_norm = nn.LayerNorm(dim, eps=_BLOCK_NORM_EPS)
        self.feed_forward = VisionFeedForward(dim=dim, hidden_dim=hidden_dim, activation=activation)

    def forward(
        self, x_BND: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata
    ) -> torch.Tensor:
        h_BND = x_BND + self.attention(self.attention_norm(x_BND), rope, meta)
        return h_BND + self.feed_forward(self.ffn_norm(h_BND))

    def param_init(self, *, std: float, out_std: float) -> dict[str, Init]:
        inits = prefixed("attention_norm", layer_norm_init(self.attention_norm))
        inits |= prefixed("ffn_norm", layer_norm_init(self.ffn_norm))
        inits |= prefixed("attention", self.attention.param_init(std=std, out_std=out_std))
        return inits | prefixed(
            "feed_forward", self.feed_forward.param_init(std=std, out_std=out_std)
        )


class VisionAdapter(nn.Module):
    """``GELU(w2 GELU(w1 x))`` on the shuffled blocks, bias-free."""

    def __init__(self, *, in_dim: int, hidden_dim: int, activation: str = "gelu") -> None:
        super().__init__()
        self.act = vision_activation(activation)
        self.w1 = nn.Linear(in_dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.w2(self.act(self.w1(x))))

    def param_init(self, *, std: float, out_std: float = 0.0) -> dict[str, Init]:
        return {"w1.weight": Normal(std), "w2.weight": Normal(std)}


class MuseGlimmerVisionTower(nn.Module):
    """Images → ``(M, O)`` normed tokens, one per ``m × m`` block of each frame (see the
    module docstring)."""

    def __init__(
        self, config: MuseGlimmerVisionConfig, *, out_dim: int, projector_dim: int, norm_eps: float
    ) -> None:
        """``out_dim``: the text width; ``projector_dim``: the adapter's; ``norm_eps``: of
        the final scaleless RMSNorm (the text model's ``rms_norm_eps``)."""
        super().__init__()
        c = self.config = config
        self.out_norm_eps = norm_eps
        self.patch_embed = PatchEmbed(
            dim=c.dim,
            patch_size=c.patch_size,
            temporal_patch_size=c.temporal_patch_size,
            in_channels=c.in_channels,
            bias=False,
        )
        self.pos_embed = nn.Parameter(torch.empty(c.pos_emb_size**2, c.dim))
        self.pre_norm = nn.LayerNorm(c.dim, eps=c.norm_eps)
        self.rope = VisionRotaryEmbedding(c.head_dim, theta=c.rope_theta)
        self.blocks = nn.ModuleList(
            VisionEncoderBlock(
                dim=c.dim,
                num_heads=c.num_heads,
                hidden_dim=c.ffn_hidden_dim,
                activation=c.activation,
            )
            for _ in range(c.num_layers)
        )
        self.post_norm = nn.LayerNorm(c.dim, eps=c.norm_eps)
        self.adapter = VisionAdapter(
            in_dim=c.dim * c.spatial_merge_size**2, hidden_dim=projector_dim
        )
        self.projection = nn.Linear(projector_dim, out_dim, bias=False)

    def forward(
        self, pixel_values: torch.Tensor, grids: Sequence[Sequence[int]], *, backend: str = "auto"
    ) -> torch.Tensor:
        """``(M, O)`` tokens of every image (in ``grids`` order).

        Args:
            pixel_values: ``(N, T·C·P·P)`` patches (or any shape ``(N, ...)`` of them), each
                image's row by row.
            grids: ``(t, h, w)`` patch grid of each image, host ints.
            backend: attention backend (``attention_backends()``) of the blocks.
        """
        c, m = self.config, self.config.spatial_merge_size
        pixels_NP = pixel_values.reshape(pixel_values.shape[0], -1)
        patches = sum(t * h * w for t, h, w in grids)
        if patches != pixels_NP.shape[0]:
            raise ValueError(
                f"pixel_values hold {pixels_NP.shape[0]} patches but image_grid_thw {list(grids)} "
                f"describes {patches}"
            )
        bad = [g for g in grids if g[1] % m or g[2] % m]
        if bad:
            raise ValueError(f"image grid {bad[0]} is not divisible by spatial_merge_size={m}")
        device = pixels_NP.device
        x_ND = self.patch_embed(pixels_NP)
        x_ND = self.pre_norm(x_ND + self._positions(grids).to(x_ND.dtype))
        order, windows = window_order(grids, c.pos_emb_size)
        order_N = torch.tensor(order, device=device)
        coords_N2 = torch.cat(
            [
                torch.stack(torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij"), -1)
                .reshape(h * w, 2)
                .flip(-1)
                .repeat(t, 1)
                for t, h, w in grids
            ]
        )
        # (column + 1, row + 1): the reference's flipped, 1-based patch positions
        rope = self.rope((coords_N2 + 1).to(device)[order_N], x_ND.dtype)
        frames = [h * w for t, h, w in grids for _ in range(t)]
        whole_frames = _bidirectional(frames, device, backend)
        in_windows = _bidirectional(windows, device, backend)
        x_1ND = x_ND[order_N][None]
        for i, block in enumerate(self.blocks):
            x_1ND = block(x_1ND, rope, whole_frames if i in c.global_layers else in_windows)
        x_ND = self.post_norm(x_1ND[0][torch.argsort(order_N)])
        tokens_MP = self.adapter(self._shuffled(x_ND, grids))
        return unit_rms(self.projection(tokens_MP), eps=self.out_norm_eps)

    def _positions(self, grids: Sequence[Sequence[int]]) -> torch.Tensor:
        """``(N, D)`` position embeddings: per distinct ``(h, w)``, the table resampled to
        ``w × h`` and read row by row (see the module docstring)."""
        side = self.config.pos_emb_size
        table = self.pos_embed.view(side, side, -1)
        cache: dict[tuple[int, int], torch.Tensor] = {}
        out = []
        for t, h, w in grids:
            if (h, w) not in cache:
                rows = resample_matrix(w, side).to(table)
                cols = resample_matrix(h, side).to(table)
                cache[(h, w)] = torch.einsum("as,bt,std->abd", rows, cols, table).reshape(h * w, -1)
            out += [cache[(h, w)]] * t
        return torch.cat(out)

    def _shuffled(self, x_ND: torch.Tensor, grids: Sequence[Sequence[int]]) -> torch.Tensor:
        """``(M, D·m²)``: each frame's ``m × m`` blocks, row by row, a block's patches
        concatenated channel-major."""
        m, start, order = self.config.spatial_merge_size, 0, []
        for t, h, w in grids:
            raster = torch.arange(h * w).view(h // m, m, w // m, m).permute(0, 2, 1, 3).flatten()
            order += [raster + start + f * h * w for f in range(t)]
            start += t * h * w
        blocks = x_ND.index_select(0, torch.cat(order).to(x_ND.device))
        return blocks.view(-1, m * m, x_ND.shape[-1]).transpose(1, 2).flatten(1)

    def param_init(self, *, std: float, out_std: float = 0.0) -> dict[str, Init]:
        """Every matrix and the position table Normal ``std``, the blocks' residual outputs
        Normal ``std / √(2·num_layers)``; LayerNorms identity, biases zero."""
        block_out = std / math.sqrt(2 * self.config.num_layers)
        inits = prefixed("patch_embed", self.patch_embed.param_init(std=std))
        inits["pos_embed"] = Normal(std)
        inits |= prefixed("pre_norm", layer_norm_init(self.pre_norm))
        for i, block in enumerate(self.blocks):
            assert isinstance(block, VisionEncoderBlock)
            inits |= prefixed(f"blocks.{i}", block.param_init(std=std, out_std=block_out))
        inits |= prefixed("post_norm", layer_norm_init(self.post_norm))
        inits |= prefixed("adapter", self.adapter.param_init(std=std))
        return inits | prefixed("projection", linear_init(self.projection, std))


def _bidirectional(lengths: list[int], device: torch.device, backend: str) -> AttentionMetadata:
    """One row of bidirectional documents of ``lengths`` patches."""
    name = resolve_attention_backend(backend, device)
    meta = AttentionMetadata.from_lengths(
        [lengths], sum(lengths), device, backend=name, bidirectional=True
    )
    prepare_attention(meta, (None,))
    return meta
