"""Replay a schedule in time: timelines, bubble ratio, in-flight activations, text and PNG.

One replay engine serves the validator (blocking sends and batches that complete as one
work, no costs: does it deadlock?) and the simulator (what the runtime does on gloo: posting
a batch costs host time, a transfer's data is usable a fixed time after both of its ends are
posted, a compute action waits for its input, sends are waited for at the end).
Consecutive communication actions form one batch, as in the runtime. The bubble ratio of a
simulated and of a measured timeline is the same function of their compute intervals.
Every rank has a processor of its own (an accelerator); ranks that share processors are
modelled in ``titan_pipeline.experimental``.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from titan_pipeline.actions import Action, ActionKind, Schedule

__all__ = [
    "BubbleComparison",
    "Costs",
    "DeadlockError",
    "Interval",
    "Timeline",
    "compare",
    "simulate",
]

Seg = Action | tuple[Action, ...]
_ChannelKey = tuple[int, int, str, int]  # (source rank, destination rank, "F"|"B", sender stage)


@dataclass(frozen=True, slots=True)
class Interval:
    """One compute action of one rank from ``start`` to ``end``."""

    action: Action
    start: float
    end: float
    cpu: float | None = None
    """Measured only: CPU time the recording thread spent in it (``time.thread_time``)."""


@dataclass(frozen=True, slots=True)
class Timeline:
    """Per-rank compute intervals in execution order, simulated or measured."""

    intervals: tuple[tuple[Interval, ...], ...]
    """``intervals[rank]``: that rank's compute actions, in the order it ran them."""
    posts: tuple[tuple[Interval, ...], ...] = ()
    """Measured timelines only: per rank, one interval per communication action, spanning the
    host call that posted its batch (the actions of one batch share start and end)."""
    waits: tuple[tuple[Interval, ...], ...] = ()
    """Measured timelines only: per rank, one interval per receive (RECV_F / RECV_B), from
    the wait before its consumer starts to the data being usable."""

    @property
    def num_ranks(self) -> int:
        """Number of ranks."""
        return len(self.intervals)

    @property
    def start_time(self) -> float:
        """Earliest start over all ranks."""
        return min((iv[0].start for iv in self.intervals if iv), default=0.0)

    @property
    def total_time(self) -> float:
        """Makespan: latest end minus earliest start."""
        end = max((iv[-1].end for iv in self.intervals if iv), default=0.0)
        return end - self.start_time

    def busy_time(self, rank: int) -> float:
        """Time ``rank`` spent computing."""
        return sum(i.end - i.start for i in self.intervals[rank])

    @property
    def bubble_ratio(self) -> float:
        """Idle share of ``num_ranks * total_time``: ``1 - sum(busy) / (ranks * makespan)``."""
        total = self.total_time * self.num_ranks
        if total <= 0:
            return 0.0
        return 1.0 - sum(self.busy_time(r) for r in range(self.num_ranks)) / total

    @property
    def peak_in_flight(self) -> tuple[int, ...]:
        """Per rank, the most microbatch activations alive at once.

        A microbatch's activations on a stage are alive from its F until its backward is
        complete: its B, or its W when the backward is split (W still reads the stashed
        activations).
        """
        peaks = []
        for ivs in self.intervals:
            alive = peak = 0
            for iv in ivs:
                if iv.action.kind == ActionKind.F:
                    alive += 1
                    peak = max(peak, alive)
                elif iv.action.kind in (ActionKind.B, ActionKind.W):
                    alive -= 1
            peaks.append(peak)
        return tuple(peaks)

    def to_text(self, resolution: float | None = None) -> str:
        """Two lines per rank: the kind running in each time cell, then its microbatch % 10.

        Upper case for a rank's first stage, lower case for its later stages; ``.`` is idle.
        ``resolution`` is the time per character (default: the shortest action).
        """
        durations = [i.end - i.start for ivs in self.intervals for i in ivs if i.end > i.start]
        if not durations:
            return ""
        step = resolution or min(durations)
        t0 = self.start_time
        width = round(self.total_time / step)
        lines = []
        for rank, ivs in enumerate(self.intervals):
            first_stage = min((i.action.stage for i in ivs), default=0)
            kinds, mbs = ["."] * width, [" "] * width
            for iv in ivs:
                lo, hi = round((iv.start - t0) / step), round((iv.end - t0) / step)
                letter = iv.action.kind.value
                if iv.action.stage != first_stage:
                    letter = letter.lower()
                for c in range(lo, max(hi, lo + 1)):
                    if c < width:
                        kinds[c], mbs[c] = letter, str(iv.action.microbatch % 10)
            lines.append(f"rank {rank:>2} |{''.join(kinds)}|")
            lines.append(f"        |{''.join(mbs)}|")
        return "\n".join(lines) + "\n"

    def to_png(self, path: str | Path, *, title: str = "") -> Path:
        """Draw the timeline (one row per rank, one box per action) into a PNG file.

        Needs matplotlib, an optional extra: ``pip install 'titan-pipeline[plot]'``.
        """
        try:
            from matplotlib.figure import Figure
        except ImportError as e:
            raise ImportError(
                "Timeline.to_png needs matplotlib, an optional dependency of titan-pipeline: "
                "pip install 'titan-pipeline[plot]' (or pip install matplotlib)"
            ) from e

        colors = {"F": "#4c72b0", "B": "#dd8452", "I": "#c44e52", "W": "#55a868"}
        # A Figure of its own, not pyplot: no global backend switch, no figure registry.
        fig = Figure(figsize=(max(6.0, min(40.0, len(self._all()) / 6)), 0.6 * self.num_ranks + 1))
        ax = fig.subplots()
        t0 = self.start_time
        for rank, ivs in enumerate(self.intervals):
            for iv in ivs:
                kind = iv.action.kind.value
                ax.broken_barh(
                    [(iv.start - t0, iv.end - iv.start)],
                    (rank - 0.4, 0.8),
                    facecolors=colors[kind],
                    edgecolor="black",
                    linewidth=0.3,
                )
                ax.text(
                    iv.start - t0 + (iv.end - iv.start) / 2,
                    rank,
                    f"{kind}{iv.action.microbatch}",
                    ha="center",
                    va="center",
                    fontsize=6,
                    color="white",
                )
        ax.set_yticks(range(self.num_ranks), [f"rank {r}" for r in range(self.num_ranks)])
        ax.invert_yaxis()
        ax.set_xlabel("time")
        ax.set_title(title or f"bubble ratio {self.bubble_ratio:.3f}")
        fig.tight_layout()
        path = Path(path)
        fig.savefig(path, dpi=120)
        return path

    def _all(self) -> list[Interval]:
        return [i for ivs in self.intervals for i in ivs]


_PerStage = float | tuple[float, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class Costs:
    """Duration of each kind of action: one number, or one per stage."""

    forward: _PerStage = 1.0
    """F."""
    backward: _PerStage = 2.0
    """B (a full backward: input and weight gradients)."""
    backward_input: _PerStage = 1.0
    """I (input gradient only)."""
    backward_weight: _PerStage = 1.0
    """W (weight gradient only)."""
    communication: float = 0.0
    """From both ends of a transfer being posted to its data being usable by the receiver."""
    posting: float = 0.0
    """Host time a rank spends posting one batch of communication (it computes nothing
    meanwhile)."""
    durations: Mapping[Action, float] = field(default_factory=dict)
    """Exact durations of single actions (a measured trace), overriding the costs above; for
    a communication batch, the entry of its first action is the batch's posting time."""

    def of(self, action: Action) -> float:
        """Duration of a compute ``action``."""
        if action in self.durations:
            return self.durations[action]
        value = {
            ActionKind.F: self.forward,
            ActionKind.B: self.backward,
            ActionKind.I: self.backward_input,
            ActionKind.W: self.backward_weight,
        }[action.kind]
        return value if isinstance(value, int | float) else value[action.stage]

    @classmethod
    def from_timeline(
        cls, timeline: Timeline, num_stages: int, *, trace: bool = False, cpu: bool = False
    ) -> Costs:
        """Costs calibrated from a measured timeline of the same run.

        With ``cpu`` the compute and posting costs are the recorded CPU times instead of wall
        times: the work of each action on a processor of its own, when ranks shared processors
        while they were recorded (a rank's wall time then includes the time it waited for one).

        With ``trace`` the costs also hold every action's own measured duration and every
        batch's own posting time (``durations``): simulating them replays the run as it
        happened, action by action, and isolates what the model leaves out from how much the
        durations varied.

        Compute: the mean measured duration of each (kind, stage); kinds never run cost 0.
        ``posting``: the mean duration of the host calls that posted a batch.
        ``communication``: the median, over receives whose rank was already waiting when the
        later of the two ends was posted, of the time from that post to the wait returning
        (a receive waited for only later is only bounded by it). Needs ``posts`` and ``waits`` (a
        ``TimelineRecorder`` fills them, on one clock for all ranks); without them both stay 0.
        """

        def took(iv: Interval) -> float:
            return iv.cpu if cpu and iv.cpu is not None else iv.end - iv.start

        sums: dict[tuple[ActionKind, int], list[float]] = {}
        for iv in timeline._all():
            sums.setdefault((iv.action.kind, iv.action.stage), []).append(took(iv))

        def per_stage(kind: ActionKind) -> tuple[float, ...]:
            return tuple(
                sum(v) / len(v) if (v := sums.get((kind, s))) else 0.0 for s in range(num_stages)
            )

        batches = {
            (r, iv.start, iv.end): took(iv) for r, ivs in enumerate(timeline.posts) for iv in ivs
        }
        transfers = transfer_times(timeline)
        durations: dict[Action, float] = {}
        if trace:
            durations.update((iv.action, took(iv)) for iv in timeline._all())
            for ivs in timeline.posts:
                seen: set[tuple[float, float]] = set()
                for iv in ivs:  # the first action of each batch carries its posting time
                    if (iv.start, iv.end) not in seen:
                        seen.add((iv.start, iv.end))
                        durations[iv.action] = took(iv)
        return cls(
            forward=per_stage(ActionKind.F),
            backward=per_stage(ActionKind.B),
            backward_input=per_stage(ActionKind.I),
            backward_weight=per_stage(ActionKind.W),
            communication=statistics.median(transfers) if transfers else 0.0,
            posting=sum(batches.values()) / len(batches) if batches else 0.0,
            durations=durations,
        )


def transfer_times(timeline: Timeline) -> list[float]:
    """Per receive whose rank was already waiting when the later of its two ends was posted:
    from that post to the wait returning (at least 0: a post's recorded end can come after
    the data moved, when its rank was descheduled right after handing it over).

    Receives waited for only later are left out: the data may have been there before the
    wait, so their time is only bounded, and keeping just the ones that still blocked would
    keep just the slow transfers.
    """
    posted = {iv.action: iv.end for ivs in timeline.posts for iv in ivs}
    out = []
    for ivs in timeline.waits:
        for iv in ivs:
            send = matching_send(iv.action)
            if iv.action in posted and send in posted:
                later = max(posted[iv.action], posted[send])
                if iv.start <= later:
                    out.append(max(0.0, iv.end - later))
    return out


def matching_send(recv: Action) -> Action:
    """The send whose data ``recv`` receives."""
    if recv.kind == ActionKind.RECV_F:
        return Action(ActionKind.SEND_F, recv.stage - 1, recv.microbatch)
    return Action(ActionKind.SEND_B, recv.stage + 1, recv.microbatch)


class DeadlockError(ValueError):
    """No rank can make progress; ``stuck`` maps each unfinished rank to its next step."""

    def __init__(self, stuck: dict[int, str]) -> None:
        detail = "; ".join(f"rank {r} waits at {what}" for r, what in stuck.items())
        super().__init__(f"schedule deadlocks: ranks {sorted(stuck)} are stuck ({detail})")
        self.stuck = stuck


def simulate(schedule: Schedule, costs: Costs | None = None) -> Timeline:
    """Timeline of ``schedule`` under ``costs`` (default: F=I=W=1, B=2, free communication).

    Every rank has a processor (an accelerator) of its own. Ranks that share processors (more
    ranks than cores on one CPU) are modelled in ``titan_pipeline.experimental``.
    """
    return replay_schedule(schedule, costs or Costs(), blocking_sends=False)


@dataclass(frozen=True, slots=True)
class BubbleComparison:
    """Bubble ratios of a simulated and a measured timeline of the same schedule."""

    simulated: float
    measured: float

    @property
    def difference(self) -> float:
        """``measured - simulated``, as a ratio (multiply by 100 for percentage points)."""
        return self.measured - self.simulated

    def __str__(self) -> str:
        return (
            f"bubble: simulated {100 * self.simulated:.1f}%, measured {100 * self.measured:.1f}%"
            f" ({100 * self.difference:+.1f} pp)"
        )


def compare(simulated: Timeline, measured: Timeline) -> BubbleComparison:
    """Compare the bubble ratio of a simulated timeline with a measured one."""
    if simulated.num_ranks != measured.num_ranks:
        raise ValueError(
            f"timelines have {simulated.num_ranks} and {measured.num_ranks} ranks; they must match"
        )
    return BubbleComparison(simulated.bubble_ratio, measured.bubble_ratio)


# --- the replay engine ------------------------------------------------------------------


def segments(actions: Sequence[Action]) -> list[Seg]:
    """Compute actions stay single; each maximal run of communication becomes one batch."""
    segs: list[Seg] = []
    batch: list[Action] = []
    for a in actions:
        if a.kind.is_compute:
            if batch:
                segs.append(tuple(batch))
                batch = []
            segs.append(a)
        else:
            batch.append(a)
    if batch:
        segs.append(tuple(batch))
    return segs


def channel_of(action: Action, rank: int, owner: Sequence[int]) -> tuple[_ChannelKey, bool]:
    """The in-order channel of a communication action, and whether it is the sending end."""
    s = action.stage
    kind = action.kind
    if kind == ActionKind.SEND_F:
        return (rank, owner[s + 1], "F", s), True
    if kind == ActionKind.RECV_F:
        return (owner[s - 1], rank, "F", s - 1), False
    if kind == ActionKind.SEND_B:
        return (rank, owner[s - 1], "B", s), True
    assert kind == ActionKind.RECV_B, kind
    return (owner[s + 1], rank, "B", s + 1), False


@dataclass(slots=True)
class _RankState:
    segs: list[Seg]
    pos: int = 0
    clock: float = 0.0
    posted: bool = False
    intervals: list[Interval] = field(default_factory=list)


_Op = tuple[_ChannelKey, int, bool]  # (channel, index on it, is the sending end)


class Wiring:
    """Every communication op's place on its channel, when each end was posted, and when the
    data of a transfer is usable (``communication`` after both ends are posted)."""

    def __init__(
        self,
        schedule: Schedule,
        segs: list[list[Seg]],
        communication: float,
        latency: Callable[[], float] | None = None,
    ) -> None:
        self.segs = segs
        self.communication = communication
        self.latency = latency
        self.drawn: dict[tuple[_ChannelKey, int], float] = {}
        self.post: dict[_Op, float] = {}
        self.index: dict[tuple[int, int, int], _Op] = {}
        self.recv_of: dict[tuple[int, ActionKind, int, int], tuple[int, int]] = {}
        counters: dict[tuple[_ChannelKey, bool], int] = {}
        for r, rank_segs in enumerate(segs):
            for si, seg in enumerate(rank_segs):
                if isinstance(seg, tuple):
                    for oi, a in enumerate(seg):
                        key, is_send = channel_of(a, r, schedule.stage_to_rank)
                        k = counters.get((key, is_send), 0)
                        counters[(key, is_send)] = k + 1
                        self.index[(r, si, oi)] = (key, k, is_send)
                        if not is_send:
                            self.recv_of[(r, a.kind, a.stage, a.microbatch)] = (si, oi)

    def ops(self, r: int, si: int) -> list[_Op]:
        """The ops of batch ``si`` of rank ``r``."""
        batch = self.segs[r][si]
        assert isinstance(batch, tuple)  # ops belong to communication batches
        return [self.index[(r, si, oi)] for oi in range(len(batch))]

    def arrival(self, op: _Op) -> float | None:
        """When the data of op is usable, or None while an end is not posted."""
        key, k, is_send = op
        mine, other = self.post.get(op), self.post.get((key, k, not is_send))
        if mine is None or other is None:
            return None
        if self.latency is None:
            return max(mine, other) + self.communication
        if (key, k) not in self.drawn:  # drawn once, when both ends are known
            self.drawn[(key, k)] = self.latency()
        return max(mine, other) + self.drawn[(key, k)]

    def input_ready(self, r: int, action: Action, *, whole_batch: bool) -> float | None:
        """When the received input of a compute action is usable (0 if it receives none)."""
        where = self._recv(r, action)
        if where is None or action.kind == ActionKind.W:
            return 0.0
        si, oi = where
        ops = self.ops(r, si) if whole_batch else [self.index[(r, si, oi)]]
        times = [self.arrival(op) for op in ops]  # each, even after a None: arrival draws
        known = [t for t in times if t is not None]
        return None if len(known) != len(times) else max(known)

    def stuck(self, positions: list[int]) -> dict[int, str]:
        """What each unfinished rank waits at."""
        out = {}
        for r, pos in enumerate(positions):
            if pos < len(self.segs[r]):
                seg = self.segs[r][pos]
                if isinstance(seg, tuple):
                    out[r] = " ".join(map(str, seg))
                else:
                    where = self._recv(r, seg)
                    assert where is not None  # a compute action waits only for a receive
                    si, oi = where
                    batch = self.segs[r][si]
                    assert isinstance(batch, tuple)
                    out[r] = f"{seg} (for the data of {batch[oi]})"
        return out

    def _recv(self, r: int, action: Action) -> tuple[int, int] | None:
        kind = ActionKind.RECV_F if action.kind == ActionKind.F else ActionKind.RECV_B
        return self.recv_of.get((r, kind, action.stage, action.microbatch))


def replay_schedule(schedule: Schedule, costs: Costs, *, blocking_sends: bool) -> Timeline:
    """Run every rank's list against the others; raise ``DeadlockError`` if they get stuck.

    Each communication op gets an index on its channel (the k-th send matches the k-th
    receive). Posting never waits for the other end; data is usable ``costs.communication``
    after both ends are posted (a rendezvous, as gloo does: a send completes only once its
    receive is posted), and a compute action waits for the data of its input. Posting a batch
    takes ``costs.posting``. ``blocking_sends`` (the validator) adds the strictest semantics a
    backend may have: a batch holding a send returns only once every send's receive is
    posted, and a compute action waits for every op of the batch that holds its input
    (backends that coalesce a batch into one work, such as NCCL). Every rank has a processor
    of its own; ``_replay_shared`` lets them share fewer.
    """
    ranks = [_RankState(segments(acts)) for acts in schedule.actions]
    wiring = Wiring(schedule, [st.segs for st in ranks], costs.communication)
    progress = True
    while progress:
        progress = False
        for r, st in enumerate(ranks):
            while st.pos < len(st.segs):
                seg = st.segs[st.pos]
                if isinstance(seg, Action):
                    ready = wiring.input_ready(r, seg, whole_batch=blocking_sends)
                    if ready is None:
                        break
                    start = max(st.clock, ready)
                    end = start + costs.of(seg)
                    st.intervals.append(Interval(seg, start, end))
                    st.clock = end
                    st.pos += 1
                    progress = True
                    continue
                ops = wiring.ops(r, st.pos)
                if not st.posted:
                    st.clock += costs.durations.get(seg[0], costs.posting)
                    for op in ops:
                        wiring.post[op] = st.clock
                    st.posted = True
                    progress = True
                if blocking_sends and any(wiring.arrival(op) is None for op in ops if op[2]):
                    break
                st.pos += 1
                st.posted = False
                progress = True
    stuck = wiring.stuck([st.pos for st in ranks])
    if stuck:
        raise DeadlockError(stuck)
    return Timeline(tuple(tuple(st.intervals) for st in ranks))
