"""The RL controller: independent loops joined by a work buffer that bounds policy lag.

Loops (threads of the controller process; the heavy work runs where the policy and the
generators live: this process, or Monarch actors):

- **data**: issues ``RolloutRequest``s in step order (the data position), skipping groups a
  resumed buffer already holds;
- **rollout** (``rollout_workers`` of them): wait for the request's step to be admitted
  (``WorkBuffer.admit``: weights of version ``step - K`` are out), call the rollout source
  with the router, put the groups into the buffer;
- **pack + update** (the caller's thread): take step ``s``'s groups, pack them into one
  batch, train (version ``s`` -> ``s + 1``), publish the new weights;
- **publication**: send the weights to every replica (a load queued after everything already
  sent to it) and open the gate for the steps they admit.

With ``K = max_offpolicy_steps`` (0 in ``mode="sync"``), step ``s`` is trained at version
``s`` on rollouts of versions ``>= s - K``: ``policy_lag_max <= K`` on every batch, and K = 0
is the synchronous loop (same prompts, seeds, weights and ops as ``GRPOTrainer``).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from .buffer import RolloutRequest, StoppedError, WorkBuffer, pack_groups
from .generator import Generator
from .learner import GRPOLearner
from .loop import GRPOConfig
from .rollout import RolloutBatch
from .router import LocalReplica, Router
from .workers import RolloutSource

log = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class DataflowConfig:
    """How rollout work is cut and how much of it runs at once."""

    groups_per_request: int = 1
    """Groups (prompts) per rollout request; must divide ``num_prompts``."""
    rollout_workers: int = 2
    """Requests in flight at once (a few per generator replica keeps each one busy)."""

    def __post_init__(self) -> None:
        if self.groups_per_request < 1:
            raise ValueError(
                f"DataflowConfig.groups_per_request={self.groups_per_request} must be >= 1"
            )
        if self.rollout_workers < 1:
            raise ValueError(f"DataflowConfig.rollout_workers={self.rollout_workers} must be >= 1")


class Policy(Protocol):
    """The trainer side as the controller sees it (one process, or a trainer mesh)."""

    version: int
    reuses_slots: bool
    """True when publishing ``v`` overwrites what ``v - 2`` published (shared memory)."""

    def train(self, batch: RolloutBatch, max_lag: int) -> dict[str, Any]:
        """One GRPO step on ``batch`` (refusing a lag above ``max_lag``); its metrics."""
        ...

    def publish(self, version: int) -> Any:
        """The current weights, as ``Router.publish`` passes them to the replicas."""
        ...


class LocalPolicy:
    """A ``GRPOLearner`` in this process; publishes a detached copy of its weights."""

    reuses_slots = False

    def __init__(self, learner: GRPOLearner) -> None:
        self.learner = learner

    @property
    def version(self) -> int:
        return self.learner.version

    def train(self, batch: RolloutBatch, max_lag: int) -> dict[str, Any]:
        return self.learner.step(batch, max_lag=max_lag)

    def publish(self, version: int) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.learner.model.state_dict().items()}


class Timeline:
    """Busy intervals of every loop and replica, in seconds since the run started (data)."""

    def __init__(self) -> None:
        self.origin = time.time()
        self.intervals: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    def record(self, lane: str, start: float, end: float, what: str) -> None:
        """``start``/``end``: ``time.time()`` values."""
        item = {"lane": lane, "start": start - self.origin, "end": end - self.origin, "what": what}
        with self._lock:
            self.intervals.append(item)


class Controller:
    """Runs GRPO as independent loops (see the module docstring)."""

    def __init__(
        self,
        policy: Policy,
        generator: Router | Generator,
        source: RolloutSource,
        config: GRPOConfig,
        dataflow: DataflowConfig | None = None,
    ) -> None:
        """``generator``: a ``Router`` over replicas, or one ``Generator`` (wrapped in a
        one-replica router). ``source(generator, request)``: the rollouts of a request."""
        self.dataflow = dataflow or DataflowConfig()
        if config.num_prompts % self.dataflow.groups_per_request:
            raise ValueError(
                f"DataflowConfig.groups_per_request={self.dataflow.groups_per_request} must "
                f"divide GRPOConfig.num_prompts={config.num_prompts}"
            )
        if not callable(source):
            raise TypeError(
                f"source must be a callable (generator, request) -> RolloutBatch, got {source!r}"
            )
        self.policy, self.source, self.config = policy, source, config
        self.timeline = Timeline()
        if not isinstance(generator, Router):
            generator = Router([LocalReplica(generator)], on_interval=self.timeline.record)
        elif generator.on_interval is None:
            generator.on_interval = self.timeline.record
        self.router = generator
        self.max_lag = config.max_offpolicy_steps if config.mode == "async" else 0
        self.buffer = WorkBuffer(
            num_groups=config.num_prompts, max_offpolicy_steps=self.max_lag, version=policy.version
        )
        self._count_lock = threading.Lock()
        self._generated = [0, 0]  # response tokens, rows
        self._errors: list[tuple[str, BaseException]] = []
        self._published = False
        self._last_end = time.time()

    def run(
        self, num_steps: int, *, on_step: Callable[[dict[str, Any]], bool | None] | None = None
    ) -> list[dict[str, Any]]:
        """Train ``num_steps`` steps; returns (and passes to ``on_step``) each step's metrics.
        ``on_step`` returning True stops after that step."""
        if num_steps < 1:
            raise ValueError(f"num_steps={num_steps} must be >= 1")
        first = self.policy.version
        steps = range(first, first + num_steps)
        self.buffer.open()
        stop = threading.Event()
        requests: queue.Queue = queue.Queue(maxsize=self.dataflow.rollout_workers)
        publications: queue.Queue = queue.Queue()
        if self.router.weight_version != first or not self._published:
            self._publish_now(first)
        self._last_end = time.time()
        threads = [
            threading.Thread(
                target=self._guard, args=("data", self._data_loop, steps, requests, stop)
            ),
            threading.Thread(
                target=self._guard, args=("publication", self._publish_loop, publications)
            ),
        ]
        threads += [
            threading.Thread(
                target=self._guard, args=(f"rollout:{i}", self._rollout_loop, i, requests, stop)
            )
            for i in range(self.dataflow.rollout_workers)
        ]
        for t in threads:
            t.daemon = True
            t.start()
        history: list[dict[str, Any]] = []
        try:
            for step in steps:
                metrics = self._update(step, publications)
                history.append(metrics)
                if on_step is not None and on_step(metrics):
                    break
        except StoppedError:
            pass
        finally:
            stop.set()
            self.buffer.close()
            publications.put(None)
            for t in threads:
                t.join()
        if self._errors:
            lane, error = self._errors[0]
            raise RuntimeError(
                f"the {lane} loop failed: {type(error).__name__}: {error}"
            ) from error
        return history

    def state_dict(self) -> dict[str, Any]:
        """The controller's state between runs: version, data position, finished groups."""
        c = self.config
        return {
            "version": self.policy.version,
            "data_position": self.policy.version * c.num_prompts,
            "buffer": self.buffer.state_dict(),
            "layout": [c.num_prompts, c.group_size, self.dataflow.groups_per_request, c.seed],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from ``state_dict`` (the policy must already hold weights of that version)."""
        c = self.config
        layout = [c.num_prompts, c.group_size, self.dataflow.groups_per_request, c.seed]
        if list(state["layout"]) != layout:
            raise ValueError(
                f"controller state of layout (num_prompts, group_size, groups_per_request, seed)"
                f" = {tuple(state['layout'])} cannot resume a run of {tuple(layout)}"
            )
        if int(state["version"]) != self.policy.version:
            raise ValueError(
                f"controller state is at version {state['version']}, the policy at "
                f"{self.policy.version}: restore the trainer's checkpoint of that step first"
            )
        self.buffer.load_state_dict(state["buffer"])

    # The loops.

    def _guard(self, lane: str, loop: Callable[..., None], *args: Any) -> None:
        try:
            loop(*args)
        except StoppedError:
            pass
        except BaseException as e:  # surfaced by run() after the other loops stop
            log.error("the %s loop failed: %s: %s", lane, type(e).__name__, e)
            self._errors.append((lane, e))
            self.buffer.close()

    def _data_loop(self, steps: range, requests: queue.Queue, stop: threading.Event) -> None:
        c, per = self.config, self.dataflow.groups_per_request
        for step in steps:
            for group in range(0, c.num_prompts, per):
                if self.buffer.has(step, group):
                    continue
                index = step * c.num_prompts + group
                request = RolloutRequest(
                    step=step, group=group, num_groups=per, index=index, seed=c.seed
                )
                if not _put(requests, request, stop):
                    return

    def _rollout_loop(self, worker: int, requests: queue.Queue, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                request = requests.get(timeout=0.05)
            except queue.Empty:
                continue
            self.buffer.admit(request.step)
            start = time.time()
            batch = self.source(self.router, request)
            self.timeline.record(f"rollout:{worker}", start, time.time(), f"step {request.step}")
            self.buffer.put(request, batch)
            with self._count_lock:
                self._generated[0] += int(batch.generation.mask.sum())
                self._generated[1] += len(batch.prompts)

    def _publish_loop(self, publications: queue.Queue) -> None:
        while (item := publications.get()) is not None:
            weights, version = item
            start = time.time()
            self.router.publish(weights, version)
            self.buffer.publish(version)
            self.timeline.record("publication", start, time.time(), f"version {version}")

    def _publish_now(self, version: int) -> None:
        self.router.publish(self.policy.publish(version), version)
        self.buffer.publish(version)
        self._published = True

    def _update(self, step: int, publications: queue.Queue) -> dict[str, Any]:
        wait_start = time.time()
        groups = self.buffer.take(step)
        train_start = time.time()
        self.timeline.record("trainer", wait_start, train_start, "idle")
        batch = pack_groups(step, groups)
        versions = [g.weight_version for g in groups]
        metrics = self.policy.train(batch, self.max_lag)
        train_end = time.time()
        self.timeline.record("trainer", train_start, train_end, f"step {step}")
        version = self.policy.version
        if self.policy.reuses_slots:  # the slot this publication overwrites must be loaded
            self.router.wait_loaded(version - 2)
        weights = self.policy.publish(version)
        end = time.time()
        self.timeline.record("trainer", train_end, end, f"publish {version}")
        publications.put((weights, version))
        with self._count_lock:
            tokens, rows = self._generated
            self._generated = [0, 0]
        interval = max(end - self._last_end, 1e-9)
        self._last_end = end
        trained = sum(len(p) for p in batch.prompts) + int(batch.generation.mask.sum())
        return {
            **metrics,
            "step": step,
            "rollout_versions": versions,
            "policy_lag_max": step - min(versions),
            "policy_lag_mean": step - sum(versions) / len(versions),
            "generator_tokens_per_s": tokens / interval,
            "rollouts_per_s": rows / interval,
            "trainer_tokens_per_s": trained / max(train_end - train_start, 1e-9),
            "trainer_idle_fraction": (train_start - wait_start) / max(end - wait_start, 1e-9),
            "step_time_s": interval,
            "live_replicas": self.router.num_live,
        }


def _put(q: queue.Queue, item: Any, stop: threading.Event) -> bool:
    """Put ``item`` unless ``stop`` is set first (False then)."""
    while not stop.is_set():
        try:
            q.put(item, timeout=0.05)
            return True
        except queue.Full:
            continue
    return False
