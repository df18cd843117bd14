"""The numerics guard: a run never goes on, or exits 0, after a non-finite loss or gradient.

Losses and gradient norms stay on the device between log steps (no host read per step); the
guard reads them at each log step and before each checkpoint, so a non-finite step stops
the run naming that step and no checkpoint holds weights it touched. With
``training.skip_nonfinite N`` the step itself reads whether its gradient norm is finite (one
host read per step) and skips the update when it is not, up to ``N`` times.
"""

from __future__ import annotations

import math

import torch

from titan_train.errors import NonFiniteError

_HINT = (
    "lower --optimizer.lr or --training.max-grad-norm, check the data, or pass "
    "--training.skip-nonfinite N to skip up to N such steps"
)


class NonFiniteGuard:
    """Collects each step's device loss and gradient norm; ``read()`` returns the losses as
    floats and raises ``NonFiniteError`` at the first non-finite one."""

    def __init__(self, skip_limit: int) -> None:
        self.skip_limit = skip_limit
        self.skipped: list[int] = []
        self._pending: list[tuple[int, torch.Tensor, torch.Tensor, bool]] = []

    @property
    def per_step(self) -> bool:
        """Whether each step checks its own gradient norm (and may skip its update)."""
        return self.skip_limit > 0

    def add(self, step: int, result: object) -> None:
        """Record ``step``'s ``StepResult`` (a skipped step counts against the limit)."""
        skipped = bool(getattr(result, "skipped", False))
        self._pending.append((step, result.loss, result.grad_norm, skipped))  # type: ignore[attr-defined]
        if skipped:
            self.skipped.append(step)
            if len(self.skipped) > self.skip_limit:
                raise NonFiniteError(
                    f"step {step}: the gradient norm is not finite again ({len(self.skipped)} "
                    f"steps skipped: {self.skipped}; training.skip_nonfinite="
                    f"{self.skip_limit}): training stopped; {_HINT}"
                )

    def read(self) -> list[float]:
        """The pending losses on the host (one read), checked."""
        if not self._pending:
            return []
        pending, self._pending = self._pending, []
        values = torch.stack(
            [torch.stack([loss.float(), norm.float()]) for _, loss, norm, _ in pending]
        ).tolist()
        for (step, _, _, skipped), (loss, norm) in zip(pending, values, strict=True):
            if not skipped and not (math.isfinite(loss) and math.isfinite(norm)):
                raise NonFiniteError(
                    f"step {step}: the loss is {loss} and the gradient norm {norm}: training "
                    f"stopped, no checkpoint was written after it; {_HINT}"
                )
        return [loss for loss, _ in values]
