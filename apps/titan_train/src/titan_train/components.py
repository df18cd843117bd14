"""Component overrides: swap modules of a built model, chosen by FQN glob, for named
replacements, without touching the model code.

A recipe lists ``model.overrides = ("output=chunked_cross_entropy",)``. Each replacement
takes over the original module's parameters (the same ``nn.Parameter`` objects), so state
dicts, checkpoints, HF export and the parallel plan see the same FQNs. This is where fused or
alternative kernels plug in.

``chunked_cross_entropy`` replaces the output head with the loss itself: given the step's
labels (``targets``), the head computes the cross-entropy over chunks of rows, each chunk's
logits recomputed in backward (``torch.utils.checkpoint``), so the full (tokens x vocabulary)
logits never exist, forward or backward. Without labels it returns ordinary logits. A head
that maps its raw logits further (``titan_models.components.SoftcapLinear``: Muse Spark's
output multiplier and tanh soft cap) keeps that map, applied to each chunk's logits.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import titan_models

IGNORE_INDEX = -100


class ChunkedCrossEntropyHead(nn.Module):
    """The output head fused with the loss: summed cross-entropy over ``chunk_rows``-row
    chunks while ``targets`` are set, logits otherwise."""

    def __init__(
        self,
        weight: nn.Parameter,
        chunk_rows: int = 1024,
        logit_map: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        """``logit_map``: what the replaced head does to its raw logits ``h Wᵀ`` (a soft cap);
        ``None``: nothing."""
        super().__init__()
        self.weight, self.chunk_rows, self.logit_map = weight, chunk_rows, logit_map
        self._labels: torch.Tensor | None = None

    @contextlib.contextmanager
    def targets(self, labels: torch.Tensor) -> Iterator[None]:
        """Within the block, ``forward`` returns the summed loss against ``labels``."""
        self._labels = labels
        try:
            yield
        finally:
            self._labels = None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self._labels is None:
            logits = F.linear(h, self.weight)
            return self.logit_map(logits) if self.logit_map is not None else logits
        return chunked_cross_entropy_sum(
            h, self.weight, self._labels, self.chunk_rows, logit_map=self.logit_map
        )


def chunked_cross_entropy_sum(
    h: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_rows: int,
    *,
    logit_map: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """``sum CE(map(h @ weight.T), labels)`` (ignoring ``-100``), one chunk of rows at a time;
    each chunk keeps only its input for backward and recomputes its logits there."""
    rows, y = h.reshape(-1, h.shape[-1]), labels.reshape(-1)
    total = torch.zeros((), dtype=torch.float32, device=h.device)
    for h_c, y_c in zip(rows.split(chunk_rows), y.split(chunk_rows), strict=True):
        total = total + checkpoint(_chunk_loss, h_c, weight, y_c, logit_map, use_reentrant=False)
    return total


def _chunk_loss(
    h: torch.Tensor,
    weight: torch.Tensor,
    y: torch.Tensor,
    logit_map: Callable[[torch.Tensor], torch.Tensor] | None,
) -> torch.Tensor:
    logits = F.linear(h, weight)
    if logit_map is not None:
        logits = logit_map(logits)
    return F.cross_entropy(logits.float(), y, ignore_index=IGNORE_INDEX, reduction="sum")


def _chunked_cross_entropy(module: nn.Module) -> nn.Module:
    if not isinstance(module, nn.Linear) or module.bias is not None:
        raise TypeError("needs the bias-free nn.Linear output head")
    if isinstance(module, titan_models.components.SoftcapLinear):  # keep its soft cap
        return ChunkedCrossEntropyHead(module.weight, logit_map=module.cap_logits)
    return ChunkedCrossEntropyHead(module.weight)


REPLACEMENTS: dict[str, Callable[[nn.Module], nn.Module]] = {
    "chunked_cross_entropy": _chunked_cross_entropy,
}
"""Replacement name -> factory building it from the module it replaces."""


def parse_overrides(overrides: tuple[str, ...]) -> list[tuple[str, str]]:
    """``"pattern=name"`` strings as pairs; ``ValueError`` naming the bad entry."""
    pairs = []
    for entry in overrides:
        pattern, sep, name = entry.partition("=")
        if not sep or not pattern or not name:
            raise ValueError(
                f"model.overrides entry {entry!r} must read 'module-glob=replacement' "
                "(e.g. 'output=chunked_cross_entropy')"
            )
        if name not in REPLACEMENTS:
            raise ValueError(
                f"model.overrides entry {entry!r}: unknown replacement {name!r}; known: "
                f"{sorted(REPLACEMENTS)}"
            )
        pairs.append((pattern, name))
    return pairs


def apply_overrides(model: nn.Module, overrides: tuple[str, ...]) -> dict[str, str]:
    """Replace every module matching each glob (``*`` = one FQN segment); returns FQN ->
    replacement. Every check runs before the first module is replaced."""
    pairs = parse_overrides(overrides)
    modules = dict(model.named_modules())
    plan: dict[str, tuple[str, nn.Module]] = {}
    for pattern, name in pairs:
        hits = [f for f in modules if f and titan_models.fqn_matches(pattern, f)]
        if not hits:
            raise ValueError(f"model.overrides {pattern}={name}: the glob matches no module")
        for fqn in hits:
            try:
                plan[fqn] = (name, REPLACEMENTS[name](modules[fqn]))
            except TypeError as e:
                kind = type(modules[fqn]).__name__
                raise ValueError(
                    f"model.overrides {pattern}={name}: cannot replace {fqn!r} ({kind}): {e}"
                ) from None
    for fqn, (_, new) in plan.items():
        parent, _, attr = fqn.rpartition(".")
        setattr(model.get_submodule(parent), attr, new)
    return {fqn: name for fqn, (name, _) in plan.items()}


def loss_head(model: nn.Module) -> ChunkedCrossEntropyHead | None:
    """The model's loss-computing head, if an override installed one."""
    head = getattr(model, "output", None)
    return head if isinstance(head, ChunkedCrossEntropyHead) else None
