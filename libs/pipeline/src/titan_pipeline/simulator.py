"""Replay a schedule in time: timelines, bubble ratio, in-flight activations, text and PNG.

One replay engine serves the validator (blocking sends and batches that complete as one
work, no costs: does it deadlock?) and the simulator (what the runtime does on gloo: posting
a batch costs host time, a transfer's data is usable a fixed time after both of its ends are
posted, a compute action waits for its input, sends are waited for at the end).
Consecutive communication actions form one batch, as in the runtime. The bubble ratio of a
simulated and of a measured timeline is the same function of their compute intervals.
Ranks that share processors are replayed event by event, either with fluid sharing
(``cores``) or with measured, sampled stretch factors (``Contention``).
"""

from __future__ import annotations

import bisect
import random
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from titan_pipeline.actions import Action, ActionKind, Schedule

__all__ = [
    "BubbleComparison",
    "Contention",
    "Costs",
    "DeadlockError",
    "Interval",
    "Timeline",
    "compare",
    "simulate",
]

_Seg = Action | tuple[Action, ...]
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
        """Draw the timeline (one row per rank, one box per action) into a PNG file."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        colors = {"F": "#4c72b0", "B": "#dd8452", "I": "#c44e52", "W": "#55a868"}
        fig, ax = plt.subplots(
            figsize=(max(6.0, min(40.0, len(self._all()) / 6)), 0.6 * self.num_ranks + 1)
        )
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
        plt.close(fig)
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
        times: the work of each action on a processor of its own, for ``simulate(...,
        cores=n)`` when ranks share processors (a rank's wall time then includes the time it
        waited for one).

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
        transfers = _transfer_times(timeline)
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


def _transfer_times(timeline: Timeline) -> list[float]:
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
            send = _matching_send(iv.action)
            if iv.action in posted and send in posted:
                later = max(posted[iv.action], posted[send])
                if iv.start <= later:
                    out.append(max(0.0, iv.end - later))
    return out


def _matching_send(recv: Action) -> Action:
    """The send whose data ``recv`` receives."""
    if recv.kind == ActionKind.RECV_F:
        return Action(ActionKind.SEND_F, recv.stage - 1, recv.microbatch)
    return Action(ActionKind.SEND_B, recv.stage + 1, recv.microbatch)


@dataclass(frozen=True, slots=True)
class Contention:
    """How a machine whose ranks share processors stretches their work, measured.

    When more ranks (and other jobs) are runnable than there are processors, the OS gives
    each a processor in time slices: an action usually runs at full speed and is now and
    then descheduled for a slice of someone else's, so its wall time is its time alone times
    a heavy-tailed factor (on the 2-core machine of the benchmark: median 1.1-1.4, mean
    1.4-2.1 with 4 ranks). A pipeline pays for the tail, not for the mean: one descheduled
    action delays every rank that waits for it. A mean cost per kind cannot model that;
    sampling the factors can (``simulate(..., contention=...)``). Transfers are sampled too:
    a receiver waits for gloo's I/O threads and then for its own wake-up, each of which may
    wait for a processor.
    """

    stretch: tuple[tuple[float, ...], ...]
    """``stretch[n]``: observed ``wall time / time alone`` of compute actions that started
    while ``n`` other ranks computed or posted."""
    posting: tuple[tuple[float, ...], ...]
    """``posting[n]``: observed wall times of batch posts started while ``n`` other ranks
    computed or posted, when no receiver was waiting for a send of the batch (a post is
    short host work: its wall time beyond ~0.15 ms is time its rank waited for a
    processor)."""
    transfer: tuple[float, ...] = ()
    """Observed times from the later of a transfer's two posts to its receiver's wait
    returning, over receivers already waiting at that post (as in ``Costs.from_timeline``;
    for the others it is only bounded). Under load they are heavy-tailed (median ~0.05 ms,
    mean 1-2 ms on the benchmark's machine: gloo's I/O threads and the woken receiver each
    wait for a processor). Empty: every transfer takes ``Costs.communication``."""
    waking: tuple[tuple[float, ...], ...] = ()
    """``waking[n]``: the same for posts that send to a rank already waiting for that data.
    Waking it costs the poster its processor: on 2 ranks such posts took a median 2.2-2.9 ms
    against 0.1-0.2 ms for the others, in every schedule. Empty: ``posting`` is used."""
    stretch_alone: tuple[tuple[float, ...], ...] = ()
    """``stretch_alone[n][i]``: the time alone of the action ``stretch[n][i]`` was observed
    on. A descheduled action loses whole scheduler slices, so the factor depends on the
    action's length (the same lost slice stretches a short action more than a long one): an
    action then draws only among samples whose time alone is within a factor
    ``_SIMILAR_LENGTH`` of its own (all of ``stretch[n]`` when there are none). Empty: every
    sample of ``stretch[n]`` may be drawn. Each ``stretch[n]`` is kept sorted by it."""

    def __post_init__(self) -> None:
        for name in ("stretch", "posting", "waking"):
            table = getattr(self, name)
            if not all(all(v >= 0 for v in samples) for samples in table):
                raise ValueError(f"Contention.{name} must hold samples >= 0, got {table!r}")
        if not all(v >= 0 for v in self.transfer):
            raise ValueError(f"Contention.transfer must hold samples >= 0, got {self.transfer}")
        if self.stretch_alone:
            if [len(v) for v in self.stretch_alone] != [len(v) for v in self.stretch]:
                raise ValueError(
                    "Contention.stretch_alone must hold one time alone per stretch sample, got "
                    f"{[len(v) for v in self.stretch_alone]} for {[len(v) for v in self.stretch]}"
                )
            pairs = [
                sorted(zip(a, f, strict=True))
                for a, f in zip(self.stretch_alone, self.stretch, strict=True)
            ]
            object.__setattr__(self, "stretch", tuple(tuple(f for _, f in p) for p in pairs))
            object.__setattr__(self, "stretch_alone", tuple(tuple(a for a, _ in p) for p in pairs))

    @classmethod
    def from_timelines(cls, runs: Sequence[tuple[Timeline, Costs]]) -> Contention:
        """Calibrate from measured timelines, each with the time alone of its actions
        (``measure_costs``, taken while no other rank computes; the schedules may differ).

        Actions shorter than 0.2 ms alone are left out of ``stretch`` (their ratio is timer
        noise); ``transfer`` holds the transfer times defined above.
        """
        if not runs:
            raise ValueError("from_timelines needs at least one (timeline, costs) pair")
        num = runs[0][0].num_ranks
        stretch: list[list[float]] = [[] for _ in range(num)]
        lengths: list[list[float]] = [[] for _ in range(num)]
        posting: list[list[float]] = [[] for _ in range(num)]
        waking: list[list[float]] = [[] for _ in range(num)]
        transfers: list[float] = []
        for tl, alone in runs:
            if tl.num_ranks != num or len(tl.posts) != num:
                raise ValueError(
                    "timelines must be measured (with posts) on the same number of ranks"
                )
            busy = [
                [(iv.start, iv.end) for iv in tl.intervals[r]] + sorted(_batches(tl.posts[r]))
                for r in range(num)
            ]
            # send action -> the span its receiver spent waiting for that data
            waiting = {
                _matching_send(w.action): _Span(w.start, w.end) for ivs in tl.waits for w in ivs
            }
            for r in range(num):
                for iv in tl.intervals[r]:
                    base = alone.of(iv.action)
                    if base >= _SHORTEST_CALIBRATED:
                        n = _others_busy(busy, r, iv.start)
                        stretch[n].append((iv.end - iv.start) / base)
                        lengths[n].append(base)
                batches: dict[tuple[float, float], list[Action]] = {}
                for iv in tl.posts[r]:
                    batches.setdefault((iv.start, iv.end), []).append(iv.action)
                for (a, b), actions in batches.items():
                    wakes = any(a in waiting.get(x, ()) for x in actions)
                    (waking if wakes else posting)[_others_busy(busy, r, a)].append(b - a)
            transfers.extend(_transfer_times(tl))
        return cls(
            tuple(map(tuple, stretch)),
            tuple(map(tuple, posting)),
            tuple(transfers),
            tuple(map(tuple, waking)),
            tuple(map(tuple, lengths)),
        )

    def _draw(
        self, table: tuple[tuple[float, ...], ...], others: int, rng: random.Random
    ) -> float | None:
        n = _nearest_filled(table, others)
        return None if n is None else rng.choice(table[n])

    def _draw_stretch(self, others: int, alone: float, rng: random.Random) -> float | None:
        """A stretch factor for an action of ``alone`` seconds started with ``others`` busy."""
        n = _nearest_filled(self.stretch, others)
        if n is None:
            return None
        if self.stretch_alone:
            lengths = self.stretch_alone[n]
            lo = bisect.bisect_left(lengths, alone / _SIMILAR_LENGTH)
            hi = bisect.bisect_right(lengths, alone * _SIMILAR_LENGTH)
            if hi > lo:
                return self.stretch[n][rng.randrange(lo, hi)]
        return rng.choice(self.stretch[n])


def _nearest_filled(table: tuple[tuple[float, ...], ...], others: int) -> int | None:
    """The count of busy ranks nearest ``others`` that has samples (ties: the larger)."""
    for n in sorted(range(len(table)), key=lambda k: (abs(k - others), -k)):
        if table[n]:
            return n
    return None


@dataclass(frozen=True, slots=True)
class _Span:
    """A half-open time span; ``t in span`` is ``start <= t < end``."""

    start: float
    end: float

    def __contains__(self, t: float) -> bool:
        return self.start <= t < self.end


_SHORTEST_CALIBRATED = 0.2e-3
"""Seconds: actions shorter than this alone do not calibrate ``Contention.stretch``."""

_SIMILAR_LENGTH = 1.5
"""An action draws its stretch among samples from actions whose time alone is within this
factor of its own (``Contention.stretch_alone``): narrower than the factor ~2 between a full
backward and a forward of one stage. One constant for every schedule (2 gave similar errors on
the benchmark's saved runs)."""


def _others_busy(busy: list[list[tuple[float, float]]], rank: int, t: float) -> int:
    """How many ranks other than ``rank`` are inside one of their busy spans at ``t``."""
    return sum(any(a <= t < b for a, b in spans) for q, spans in enumerate(busy) if q != rank)


def _batches(posts: Sequence[Interval]) -> set[tuple[float, float]]:
    """(start, end) of each posted batch (the actions of one batch share them)."""
    return {(iv.start, iv.end) for iv in posts}


class DeadlockError(ValueError):
    """No rank can make progress; ``stuck`` maps each unfinished rank to its next step."""

    def __init__(self, stuck: dict[int, str]) -> None:
        detail = "; ".join(f"rank {r} waits at {what}" for r, what in stuck.items())
        super().__init__(f"schedule deadlocks: ranks {sorted(stuck)} are stuck ({detail})")
        self.stuck = stuck


def simulate(
    schedule: Schedule,
    costs: Costs | None = None,
    *,
    cores: int | None = None,
    contention: Contention | None = None,
    seed: int = 0,
) -> Timeline:
    """Timeline of ``schedule`` under ``costs`` (default: F=I=W=1, B=2, free communication).

    ``cores``: the ranks share that many processors (e.g. more ranks than cores on one
    machine): whoever computes or posts progresses at ``min(1, cores / n)`` while ``n`` ranks
    do (fluid processor sharing), and ``costs`` are each action's time on a processor of its
    own. None: every rank has its own processor.

    ``contention``: ranks share processors in time slices, as measured: each compute action
    takes its cost (time alone) times a stretch factor, and each post a posting time, drawn
    (generator seeded with ``seed``) from what was observed while as many other ranks were
    busy as are busy in the replay when it starts; each transfer takes a drawn transfer
    time. One call is one sample; take the bubble over many seeds for its distribution.
    """
    costs = costs or Costs()
    if contention is not None:
        if cores is not None:
            raise ValueError("pass cores or contention, not both: contention includes sharing")
        rng = random.Random(seed)

        def draw(seg: _Seg, others: int, wakes: bool, base: float) -> float:
            if isinstance(seg, Action):
                factor = contention._draw_stretch(others, base, rng)
                return base if factor is None else base * factor
            table = contention.waking if wakes and contention.waking else contention.posting
            took = contention._draw(table, others, rng)
            return base if took is None else took

        latency = (lambda: rng.choice(contention.transfer)) if contention.transfer else None
        return _replay_shared(schedule, costs, lambda n: 1.0, draw, latency)
    if cores is None:
        return _replay(schedule, costs, blocking_sends=False)
    if isinstance(cores, bool) or not isinstance(cores, int) or cores < 1:
        raise ValueError(f"cores must be an int >= 1 or None, got {cores!r}")
    return _replay_shared(schedule, costs, lambda n: min(1.0, cores / n))


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


def _segments(actions: Sequence[Action]) -> list[_Seg]:
    """Compute actions stay single; each maximal run of communication becomes one batch."""
    segs: list[_Seg] = []
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
    segs: list[_Seg]
    pos: int = 0
    clock: float = 0.0
    posted: bool = False
    intervals: list[Interval] = field(default_factory=list)


_Op = tuple[_ChannelKey, int, bool]  # (channel, index on it, is the sending end)


class _Wiring:
    """Every communication op's place on its channel, when each end was posted, and when the
    data of a transfer is usable (``communication`` after both ends are posted)."""

    def __init__(
        self,
        schedule: Schedule,
        segs: list[list[_Seg]],
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
        return [self.index[(r, si, oi)] for oi in range(len(self.segs[r][si]))]

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
        times = [self.arrival(op) for op in ops]
        return None if any(t is None for t in times) else max(times)

    def stuck(self, positions: list[int]) -> dict[int, str]:
        """What each unfinished rank waits at."""
        out = {}
        for r, pos in enumerate(positions):
            if pos < len(self.segs[r]):
                seg = self.segs[r][pos]
                if isinstance(seg, tuple):
                    out[r] = " ".join(map(str, seg))
                else:
                    si, oi = self._recv(r, seg)
                    out[r] = f"{seg} (for the data of {self.segs[r][si][oi]})"
        return out

    def _recv(self, r: int, action: Action) -> tuple[int, int] | None:
        kind = ActionKind.RECV_F if action.kind == ActionKind.F else ActionKind.RECV_B
        return self.recv_of.get((r, kind, action.stage, action.microbatch))


def _replay(schedule: Schedule, costs: Costs, *, blocking_sends: bool) -> Timeline:
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
    ranks = [_RankState(_segments(acts)) for acts in schedule.actions]
    wiring = _Wiring(schedule, [st.segs for st in ranks], costs.communication)
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


def _replay_shared(
    schedule: Schedule,
    costs: Costs,
    speed: Callable[[int], float],
    draw: Callable[[_Seg, int, bool, float], float] | None = None,
    latency: Callable[[], float] | None = None,
) -> Timeline:
    """``_replay`` (simulation semantics) with the ranks sharing processors.

    Costs are then a rank's work on a processor of its own. Computing and posting need a
    processor; while ``n`` ranks do, each progresses at ``speed(n)`` (processor sharing, as
    an OS scheduler gives equal shares); waiting ranks need none. ``draw(segment, others,
    cost)``, if given, sets each segment's work when it starts, knowing how many other ranks
    are busy then (and, for a post, whether it sends to a rank waiting for that data);
    ``latency()``, if given, each transfer's time instead of
    ``costs.communication``. Event by event: the next event is the earliest end of a piece of work at the current
    rates or the earliest arrival of data some rank waits for.
    """
    segs = [_segments(acts) for acts in schedule.actions]
    wiring = _Wiring(schedule, segs, costs.communication, latency)
    num = len(segs)
    pos = [0] * num
    left: list[float | None] = [None] * num  # work left on the current segment, None: not begun
    began = [0.0] * num
    intervals: list[list[Interval]] = [[] for _ in range(num)]
    now = 0.0
    while True:
        moved = True
        drawn: list[int] = []  # ranks that began a segment whose work is still to be drawn
        while moved:  # zero-cost steps (a free post) can unblock ranks scanned before
            moved = False
            wake = []  # arrival times of data that waiting ranks already know of
            for r in range(num):
                moved |= _start_segments(
                    r, now, costs, wiring, pos, left, began, intervals, wake, drawn, draw
                )
        # drawn once every rank beginning now has begun: "others busy" is then the same for
        # ranks that begin at the same instant, whatever the order they are scanned in
        others = sum(w is not None for w in left) - 1
        for r in drawn:
            wakes = _wakes_a_waiting_rank(wiring, r, pos, left)
            left[r] = draw(wiring.segs[r][pos[r]], others, wakes, left[r])
        busy = [r for r in range(num) if left[r] is not None]
        if not busy and not wake:
            break
        rate = speed(len(busy)) if busy else 0.0
        step = min([left[r] / rate for r in busy] + [t - now for t in wake])
        now += step
        for r in busy:
            left[r] -= step * rate
            if left[r] <= 1e-12 * max(1.0, now):
                _finish_segment(r, pos[r], now, began, wiring, intervals)
                pos[r] += 1
                left[r] = None
    stuck = wiring.stuck(pos)
    if stuck:
        raise DeadlockError(stuck)
    return Timeline(tuple(map(tuple, intervals)))


def _wakes_a_waiting_rank(
    wiring: _Wiring, r: int, pos: list[int], left: list[float | None]
) -> bool:
    """Whether rank ``r``'s current segment is a batch that sends to a rank whose next
    action is waiting for exactly that data."""
    seg = wiring.segs[r][pos[r]]
    if isinstance(seg, Action):
        return False
    for key, k, is_send in wiring.ops(r, pos[r]):
        q = key[1]
        if not is_send or left[q] is not None or pos[q] >= len(wiring.segs[q]):
            continue
        consumer = wiring.segs[q][pos[q]]
        where = isinstance(consumer, Action) and wiring._recv(q, consumer)
        if where and wiring.index[(q, *where)] == (key, k, False):
            return True
    return False


def _start_segments(
    r: int,
    now: float,
    costs: Costs,
    wiring: _Wiring,
    pos: list[int],
    left: list[float | None],
    began: list[float],
    intervals: list[list[Interval]],
    wake: list[float],
    drawn: list[int],
    draw: Callable[[_Seg, int, bool, float], float] | None,
) -> bool:
    """Begin rank ``r``'s next pieces of work at ``now`` (finishing free ones at once) until
    it is busy, done or waiting; return whether any free piece finished. With ``draw``, the
    work of the piece begun is drawn later (``r`` is appended to ``drawn``)."""
    segs = wiring.segs[r]
    moved = False
    while pos[r] < len(segs) and left[r] is None:
        seg = segs[pos[r]]
        if isinstance(seg, Action):
            ready = wiring.input_ready(r, seg, whole_batch=False)
            if ready is None:
                break
            if ready > now:
                wake.append(ready)
                break
            work = costs.of(seg)
        else:
            work = costs.durations.get(seg[0], costs.posting)
        began[r], left[r] = now, work
        if draw is not None:
            drawn.append(r)
            break
        if work <= 0:
            _finish_segment(r, pos[r], now, began, wiring, intervals)
            pos[r] += 1
            left[r] = None
            moved = True
    return moved


def _finish_segment(
    r: int,
    si: int,
    now: float,
    began: list[float],
    wiring: _Wiring,
    intervals: list[list[Interval]],
) -> None:
    seg = wiring.segs[r][si]
    if isinstance(seg, Action):
        intervals[r].append(Interval(seg, began[r], now))
    else:
        for op in wiring.ops(r, si):
            wiring.post[op] = now
