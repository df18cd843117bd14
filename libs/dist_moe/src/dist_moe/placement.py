"""Expert-parallel placement: which experts live on which rank, and how to slice weights.

Placement is contiguous: with ``E`` experts over ``ep`` ranks, rank ``r`` owns experts
``[r * E/ep, (r + 1) * E/ep)``; the dispatchers rely on exactly this layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["ExpertPlacement"]


@dataclass(frozen=True, slots=True)
class ExpertPlacement:
    """The slice of ``num_experts`` experts that rank ``ep_rank`` of ``ep_size`` owns."""

    num_experts: int
    ep_size: int
    ep_rank: int

    def __post_init__(self) -> None:
        for name in ("num_experts", "ep_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"ExpertPlacement.{name} must be an int >= 1, got {v!r}")
        if self.num_experts % self.ep_size:
            raise ValueError(
                f"ExpertPlacement: num_experts={self.num_experts} must be divisible by the "
                f"expert-parallel size ep_size={self.ep_size}"
            )
        if not 0 <= self.ep_rank < self.ep_size:
            raise ValueError(
                f"ExpertPlacement.ep_rank must be in [0, {self.ep_size}), got {self.ep_rank!r}"
            )

    @classmethod
    def from_group(
        cls, num_experts: int, group: dist.ProcessGroup | None = None
    ) -> ExpertPlacement:
        """Placement for this rank of ``group`` (the default group when None); no collective."""
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("ExpertPlacement.from_group needs an initialised process group")
        return cls(
            num_experts=num_experts,
            ep_size=dist.get_world_size(group),
            ep_rank=dist.get_rank(group),
        )

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.ep_size

    @property
    def first_local_expert(self) -> int:
        return self.ep_rank * self.num_local_experts

    @property
    def local_experts(self) -> range:
        """Global ids of the experts on this rank."""
        return range(self.first_local_expert, self.first_local_expert + self.num_local_experts)

    def owner(self, expert: int) -> int:
        """Rank that owns global expert ``expert``."""
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert must be in [0, {self.num_experts}), got {expert!r}")
        return expert // self.num_local_experts

    def shard(self, full_weight: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a full (E, ...) expert tensor (a view; clone to own it)."""
        if full_weight.dim() < 1 or full_weight.shape[0] != self.num_experts:
            raise ValueError(
                f"full_weight must have num_experts={self.num_experts} rows in dim 0, got "
                f"shape {tuple(full_weight.shape)}"
            )
        return full_weight.narrow(0, self.first_local_expert, self.num_local_experts)
