"""Placements, buckets and mixed-precision policy: the user-facing configuration objects."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from flexshard.fqn import fqn_matches

__all__ = [
    "BlockShard",
    "Bucket",
    "MixedPrecision",
    "Owned",
    "Placement",
    "Replicate",
    "Shard",
]


class Placement:
    """Base class of the four placements; see :class:`Shard`, :class:`Replicate`,
    :class:`Owned` and :class:`BlockShard`."""

    __slots__ = ()


@dataclass(frozen=True)
class Shard(Placement):
    """Every rank holds a contiguous slice of each parameter along ``dim`` (rows for 0,
    columns for 1, negative dims count from the end). Sizes that do not divide by the world
    size are padded internally: rank ``r`` holds indices ``[r*c, min((r+1)*c, n))`` with
    ``c = ceil(n / world)`` (possibly empty). Gradients are reduce-scattered."""

    dim: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.dim, bool) or not isinstance(self.dim, int):
            raise ValueError(f"Shard.dim must be an int, got {self.dim!r}")


@dataclass(frozen=True)
class Replicate(Placement):
    """Every rank holds the whole parameter; gradients are all-reduced (plain DDP)."""


@dataclass(frozen=True)
class Owned(Placement):
    """One rank (the owner) holds the whole parameter; the others hold an empty tensor.

    Owners are assigned greedily (largest first, to the least-loaded rank) over every
    ``Owned`` parameter of one :func:`flexshard.shard` call, balancing ``"bytes"`` (default)
    or ``"flops"`` (the cost of a Newton–Schulz orthogonalisation of the matrix), unless
    ``owner`` pins every parameter of the bucket to that rank of the mesh. Forward gathers by
    broadcast from the owner; backward reduces gradients to the owner.
    """

    balance: Literal["bytes", "flops"] = "bytes"
    owner: int | None = None

    def __post_init__(self) -> None:
        if self.balance not in ("bytes", "flops"):
            raise ValueError(f"Owned.balance must be 'bytes' or 'flops', got {self.balance!r}")
        if self.owner is not None and (
            isinstance(self.owner, bool) or not isinstance(self.owner, int) or self.owner < 0
        ):
            raise ValueError(f"Owned.owner must be None or a rank >= 0, got {self.owner!r}")


@dataclass(frozen=True)
class BlockShard(Placement):
    """2-D parameters cut into ``block=(r, c)`` tiles, dealt round-robin to the ranks over
    the whole bucket (so every rank holds the same number of tiles, +-1). Shard boundaries
    are tile boundaries, which is what per-block FP8 quantisation needs. The local
    parameter on a rank has shape ``(n_tiles_here, r, c)``."""

    block: tuple[int, int] = (128, 128)

    def __post_init__(self) -> None:
        b = self.block
        if (
            not isinstance(b, (tuple, list))
            or len(b) != 2
            or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in b)
        ):
            raise ValueError(f"BlockShard.block must be two ints >= 1, got {b!r}")
        object.__setattr__(self, "block", (int(b[0]), int(b[1])))


Match = (
    str
    | nn.Module
    | torch.Tensor
    | Callable[[str, nn.Parameter], bool]
    | Sequence["str | nn.Module | torch.Tensor"]
)


@dataclass
class Bucket:
    """A group of parameters sharing one placement and one gather/reduce.

    ``match`` selects parameters by fully qualified name glob (``fqn_matches``: ``*`` stays
    inside one dotted segment, a ``**`` segment spans any number: ``"layers.0.**"``), by module
    (all parameters below it), by the parameter tensors themselves, by a list of any of these,
    or by a predicate ``(fqn, param) -> bool``.
    ``quantize="fp8_block"`` (``BlockShard`` only) gathers float8-e4m3 tiles with one fp32
    scale per tile; ``"fp8_block_pow2"`` rounds those scales up to powers of two (exact to
    re-quantise into MXFP8 or other power-of-two formats; see ``flexshard.fp8``).
    """

    match: Any
    placement: Placement = field(default_factory=Shard)
    quantize: Literal["fp8_block", "fp8_block_pow2"] | None = None
    name: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.match, str):
            try:
                fqn_matches(self.match, "")
            except ValueError as e:
                raise ValueError(f"Bucket.match: {e}") from None
        if not isinstance(self.placement, Placement):
            raise ValueError(
                f"Bucket.placement must be Shard(dim), Replicate(), Owned() or "
                f"BlockShard(block), got {self.placement!r}"
            )
        if self.quantize not in (None, "fp8_block", "fp8_block_pow2"):
            raise ValueError(
                "Bucket.quantize must be None, 'fp8_block' or 'fp8_block_pow2', got "
                f"{self.quantize!r}"
            )
        if self.quantize is not None and not isinstance(self.placement, BlockShard):
            raise ValueError(
                f"Bucket.quantize={self.quantize!r} needs a BlockShard placement (scales are per "
                f"tile), got {self.placement!r}"
            )


@dataclass(frozen=True)
class MixedPrecision:
    """``param_dtype``: dtype of gathered parameters used by forward/backward (the sharded
    master copy keeps its own dtype). ``reduce_dtype``: dtype gradients are reduced in
    (default: ``param_dtype``, or the master dtype). ``cast_forward_inputs``: cast floating
    point inputs of the root module's forward to ``param_dtype``."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, torch.dtype) or not v.is_floating_point):
                raise ValueError(
                    f"MixedPrecision.{name} must be a floating dtype or None, got {v!r}"
                )
