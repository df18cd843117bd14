"""Measuring a pipeline: the timeline of a run, and each stage's actions timed alone."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from titan_pipeline.actions import Action, ActionKind, Schedule
from titan_pipeline.shapes import stage_output_meta
from titan_pipeline.simulator import Costs, Interval, Timeline
from titan_pipeline.stage import PipelineStage

__all__ = ["TimelineRecorder", "measure_costs"]

F, B, I, W = ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W  # noqa: E741


_Clock = tuple[float, float]


def monotonic_clock() -> _Clock:
    """Wall time and this thread's CPU time, in seconds."""
    return time.perf_counter(), time.thread_time()


class TimelineRecorder:
    """Collects what ``run`` does on this rank and when: compute actions, the host calls that
    post communication batches, and the waits for received data."""

    def __init__(self) -> None:
        self.intervals: list[Interval] = []
        self.posts: list[Interval] = []
        self.waits: list[Interval] = []
        self._t0 = 0.0
        self._wall0 = 0.0

    def _start(self, group: dist.ProcessGroup | None) -> None:
        if dist.is_initialized():
            dist.barrier(group=group)
        # Times are kept relative to this rank's start; the wall clock read with it aligns
        # the ranks in ``gather`` (exactly on one host, where every process reads the same
        # clocks; a barrier alone leaves its exit skew, up to a scheduler slice when loaded).
        self._t0, self._wall0 = time.perf_counter(), time.time()
        self.intervals, self.posts, self.waits = [], [], []

    def _interval(self, action: Action, start: _Clock, end: _Clock) -> Interval:
        return Interval(action, start[0] - self._t0, end[0] - self._t0, end[1] - start[1])

    def _record(self, action: Action, start: _Clock, end: _Clock) -> None:
        self.intervals.append(self._interval(action, start, end))

    def _record_post(self, actions: Sequence[Action], start: _Clock, end: _Clock) -> None:
        self.posts.extend(self._interval(a, start, end) for a in actions)

    def _record_wait(self, action: Action, start: float, end: float) -> None:
        self.waits.append(Interval(action, start - self._t0, end - self._t0))

    def gather(self, group: dist.ProcessGroup | None = None) -> Timeline:
        """The measured timeline of all ranks (a collective: call it on every rank)."""
        mine = (self._wall0, self.intervals, self.posts, self.waits)
        every: list[Any]  # one ``mine`` per rank
        if not dist.is_initialized():
            every = [mine]
        else:
            every = [None] * dist.get_world_size(group)
            dist.all_gather_object(every, mine, group=group)
        first = min(e[0] for e in every)

        def shifted(i: int) -> tuple[tuple[Interval, ...], ...]:
            return tuple(
                tuple(
                    Interval(iv.action, iv.start + e[0] - first, iv.end + e[0] - first, iv.cpu)
                    for iv in e[i]
                )
                for e in every
            )

        return Timeline(shifted(1), shifted(2), shifted(3))


def measure_costs(
    schedule: Schedule,
    stages: Sequence[PipelineStage],
    microbatch: torch.Tensor,
    target: torch.Tensor,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    *,
    repeats: int = 5,
) -> Costs:
    """Each stage's F, B, I and W time alone: the costs of ``simulate`` (a collective).

    Rank by rank, while the other ranks wait in a barrier, each of this rank's stages runs
    ``repeats`` times F then B, and F then I then W, on one microbatch shaped like
    ``microbatch`` (stage 0 gets it, later stages random inputs of the shape they receive;
    the last stage's loss is ``loss_fn(output, target)``). The minimum of each is kept:
    other jobs on the machine only ever add time, and a median of a few repeats was seen to
    read 2-4x the idle time on a loaded machine. The parameters' ``.grad`` are restored
    afterwards (hooks on gradient accumulation do fire). Returns per-stage costs for all
    stages, the same on every rank.
    """
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")
    group = stages[0].group if stages else None
    distributed = dist.is_initialized()
    rank = dist.get_rank(group) if distributed else 0
    world = dist.get_world_size(group) if distributed else 1
    local = {st.stage_index: st for st in stages}
    if sorted(local) != schedule.stages_of_rank(rank):
        raise ValueError(
            f"rank {rank} was given stages {sorted(local)} but schedule {schedule.name!r} places "
            f"stages {schedule.stages_of_rank(rank)} on it"
        )
    metas = stage_output_meta(schedule, local, [microbatch], rank, group, None)
    mine: dict[int, dict[ActionKind, float]] = {}
    for turn in range(world):
        if distributed:
            dist.barrier(group=group)
        if turn == rank:
            mine = {
                s: _time_alone(st, metas, microbatch, target, loss_fn, repeats)
                for s, st in local.items()
            }
    every: list[Any] = [mine]  # one ``mine`` per rank
    if distributed:
        every = [None] * world
        dist.all_gather_object(every, mine, group=group)
    took = {s: kinds for e in every for s, kinds in e.items()}

    def per_stage(kind: ActionKind) -> tuple[float, ...]:
        return tuple(took[s][kind] for s in range(schedule.num_stages))

    return Costs(
        forward=per_stage(F),
        backward=per_stage(B),
        backward_input=per_stage(I),
        backward_weight=per_stage(W),
    )


def _time_alone(
    stage: PipelineStage,
    metas: list[tuple[tuple[int, ...], torch.dtype]],
    microbatch: torch.Tensor,
    target: torch.Tensor,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    repeats: int,
) -> dict[ActionKind, float]:
    s = stage.stage_index
    saved = [p.grad for p in stage._params]
    times: dict[ActionKind, list[float]] = {F: [], B: [], I: [], W: []}
    mb = -1  # a key no real microbatch uses
    try:
        for _ in range(repeats):
            for split in (False, True):
                if s == 0:
                    x = microbatch
                else:
                    shape, dtype = metas[s - 1]
                    x = torch.randn(shape, device=microbatch.device).to(dtype)
                t0 = time.perf_counter()
                y = stage._forward(mb, x, {})
                if stage.is_last:
                    stage._set_loss(mb, loss_fn(stage._outputs[mb], target))
                t1 = time.perf_counter()
                gy = None if stage.is_last else torch.randn_like(y)
                stage._backward(mb, gy, split=split)
                t2 = time.perf_counter()
                times[F].append(t1 - t0)
                if split:
                    stage._backward_weight(mb)
                    times[I].append(t2 - t1)
                    times[W].append(time.perf_counter() - t2)
                else:
                    times[B].append(t2 - t1)
    finally:
        for p, g in zip(stage._params, saved, strict=True):
            p.grad = g
    return {k: min(v) for k, v in times.items()}
