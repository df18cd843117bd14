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

Backward passes go through ``torch.autograd.backward`` (B, and W from the branch points), so
gradients land in ``.grad`` through the parameters' ``AccumulateGrad`` nodes and any
post-accumulate-grad hooks fire: a data-parallel wrapper that reduces gradients from those
hooks (flexshard, FSDP2) composes with the runtime. Side inputs every stage needs for a
microbatch (positions, document ids, masks) travel as ``stage_kwargs``, not through the pipe.

Zero-bubble split: I computes the input gradient with ``retain_graph=True`` and, through
prehooks, keeps the gradients arriving at the autograd nodes where the weight-only branches
leave the input path; W then starts autograd from those nodes (``GradientEdge``) to reach the
parameters without redoing the input path. A stage whose input needs no gradient (the first
stage) does all its work in W.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

from titan_pipeline.actions import Action, ActionKind, Schedule
from titan_pipeline.simulator import Costs, Interval, Timeline, _segments

__all__ = ["PipelineStage", "TimelineRecorder", "measure_costs", "run", "split_microbatches"]

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


@dataclass(slots=True)
class _SplitBackward:
    """What I leaves for W: the root, and the gradients caught at the weight branches."""

    output: torch.Tensor
    grad_output: torch.Tensor
    branches: list[tuple[Node, list[torch.Tensor]]]
    """(node on the input path, the leaves its off-path branches reach)."""
    grads: dict[Node, tuple[torch.Tensor | None, ...]] = field(default_factory=dict)


class PipelineStage:
    """One stage held by this rank: its module and the state of its in-flight microbatches."""

    def __init__(
        self,
        module: nn.Module,
        stage_index: int,
        num_stages: int,
        group: dist.ProcessGroup | None = None,
        *,
        output_spec: Callable[[tuple[int, ...], torch.dtype], tuple[tuple[int, ...], torch.dtype]]
        | None = None,
    ) -> None:
        """``output_spec(input_shape, input_dtype) -> (output_shape, output_dtype)`` replaces
        the meta-device trial forward for modules that cannot run on meta tensors (sharded
        parameters gathered by hooks, DTensors)."""
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        if not isinstance(num_stages, int) or num_stages < 1:
            raise ValueError(f"num_stages must be an int >= 1, got {num_stages!r}")
        if not isinstance(stage_index, int) or not 0 <= stage_index < num_stages:
            raise ValueError(
                f"stage_index must be an int in [0, {num_stages}), got {stage_index!r}"
            )
        self.module = module
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.group = group
        self.output_spec = output_spec
        self._params = [p for p in module.parameters() if p.requires_grad]
        self._inputs: dict[int, torch.Tensor] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self._split: dict[int, _SplitBackward] = {}
        self._shape_cache: dict[object, list[tuple[tuple[int, ...], torch.dtype]]] = {}
        # per stage-to-rank layout, the microbatch (shape, dtype) every rank agreed on last
        self._agreed_shape: dict[tuple[int, ...], tuple[tuple[int, ...], torch.dtype]] = {}

    @property
    def is_first(self) -> bool:
        """True for stage 0."""
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        """True for the last stage (it computes the loss)."""
        return self.stage_index == self.num_stages - 1

    def _forward(self, mb: int, x: torch.Tensor, kwargs: dict[str, object]) -> torch.Tensor:
        if not self.is_first and x.is_floating_point():
            x = x.detach().requires_grad_(True)
        y = self.module(x, **kwargs)
        self._inputs[mb] = x
        self._outputs[mb] = y
        return y.detach()

    def _set_loss(self, mb: int, scaled_loss: torch.Tensor) -> None:
        self._outputs[mb] = scaled_loss

    def _backward(
        self, mb: int, grad_output: torch.Tensor | None, *, split: bool
    ) -> torch.Tensor | None:
        """B (``split=False``) or I: returns the input gradient (None on the first stage)."""
        y = self._outputs.pop(mb)
        gy = torch.ones_like(y) if grad_output is None else grad_output
        x = self._inputs.pop(mb)
        x_grad = x.requires_grad and not self.is_first
        if not split:
            torch.autograd.backward(y, gy)
            return x.grad if x_grad else None
        work = _SplitBackward(y, gy, [])
        self._split[mb] = work
        if not x_grad:
            return None
        x_node = get_gradient_edge(x).node
        work.branches = _weight_branches(y.grad_fn, x_node)
        handles = [n.register_prehook(_catch(work, n)) for n, _ in work.branches]
        try:
            (gx,) = torch.autograd.grad(y, x, gy, retain_graph=True)
        finally:
            for h in handles:
                h.remove()
        return gx

    def _backward_weight(self, mb: int) -> None:
        work = self._split.pop(mb)
        if not self._params:
            return
        complete = bool(work.branches) and all(n in work.grads for n, _ in work.branches)
        if not complete:  # no input path (first stage): one backward from the root
            torch.autograd.backward(work.output, work.grad_output)
            return
        # One autograd call per branch point: a single call from all of them would also send
        # each one's gradient down the input path to the branches below it, counting those
        # twice.
        for node, leaves in work.branches:
            edges, grads_out = [], []
            for i, g in enumerate(work.grads[node]):
                if g is not None:
                    edges.append(GradientEdge(node, i))
                    grads_out.append(g)
            if edges and leaves:
                torch.autograd.backward(edges, grads_out, retain_graph=True, inputs=leaves)


def _catch(work: _SplitBackward, node: Node) -> Callable[..., None]:
    def hook(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
        work.grads[node] = tuple(grad_outputs)

    return hook


def _weight_branches(root: Node | None, x_node: Node) -> list[tuple[Node, list[torch.Tensor]]]:
    """Nodes on a path from ``root`` to the input that also feed something off that path,
    each with the leaves (parameters) that its off-path branches reach.

    The gradients arriving at these nodes during I are all W needs.
    """
    if root is None:
        return []
    reaches: dict[Node, bool] = {x_node: True}
    order: list[Node] = []
    stack: list[tuple[Node, bool]] = [(root, False)]
    while stack:  # iterative post-order DFS: deep models overflow Python recursion
        node, expanded = stack.pop()
        if expanded:
            reaches[node] = any(
                reaches.get(c, False) for c, _ in node.next_functions if c is not None
            )
            order.append(node)
            continue
        if node in reaches:
            continue
        reaches[node] = False
        stack.append((node, True))
        stack.extend(
            (c, False) for c, _ in node.next_functions if c is not None and c not in reaches
        )
    branches = []
    for n in order:
        if not reaches[n] or n is x_node:
            continue
        off_path = [c for c, _ in n.next_functions if c is not None and not reaches[c]]
        if off_path:
            branches.append((n, _leaves_under(off_path)))
    return branches


def _leaves_under(nodes: list[Node]) -> list[torch.Tensor]:
    """The tensors whose AccumulateGrad nodes are reachable from ``nodes``, in visit order."""
    leaves: dict[int, torch.Tensor] = {}
    seen: set[Node] = set()
    stack = list(reversed(nodes))
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if isinstance(variable, torch.Tensor):
            leaves.setdefault(id(variable), variable)
        stack.extend(c for c, _ in reversed(node.next_functions) if c is not None)
    return list(leaves.values())


_Clock = tuple[float, float]


def _clock() -> _Clock:
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
    microbatch only. ``stage_outputs``: every stage's output (shape, dtype) per microbatch,
    when the caller knows them; the ranks then skip the first run's shape agreement (no
    collective at all beyond the schedule's sends and receives; bad input raises on the rank
    that has it). Returns the detached, unscaled per-microbatch losses on the
    rank of the last stage and ``[]`` elsewhere. Bad input raises ``ValueError`` on every
    rank before any activation is sent.
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
        out_meta = _stage_output_meta(schedule, local, microbatches, rank, group, problem)
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
    device = _device_of(stages)
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
    for seg in _segments(actions):
        if isinstance(seg, tuple):
            ops = []
            posted: list[tuple[tuple[str, int, int] | None, torch.Tensor]] = []
            start = _clock()
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
                recorder._record_post(seg, start, _clock())
            continue

        a = seg
        st, s, mb = local[seg.stage], seg.stage, seg.microbatch
        if a.kind == F:
            x = microbatches[mb] if s == 0 else value("F", s, mb)
            start = _clock()
            with grad_mode:
                y = st._forward(mb, x, stage_kwargs[mb] if stage_kwargs is not None else {})
                if st.is_last:
                    loss = loss_fn(st._outputs[mb], targets[mb])
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
            start = _clock()
            gx = st._backward(mb, gy, split=a.kind == I)
            if gx is not None:
                handoff[("B", s - 1, mb)] = gx
        else:
            if before_backward is not None:
                before_backward(st, mb)
            start = _clock()
            st._backward_weight(mb)
        if recorder is not None:
            recorder._record(a, start, _clock())

    for work, _ in sends:
        work.wait()
    assert not recvs and not handoff, (sorted(recvs), sorted(handoff))
    return losses


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
    metas = _stage_output_meta(schedule, local, [microbatch], rank, group, None)
    mine: dict[int, dict[ActionKind, float]] = {}
    for turn in range(world):
        if distributed:
            dist.barrier(group=group)
        if turn == rank:
            mine = {
                s: _time_alone(st, metas, microbatch, target, loss_fn, repeats)
                for s, st in local.items()
            }
    every = [mine]
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


def _post(ops: list[dist.P2POp], coalesce: bool) -> list[dist.Work]:
    """Post one batch. gloo does not coalesce: ``batch_isend_irecv`` would issue the same
    ``isend`` / ``irecv`` calls one by one after checks that cost ~20 us per batch, so they
    are issued directly; other backends get one ``batch_isend_irecv`` (NCCL: one group)."""
    if coalesce:
        return dist.batch_isend_irecv(ops)
    return [op.op(op.tensor, op.peer, group=op.group, tag=op.tag) for op in ops]


def _device_of(stages: Sequence[PipelineStage]) -> torch.device:
    for st in stages:
        for p in st.module.parameters():
            return p.device
    return torch.device("cpu")


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
_DTYPES = (
    torch.float32,
    torch.float64,
    torch.bfloat16,
    torch.float16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
)


def _stage_output_meta(
    schedule: Schedule,
    local: dict[int, PipelineStage],
    microbatches: Sequence[torch.Tensor] | None,
    rank: int,
    group: dist.ProcessGroup | None,
    problem: str | None,
) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Shape and dtype of every stage's output, the same on every rank.

    In the first run of a stage layout, one one-element all-reduce shares whether any rank
    found a problem in its inputs (so every rank raises the same ``ValueError`` instead of
    some waiting forever); the shape is then broadcast from the first stage's rank, and each
    stage in turn computes its output shape (its ``output_spec``, or its module on meta
    tensors) and its owner broadcasts the result, or the error that says the stages do not
    fit. The exchanged tensors live on the stages' device (NCCL needs that). Later runs with
    the same microbatch shape reuse the agreed shapes with no collective and no host read; a
    run with another shape agrees again, which needs every rank to see the change: pass the
    microbatches on every rank when their shape can change between runs. The agreed shape is
    kept on this rank's first stage object, so every rank's stages must take part in the
    same runs (they do when each rank builds its stages once and calls ``run`` with them each
    step).
    """
    distributed = dist.is_initialized() and schedule.num_ranks > 1
    first = schedule.stage_to_rank[0]
    key = None
    if problem is None and microbatches and (rank == first or microbatches[0] is not None):
        mb = microbatches[0]
        if mb.dim() > _MAX_DIMS or mb.dtype not in _DTYPES:
            problem = (
                f"rank {rank}: microbatches must have at most {_MAX_DIMS} dims and a dtype in "
                f"{list(_DTYPES)}, got shape {list(mb.shape)} dtype {mb.dtype}"
            )
        else:
            key = (tuple(mb.shape), mb.dtype)
    holder = next(iter(local.values()))
    layout = schedule.stage_to_rank
    agreed = holder._agreed_shape.get(layout)
    if agreed is not None and problem is None and key in (None, agreed):
        # Steady state: the shapes agreed in an earlier run of this layout still hold for
        # this rank's inputs (or it has none): no collective and no host read.
        return holder._shape_cache[(layout, agreed)]
    needs_shape = agreed is None or key != agreed
    # problems (at most num_ranks) + (num_ranks + 1) * ranks that need the shape sent; on the
    # stages' device, as NCCL needs
    device = _device_of(list(local.values()))
    code = int(problem is not None) + (schedule.num_ranks + 1) * int(needs_shape)
    flag = torch.tensor([code], device=device)
    if distributed:
        dist.all_reduce(flag, group=group)
    total = int(flag)
    ranks_needing_shape, problems = divmod(total, schedule.num_ranks + 1)
    if problems:
        messages = [problem]
        if distributed:
            messages = [None] * schedule.num_ranks
            dist.all_gather_object(messages, problem, group=group)
        raise ValueError("; ".join(p for p in messages if p is not None))
    if not ranks_needing_shape:
        return holder._shape_cache[(layout, agreed)]
    code = [0] * (2 + _MAX_DIMS)  # [ndim, dtype code, shape...]
    if rank == first:
        shape, dtype = key
        code[0], code[1] = len(shape), _DTYPES.index(dtype)
        code[2 : 2 + len(shape)] = shape
    if distributed:
        sent = torch.tensor(code, dtype=torch.int64, device=device)
        dist.broadcast(sent, src=_global(first, group), group=group)
        code = sent.tolist()
    key = (tuple(code[2 : 2 + code[0]]), _DTYPES[code[1]])

    def share(obj: object, owner_rank: int) -> object:
        if not distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=_global(owner_rank, group), group=group)
        return box[0]

    if (layout, key) not in holder._shape_cache:
        shape, dtype = key
        metas: list[tuple[tuple[int, ...], torch.dtype]] = []
        for s, owner_rank in enumerate(layout):
            result = _stage_meta(local[s], shape, dtype) if owner_rank == rank else None
            result = share(result, owner_rank)
            if isinstance(result, str):
                what = "the microbatches" if s == 0 else f"the output of stage {s - 1}"
                raise ValueError(
                    f"stage {s} (rank {owner_rank}) cannot take {what}: input shape "
                    f"{list(shape)} dtype {dtype}; each stage's output shape must match the "
                    f"next stage's input ({result})"
                )
            shape, dtype = result
            metas.append((shape, dtype))
        holder._shape_cache[(layout, key)] = metas
    holder._agreed_shape[layout] = key
    return holder._shape_cache[(layout, key)]


def _stage_meta(
    stage: PipelineStage, shape: tuple[int, ...], dtype: torch.dtype
) -> tuple[tuple[int, ...], torch.dtype] | str:
    if stage.output_spec is None:
        return _meta_forward(stage.module, shape, dtype)
    try:
        out_shape, out_dtype = stage.output_spec(shape, dtype)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return tuple(out_shape), out_dtype


def _meta_forward(
    module: nn.Module, shape: tuple[int, ...], dtype: torch.dtype
) -> tuple[tuple[int, ...], torch.dtype] | str:
    """Output shape and dtype of ``module`` on an input of ``shape``, or the error text."""
    state = {n: t.to("meta") for n, t in module.named_parameters()}
    state.update({n: t.to("meta") for n, t in module.named_buffers()})
    x = torch.empty(shape, dtype=dtype, device="meta")
    try:
        with torch.no_grad():
            out = torch.func.functional_call(module, state, (x,))
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    if not isinstance(out, torch.Tensor):
        return f"a stage must return one tensor, got {type(out).__name__}"
    return tuple(out.shape), out.dtype


def _global(group_rank: int, group: dist.ProcessGroup | None) -> int:
    return group_rank if group is None else dist.get_global_rank(group, group_rank)
