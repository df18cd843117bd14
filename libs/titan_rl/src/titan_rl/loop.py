"""The GRPO loop, synchronous or asynchronous, with one model class for trainer and generator.

Sync: generate step ``s``'s rollouts with the current weights, train on them, push the weights.

Async: a background thread generates rollouts while the trainer trains. Each batch carries the
weight version that produced it; the thread may start batch ``s`` once the weights of version
``s - max_offpolicy_steps`` are out, and the trainer refuses a batch older than that (it never
trains on data more than ``max_offpolicy_steps`` updates stale). After each step the trainer
pushes its weights to the generator in memory (a detached copy handed over between batches, no
disk). With ``max_offpolicy_steps=0`` the thread waits for every push, which reproduces sync
mode bit for bit (same seeds, same weights, same ops).
"""

from __future__ import annotations

import copy
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from .generator import Generator, SamplingParams, TorchGenerator
from .learner import GRPOLearner
from .losses import LossConfig
from .rollout import RolloutBatch, Task, collect_rollouts


@dataclass(kw_only=True, slots=True)
class GRPOConfig:
    """One GRPO run: batch shape, sampling, loss, and the rollout mode."""

    num_prompts: int = 8
    """Prompts per step."""
    group_size: int = 8
    """Responses sampled per prompt (the group of group-relative advantages; >= 2)."""
    sampling: SamplingParams = field(default_factory=lambda: SamplingParams(max_new_tokens=16))
    """How rollouts are sampled (the trainer recomputes log-probs at the same temperature)."""
    loss: LossConfig = field(default_factory=LossConfig)
    """Clipping, aggregation, KL and off-policy correction."""
    normalize_std: bool = True
    """Divide advantages by their group's reward std (GRPO); False gives Dr. GRPO's advantages."""
    mode: Literal["sync", "async"] = "sync"
    """sync: generate, then train; async: a background thread generates ahead."""
    max_offpolicy_steps: int = 1
    """Async: the most optimizer steps a trained batch may lag the trainer's weights."""
    batch_invariant: bool = False
    """Generate and recompute log-probs in batch-invariant mode (bitwise equal log-probs)."""
    num_minibatches: int = 1
    """Optimizer steps per rollout batch (PPO-style reuse; > 1 makes the clip range act)."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this (0 disables clipping)."""
    seed: int = 0
    """Seeds every rollout's sampling."""
    pack_sequences: bool = False
    """The trainer's log-probs over packed rows (``packed_sequence_logprobs``: sequences laid
    end to end with document ids, no padding; titan_models models) instead of right-padded
    rows: the same values (bitwise in batch-invariant mode), less compute on ragged batches."""
    max_row_tokens: int | None = None
    """Packed rows hold at most this many tokens (``None``: the longest sequence's length)."""

    def __post_init__(self) -> None:
        if self.num_prompts < 1:
            raise ValueError(f"GRPOConfig.num_prompts={self.num_prompts} must be >= 1")
        if self.group_size < 2:
            raise ValueError(f"GRPOConfig.group_size={self.group_size} must be >= 2")
        if self.mode not in ("sync", "async"):
            raise ValueError(f"GRPOConfig.mode={self.mode!r} must be 'sync' or 'async'")
        if self.max_offpolicy_steps < 0:
            raise ValueError(
                f"GRPOConfig.max_offpolicy_steps={self.max_offpolicy_steps} must be >= 0"
            )
        if self.sampling.temperature == 0:
            raise ValueError("GRPOConfig.sampling.temperature=0 (greedy) gives no exploration")
        if self.num_minibatches < 1:
            raise ValueError(f"GRPOConfig.num_minibatches={self.num_minibatches} must be >= 1")
        if self.max_row_tokens is not None and self.max_row_tokens < 2:
            raise ValueError(f"GRPOConfig.max_row_tokens={self.max_row_tokens} must be >= 2")
        if self.max_grad_norm < 0:
            raise ValueError(f"GRPOConfig.max_grad_norm={self.max_grad_norm} must be >= 0")


class GRPOTrainer:
    """Trains ``model`` with GRPO on ``task``'s rewards."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        task: Task,
        config: GRPOConfig,
        *,
        generator: Generator | None = None,
        ref_model: nn.Module | None = None,
    ) -> None:
        """``generator``: by default a ``TorchGenerator`` over ``model`` itself (sync) or over
        a copy of it (async, since the trainer changes the weights while it generates).
        ``ref_model``: frozen reference policy, needed when ``config.loss.kl_coef > 0``."""
        self.learner = GRPOLearner(model, optimizer, config, ref_model=ref_model)
        self.model, self.optimizer, self.task, self.config = model, optimizer, task, config
        self.ref_model = ref_model
        if generator is None:
            gen_model = model if config.mode == "sync" else copy.deepcopy(model)
            generator = TorchGenerator(gen_model, batch_invariant=config.batch_invariant)
        self.generator = generator
        self.generator.update_weights(self._weights(), self.version)

    def train(
        self, num_steps: int, *, on_step: Callable[[dict[str, Any]], bool | None] | None = None
    ) -> list[dict[str, Any]]:
        """Run ``num_steps`` steps; returns (and passes to ``on_step``) each step's metrics.

        ``on_step`` returning True stops the run after that step (a time budget, say).
        """
        if num_steps < 1:
            raise ValueError(f"num_steps={num_steps} must be >= 1")
        first = self.version
        steps = range(first, first + num_steps)
        if self.config.mode == "sync":
            batches = (self._collect(s) for s in steps)
            return self._consume(batches, on_step, push=self._push_now)
        worker = _AsyncRollouts(self, steps)
        try:
            return self._consume(worker.batches(), on_step, push=worker.push)
        finally:
            worker.stop()

    def _consume(self, batches, on_step, push) -> list[dict[str, Any]]:
        history = []
        for batch in batches:
            metrics = self.step(batch)
            push(self._weights(), self.version)
            history.append(metrics)
            if on_step is not None and on_step(metrics):
                break
        return history

    def step(self, batch: RolloutBatch) -> dict[str, Any]:
        """One GRPO step on ``batch`` (``num_minibatches`` optimizer steps, one weight version).

        Refuses a batch too stale for the bound (async). The PPO ratio is taken against the
        trainer's log-probs at the start of the step (the proximal policy); the generator's
        log-probs enter through the off-policy correction (``LossConfig.correction``).
        """
        c = self.config
        return self.learner.step(
            batch, max_lag=c.max_offpolicy_steps if c.mode == "async" else None
        )

    @property
    def version(self) -> int:
        """Optimizer steps taken = version of the weights the trainer holds."""
        return self.learner.version

    @version.setter
    def version(self, value: int) -> None:
        self.learner.version = value

    def _collect(self, step: int) -> RolloutBatch:
        c = self.config
        return collect_rollouts(
            self.generator,
            self.task,
            step=step,
            num_prompts=c.num_prompts,
            group_size=c.group_size,
            sampling=c.sampling,
            seed=c.seed,
        )

    def _weights(self) -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in self.model.state_dict().items()}

    def _push_now(self, weights: dict[str, torch.Tensor], version: int) -> None:
        self.generator.update_weights(weights, version)


class _AsyncRollouts:
    """The background rollout thread of async mode and its hand-over of weights and batches."""

    def __init__(self, trainer: GRPOTrainer, steps: range) -> None:
        self.trainer, self.steps = trainer, steps
        self._cond = threading.Condition()
        self._pending: tuple[dict[str, torch.Tensor], int] | None = None
        self._latest = trainer.version  # newest version pushed (applied or pending)
        self._stopped = False
        self._out: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="titan_rl-rollouts", daemon=True)
        self._thread.start()

    def push(self, weights: dict[str, torch.Tensor], version: int) -> None:
        """Hand the trainer's new weights over (copied now: the trainer keeps changing them)."""
        staged = {k: v.clone() for k, v in weights.items()}
        with self._cond:
            self._pending, self._latest = (staged, version), version
            self._cond.notify_all()

    def batches(self):
        """The rollout batches in step order, as the thread produces them."""
        for _ in self.steps:
            item = self._out.get()
            if isinstance(item, BaseException):
                raise RuntimeError("the rollout thread failed") from item
            yield item

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self._thread.join()

    def _run(self) -> None:
        bound = self.trainer.config.max_offpolicy_steps
        try:
            for step in self.steps:
                with self._cond:
                    self._cond.wait_for(lambda s=step: self._stopped or self._latest >= s - bound)
                    if self._stopped:
                        return
                    pending, self._pending = self._pending, None
                if pending is not None:
                    self.trainer.generator.update_weights(*pending)
                self._out.put(self.trainer._collect(step))
        except BaseException as e:  # surfaced to the trainer by batches()
            self._out.put(e)
