"""Rotary positions of vision-language models: 2-D (row, column) rotary embedding for the
patches of a vision encoder, and multimodal RoPE (M-RoPE) for the text decoder, whose
positions have three axes (time / text order, height, width).

Both produce the ``(cos, sin)`` tables of ``components.rope`` (rotate-half layout, the sign of
the rotation in ``sin``), so ``apply_rotary`` rotates queries and keys as in any other layer.

- 2-D (Qwen2/2.5/3-VL vision towers): the first half of a head's frequencies turn with the
  patch's row, the second half with its column (``head_dim / 4`` frequencies each, base
  ``theta``).
- M-RoPE (Qwen2-VL and later): each of the ``head_dim / 2`` frequencies reads one of the
  three position axes. ``sections = (t, h, w)`` (summing to ``head_dim / 2``) says how many
  frequencies each axis gets; *interleaved* (Qwen3-VL) deals them round-robin (frequency
  ``3j + 1`` reads height for ``j < h``, ``3j + 2`` width for ``j < w``, every other one time),
  *chunked* (Qwen2-VL) gives each axis one contiguous run. A text token has the same value on the three axes, so on text M-RoPE equals
  plain RoPE; an image's tokens share the time value and count rows and columns from it.

``multimodal_positions`` derives the 3-axis positions of a token sequence from where its
image placeholders are (one run of ``t·(h/m)·(w/m)`` placeholders per image of patch grid
``(t, h, w)``, ``m`` the merge size); after an image, text resumes at the image's start plus
``max(h, w) / m``.

Shapes: B batch, S sequence, N patches, E head dim, d = E / 2 frequencies.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from ..rope import RopeConfig, rope_frequencies


def _tables(freqs: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` of angles ``(..., d)`` in the rotate-half layout, ``(..., 1, 2d)``."""
    cos, sin = freqs.cos(), freqs.sin()
    cos, sin = torch.cat([cos, cos], -1), torch.cat([-sin, sin], -1)
    return cos.to(dtype).unsqueeze(-2), sin.to(dtype).unsqueeze(-2)


class VisionRotaryEmbedding:
    """2-D rotary tables of patches from their (row, column) in the patch grid; a plain
    object (no parameters, no buffers)."""

    def __init__(self, head_dim: int, *, theta: float = 10_000.0) -> None:
        if head_dim % 4:
            raise ValueError(f"2-D rotary head_dim must be a multiple of 4, got {head_dim}")
        self.head_dim = head_dim
        self.theta = theta

    def __call__(
        self, coords_N2: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` of shape ``(1, N, 1, E)`` for integer ``(row, column)`` per patch."""
        quarter = self.head_dim // 2
        exponents = torch.arange(0, quarter, 2, device=coords_N2.device).float() / quarter
        inv_freq = 1.0 / (self.theta**exponents)
        freqs_N2f = coords_N2[..., None].float() * inv_freq
        return _tables(freqs_N2f.flatten(-2)[None], dtype)


class MultimodalRotaryEmbedding:
    """M-RoPE tables for 3-axis positions ``(3, B, S)`` (see the module docstring); a plain
    object, frequencies cached per device."""

    def __init__(
        self,
        rope: RopeConfig,
        head_dim: int,
        sections: Sequence[int],
        *,
        interleaved: bool = True,
    ) -> None:
        sections = tuple(sections)
        if len(sections) != 3 or any(s < 0 for s in sections) or sum(sections) != head_dim // 2:
            raise ValueError(
                f"M-RoPE sections {sections} must be three counts (time, height, width) "
                f"summing to head_dim / 2 = {head_dim // 2}"
            )
        self.rope, self.head_dim, self.sections = rope, head_dim, sections
        self.interleaved = interleaved
        self._tables: dict[torch.device, tuple[torch.Tensor, float, torch.Tensor]] = {}

    def axis_of_frequency(self, device: torch.device | str | None = None) -> torch.Tensor:
        """``(d,)`` which position axis (0 time, 1 height, 2 width) each frequency reads."""
        d = sum(self.sections)
        if not self.interleaved:
            return torch.repeat_interleave(
                torch.arange(3, device=device), torch.tensor(self.sections, device=device)
            )
        axes = torch.zeros(d, dtype=torch.long, device=device)
        for axis in (1, 2):  # round-robin: frequency 3j + axis while the axis has some left
            axes[axis : 3 * self.sections[axis] : 3] = axis
        return axes

    def __call__(
        self, positions_3BS: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` tables ``(B, S, 1, E)``."""
        device = positions_3BS.device
        if device not in self._tables:
            inv_freq, scale = rope_frequencies(self.rope, self.head_dim, device)
            self._tables[device] = (inv_freq, scale, self.axis_of_frequency(device))
        inv_freq, scale, axes = self._tables[device]
        positions_BSd = positions_3BS.permute(1, 2, 0)[..., axes]
        freqs_BSd = positions_BSd.float() * inv_freq
        cos, sin = _tables(freqs_BSd, dtype)
        return (cos * scale, sin * scale) if scale != 1.0 else (cos, sin)


def multimodal_positions(
    tokens: Sequence[int] | torch.Tensor,
    image_grids: Sequence[Sequence[int]],
    *,
    image_token_id: int,
    spatial_merge_size: int,
    start: int = 0,
) -> tuple[torch.Tensor, int]:
    """3-axis positions ``(3, L)`` of one token sequence (on the host) and the position the
    next token would take.

    ``image_grids``: the patch grid ``(t, h, w)`` of each image whose placeholders appear in
    ``tokens``, in order; each image is one run of ``t·(h/m)·(w/m)`` placeholder tokens.
    ``ValueError`` when placeholders and grids disagree (a run cut short, placeholders left
    over, grids left over).
    """
    ids = torch.as_tensor(tokens, dtype=torch.long).flatten()
    m = spatial_merge_size
    is_image = (ids == image_token_id).tolist()
    out = torch.empty(3, len(is_image), dtype=torch.long)
    pos, i, grid_index = start, 0, 0
    while i < len(is_image):
        if not is_image[i]:
            j = i
            while j < len(is_image) and not is_image[j]:
                j += 1
            out[:, i:j] = torch.arange(pos, pos + j - i)
            pos, i = pos + j - i, j
            continue
        if grid_index == len(image_grids):
            raise ValueError(
                f"image placeholder tokens at position {i} but only {len(image_grids)} image "
                "grid(s) were given: placeholders and images disagree"
            )
        t, h, w = (int(x) for x in image_grids[grid_index])
        if h % m or w % m:
            raise ValueError(f"image grid {(t, h, w)} is not divisible by the merge size {m}")
        n = t * (h // m) * (w // m)
        run = is_image[i : i + n]
        if len(run) < n or not all(run):
            got = next((k for k, x in enumerate(run) if not x), len(run))
            raise ValueError(
                f"image {grid_index} (grid {(t, h, w)}) needs {n} placeholder tokens from "
                f"position {i}, found {got}: placeholders and images disagree"
            )
        tt, hh, ww = torch.meshgrid(
            torch.arange(t), torch.arange(h // m), torch.arange(w // m), indexing="ij"
        )
        out[:, i : i + n] = torch.stack([tt, hh, ww]).flatten(1) + pos
        pos += max(h, w) // m
        i, grid_index = i + n, grid_index + 1
    if grid_index != len(image_grids):
        raise ValueError(
            f"{len(image_grids)} image grid(s) given but placeholders for {grid_index}: "
            "placeholders and images disagree"
        )
    return out, pos


def patch_coordinates(grid_thw: Sequence[int], spatial_merge_size: int) -> torch.Tensor:
    """``(t·h·w, 2)`` (row, column) of every patch of one image in the order image processors
    emit them: frames, then ``m × m`` merge blocks row by row, then the patches inside a block
    (so a patch merger sees each block's patches consecutively)."""
    t, h, w = (int(x) for x in grid_thw)
    m = spatial_merge_size
    rows = torch.arange(h).view(h // m, 1, m, 1).expand(h // m, w // m, m, m)
    cols = torch.arange(w).view(1, w // m, 1, m).expand(h // m, w // m, m, m)
    coords = torch.stack([rows.flatten(), cols.flatten()], dim=-1)
    return coords.repeat(t, 1)


def batch_multimodal_positions(
    tokens_BS: torch.Tensor,
    image_grids: Sequence[Sequence[int]],
    *,
    image_token_id: int,
    spatial_merge_size: int,
    document_ids: torch.Tensor | None = None,
    lengths: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``multimodal_positions`` of every row (and every packed document: positions restart
    in each), on the host: ``(3, B, S)`` positions and, per row, ``next - length`` of its last
    document (what later tokens add to their plain position; 0 without images).

    ``image_grids`` are consumed in row-major order of the placeholders. ``lengths``: real
    tokens per row (right padding gets plain positions). Reads the tokens on the host.
    """
    ids = tokens_BS.detach().to("cpu")
    B, S = ids.shape
    docs = None if document_ids is None else document_ids.detach().to("cpu")
    real = [S] * B if lengths is None else [int(n) for n in lengths.tolist()]
    out = torch.arange(S).expand(3, B, S).clone()
    offsets = torch.zeros(B, dtype=torch.long)
    grids = [tuple(int(x) for x in g) for g in image_grids]
    m = spatial_merge_size
    used = 0
    for b in range(B):
        cuts = [0, real[b]]
        if docs is not None:
            change = (docs[b, 1 : real[b]] != docs[b, : real[b] - 1]).nonzero().flatten() + 1
            cuts = [0, *change.tolist(), real[b]]
        for lo, hi in itertools.pairwise(cuts):
            need, mine = int((ids[b, lo:hi] == image_token_id).sum()), []
            while need > 0 and used < len(grids):
                t, h, w = grids[used]
                need -= t * (h // m) * (w // m)
                mine.append(grids[used])
                used += 1
            positions, next_pos = multimodal_positions(
                ids[b, lo:hi], mine, image_token_id=image_token_id, spatial_merge_size=m
            )
            out[:, b, lo:hi] = positions
            offsets[b] = next_pos - (hi - lo)
    if used != len(grids):
        raise ValueError(
            f"{len(grids)} image grid(s) given but the batch has placeholders for {used}: "
            "placeholders and images disagree"
        )
    return out, offsets
