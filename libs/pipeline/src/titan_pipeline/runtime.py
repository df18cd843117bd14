"""Execute a schedule's action list with torch.distributed point-to-point operations.

Each rank walks its own list in order. A run of consecutive communication actions is one
batch, posted at once (one ``batch_isend_irecv`` where the backend coalesces, as NCCL does;
on gloo, which does not, the same ``isend`` / ``irecv`` calls directly); a receive is waited
for right before the action that consumes it, sends are waited for at the end of the step
(the simulator models exactly this). Stage
modules take one tensor and return one tensor; shapes are fixed for a run and found once by
running each stage on meta tensors, so receive buffers are allocated with static shapes.

Gradient scaling is explicit: microbatch ``i`` backpropagates
``loss_fn(output_i, target_i) * loss_scale`` with ``loss_scale = 1 / num_microbatches`` by
default, so with a mean-reduced ``loss_fn`` and equal microbatches the gradients equal those
of the mean loss over the whole batch. Gradients accumulate into ``param.grad`` like plain
autograd (zero them between steps). Every stage runs its backward (B, or W) in increasing
microbatch order in all built-in schedules, so their gradient sums are bitwise identical.

Backward passes (``stage.py``) go through ``torch.autograd.backward``, so data-parallel
wrappers that reduce gradients from post-accumulate-grad hooks compose with the runtime. Side
inputs every stage needs for a microbatch (positions, document ids, masks) travel as
``stage_kwargs``, not through the pipe.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from titan_pipeline.actions import Action, ActionKind, Schedule
from titan_pipeline.measurement import TimelineRecorder, monotonic_clock
from titan_pipeline.shapes import global_rank, stage_output_meta
from titan_pipeline.simulator import segments
from titan_pipeline.stage import PipelineStage, device_of

__all__ = ["run", "split_microbatches"]

F, B, I, W = ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W  # noqa: E741


def split_microbatches(batch: torch.Tensor, num_microbatches: int) -> list[torch.Tensor]:
    """Split ``batch`` along dim 0 into ``num_microbatches`` equal, contiguous chunks."""
    if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int):
        raise ValueError(f"num_microbatches must be an int, got {num_microbatches!r}")
    if num_microbatches < 1 or batch.shape[0] % num_microbatches:
        raise ValueError(
            f"batch of size {batch.shape[0]} (dim 0) cannot be split into num_microbatches="
            f"{num_microbatches} equal microbatches: it must be a positive divisor of "
            f"{batch.shape[0]}"
        )
    return [c.contiguous() for c in batch.chunk(num_microbatches)]


def run(
    schedule: Schedule,
    stages: Sequence[PipelineStage],
    microbatches: Sequence[torch.Tensor] | None,
    targets: Sequence[torch.Tensor] | None,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    *,
    loss_scale: float | None = None,
    recorder: TimelineRecorder | None = None,
    stage_kwargs: Sequence[dict[str, object]] | None = None,
    forward_only: bool = False,
    before_backward: Callable[[PipelineStage, int], None] | None = None,
    broadcast_losses: bool = False,
    stage_outputs: Sequence[tuple[tuple[int, ...], torch.dtype]] | None = None,
) -> list[torch.Tensor]:
    """Run one step of ``schedule`` on this rank's ``stages``; return the losses.

    ``microbatches`` is needed on the rank of stage 0 and ``targets`` on the rank of the last
    stage (others may pass None). ``stage_kwargs[i]``, if given, is passed as keyword
    arguments to every stage's module for microbatch ``i`` (on every rank). With
    ``forward_only`` (evaluation) each rank runs only the schedule's forward actions and their
    sends / receives, under ``torch.no_grad``, in the schedule's order, and keeps nothing for a
    backward. ``before_backward(stage, microbatch)`` is called before each action that produces
    parameter gradients (B, W); every built-in schedule runs them in increasing microbatch order
    per stage, so a data-parallel wrapper can turn its gradient reduction on for the last
    microbatch only. Returns the detached, unscaled per-microbatch losses on the
    rank of the last stage and ``[]`` elsewhere; with ``broadcast_losses`` every rank gets
    them (one broadcast of ``num_microbatches`` float32 values from the last stage's rank at
    the end of the step: the other ranks get float32 scalars, equal to the losses when those
    are fp32, bf16 or fp16; each loss must then be a scalar). ``stage_outputs``: every
    stage's output (shape, dtype) per microbatch, when the caller knows them; the ranks then
    skip the first run's shape agreement (no collective beyond the schedule's sends and
    receives; bad input raises on the rank that has it). Bad input raises ``ValueError`` on
    every rank before any activation is sent.
    """
    if not stages:
        raise ValueError("stages must list this rank's PipelineStage objects, got none")
    group = stages[0].group
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    if world != schedule.num_ranks:
        raise ValueError(
            f"schedule has num_ranks={schedule.num_ranks} but the process group has {world} ranks"
        )
    local = {st.stage_index: st for st in stages}
    if sorted(local) != schedule.stages_of_rank(rank) or len(local) != len(stages):
        raise ValueError(
            f"rank {rank} was given stages {[st.stage_index for st in stages]} but schedule "
            f"{schedule.name!r} places stages {schedule.stages_of_rank(rank)} on it"
        )
    for st in stages:
        if st.num_stages != schedule.num_stages:
            raise ValueError(
                f"stage {st.stage_index} has num_stages={st.num_stages}; the schedule has "
                f"{schedule.num_stages}"
            )
    m = schedule.num_microbatches
    problem = None
    try:  # checks of data only this rank has: every rank learns the outcome below
        if 0 in local:
            _check_microbatches("microbatches", microbatches, m, same_shape=True)
        if schedule.num_stages - 1 in local:
            _check_microbatches("targets", targets, m, same_shape=False)
        if stage_kwargs is not None and len(stage_kwargs) != m:
            raise ValueError(
                f"stage_kwargs must hold num_microbatches={m} dicts, got {len(stage_kwargs)}"
            )
    except ValueError as e:
        problem = f"rank {rank}: {e}"
    if stage_outputs is None:
        out_meta = stage_output_meta(schedule, local, microbatches, rank, group, problem)
    elif problem is not None:
        raise ValueError(problem)
    elif len(stage_outputs) != schedule.num_stages:
        raise ValueError(
            f"stage_outputs must give the num_stages={schedule.num_stages} stages' outputs, got "
            f"{len(stage_outputs)}"
        )
    else:
        out_meta = [(tuple(shape), dtype) for shape, dtype in stage_outputs]
    scale = 1.0 / m if loss_scale is None else float(loss_scale)
    device = device_of(stages)
    owner = schedule.stage_to_rank
    peer_of = (
        (lambda r: dist.get_global_rank(group, r))
        if group is not None and dist.is_initialized()
        else (lambda r: r)
    )

    coalesce = dist.is_initialized() and dist.get_backend(group) != dist.Backend.GLOO
    handoff: dict[tuple[str, int, int], torch.Tensor] = {}  # values that stay on this rank
    recvs: dict[tuple[str, int, int], tuple[dist.Work, torch.Tensor, Action]] = {}
    sends: list[tuple[dist.Work, torch.Tensor]] = []
    losses: list[torch.Tensor] = []
    if recorder is not None:
        recorder._start(group)

    def value(kind: str, stage: int, mb: int) -> torch.Tensor:
        """The input of an action: received (waited for now) or handed over locally."""
        key = (kind, stage, mb)
        if key in recvs:
            work, buf, action = recvs.pop(key)
            start = time.perf_counter()
            work.wait()
            if recorder is not None:
                recorder._record_wait(action, start, time.perf_counter())
            return buf
        return handoff.pop(key)

    actions = schedule.actions[rank]
    if forward_only:
        keep = (F, ActionKind.SEND_F, ActionKind.RECV_F)
        actions = tuple(a for a in actions if a.kind in keep)
    grad_mode = torch.no_grad() if forward_only else contextlib.nullcontext()
    for seg in segments(actions):
        if isinstance(seg, tuple):
            ops = []
            posted: list[tuple[tuple[str, int, int] | None, torch.Tensor]] = []
            start = monotonic_clock()
            for a in seg:
                s, mb = a.stage, a.microbatch
                if a.kind == ActionKind.SEND_F:
                    t = handoff.pop(("F", s + 1, mb))
                    ops.append(dist.P2POp(dist.isend, t, peer_of(owner[s + 1]), group, 2 * s))
                    posted.append((None, t))
                elif a.kind == ActionKind.SEND_B:
                    t = handoff.pop(("B", s - 1, mb))
                    ops.append(dist.P2POp(dist.isend, t, peer_of(owner[s - 1]), group, 2 * s + 1))
                    posted.append((None, t))
                elif a.kind == ActionKind.RECV_F:
                    shape, dtype = out_meta[s - 1]
                    t = torch.empty(shape, dtype=dtype, device=device)
                    ops.append(dist.P2POp(dist.irecv, t, peer_of(owner[s - 1]), group, 2 * (s - 1)))
                    posted.append((("F", s, mb), t))
                else:
                    shape, dtype = out_meta[s]
                    t = torch.empty(shape, dtype=dtype, device=device)
                    ops.append(
                        dist.P2POp(dist.irecv, t, peer_of(owner[s + 1]), group, 2 * (s + 1) + 1)
                    )
                    posted.append((("B", s, mb), t))
            works = _post(ops, coalesce)
            if len(works) != len(ops):  # NCCL coalesces the batch into one work: share it
                works = list(works[-1:]) * len(ops)
            for (key, t), work, a in zip(posted, works, seg, strict=True):
                if key is None:
                    sends.append((work, t))
                else:
                    recvs[key] = (work, t, a)
            if recorder is not None:
                recorder._record_post(seg, start, monotonic_clock())
            continue

        a = seg
        st, s, mb = local[seg.stage], seg.stage, seg.microbatch
        if a.kind == F:
            if s == 0:
                assert microbatches is not None  # checked on the rank of stage 0
                x = microbatches[mb]
            else:
                x = value("F", s, mb)
            start = monotonic_clock()
            with grad_mode:
                y = st._forward(mb, x, stage_kwargs[mb] if stage_kwargs is not None else {})
                if st.is_last:
                    assert targets is not None  # checked on the rank of the last stage
                    loss = loss_fn(st._outputs[mb], targets[mb])
                    if broadcast_losses and loss.dim() != 0:
                        raise ValueError(
                            "broadcast_losses=True needs loss_fn to return a scalar, got shape "
                            f"{list(loss.shape)} for microbatch {mb}"
                        )
                    st._set_loss(mb, loss * scale)
                    losses.append(loss.detach())
                else:
                    handoff[("F", s + 1, mb)] = y
            if forward_only:  # nothing to keep for a backward
                st._inputs.pop(mb)
                st._outputs.pop(mb)
        elif a.kind in (B, I):
            gy = None if st.is_last else value("B", s, mb)
            if a.kind == B and before_backward is not None:
                before_backward(st, mb)
            start = monotonic_clock()
            gx = st._backward(mb, gy, split=a.kind == I)
            if gx is not None:
                handoff[("B", s - 1, mb)] = gx
        else:
            if before_backward is not None:
                before_backward(st, mb)
            start = monotonic_clock()
            st._backward_weight(mb)
        if recorder is not None:
            recorder._record(a, start, monotonic_clock())

    for work, _ in sends:
        work.wait()
    assert not recvs and not handoff, (sorted(recvs), sorted(handoff))
    if broadcast_losses and schedule.num_ranks > 1 and dist.is_initialized():
        return _broadcast_losses(losses, m, owner[-1], rank, group, device)
    return losses


def _broadcast_losses(
    losses: list[torch.Tensor],
    m: int,
    last_rank: int,
    rank: int,
    group: dist.ProcessGroup | None,
    device: torch.device,
) -> list[torch.Tensor]:
    """The last stage's losses on every rank, in one broadcast of ``m`` float32 values (float32
    holds every fp32, bf16 and fp16 value exactly); the last stage's rank keeps its own."""
    wire = torch.empty(m, dtype=torch.float32, device=device)
    if rank == last_rank:
        torch.stack([loss.to(device=device, dtype=torch.float32) for loss in losses], out=wire)
    dist.broadcast(wire, src=global_rank(last_rank, group), group=group)
    return losses if rank == last_rank else list(wire.unbind())


def _post(ops: list[dist.P2POp], coalesce: bool) -> list[dist.Work]:
    """Post one batch. gloo does not coalesce: ``batch_isend_irecv`` would issue the same
    ``isend`` / ``irecv`` calls one by one after checks that cost ~20 us per batch, so they
    are issued directly; other backends get one ``batch_isend_irecv`` (NCCL: one group)."""
    if coalesce:
        return dist.batch_isend_irecv(ops)
    works = []
    for op in ops:
        work = op.op(op.tensor, op.peer, group=op.group, tag=op.tag)
        assert work is not None  # None only on a rank outside op.group
        works.append(work)
    return works


def _check_microbatches(
    name: str, values: Sequence[torch.Tensor] | None, m: int, *, same_shape: bool
) -> None:
    if values is None or len(values) != m:
        got = "None" if values is None else f"{len(values)} tensors"
        raise ValueError(f"{name} must hold num_microbatches={m} tensors, got {got}")
    if same_shape:
        shapes = {(tuple(v.shape), v.dtype) for v in values}
        if len(shapes) != 1:
            raise ValueError(
                f"{name} must all have one shape and dtype (shapes are static per run), got "
                f"{sorted(map(str, shapes))}"
            )


_MAX_DIMS = 8
