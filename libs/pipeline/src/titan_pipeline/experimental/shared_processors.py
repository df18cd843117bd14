"""Ranks that share processors: a model of an oversubscribed CPU, for development machines.

On accelerators every rank has a device of its own and ``titan_pipeline.simulate`` is the
model. On a CPU with fewer cores than ranks (a development machine running a 4-rank job on 2
cores, or ranks sharing it with other jobs) the OS time-slices the ranks, and a pipeline pays
for every action that loses its processor. Two replays of that, event by event:

* ``simulate_shared(schedule, costs, cores=n)``: fluid sharing, every busy rank progresses at
  ``n / busy``. Measured on a 2-core machine it is not what happens (an action mostly runs at
  full speed and now and then loses a whole scheduler slice), and it predicted bubbles 18-35
  pp too small there; kept as the textbook model.
* ``simulate_shared(schedule, costs, contention=c, seed=k)``: each compute action's time
  alone (``measure_costs``) times a stretch factor, each post's and each transfer's time,
  drawn from distributions measured on recorded steps (``Contention.from_timelines``), by how
  many other ranks were busy. One call is one sample. The pipeline benchmark
  (``benchmarks/bench_vs_torch.py``) predicts each schedule's measured bubble with it,
  calibrated on the other schedules' steps.

Not part of the stable API: a model of one kind of machine, kept for the benchmark.
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from titan_pipeline.actions import Action, Schedule
from titan_pipeline.simulator import (
    Costs,
    DeadlockError,
    Interval,
    Seg,
    Timeline,
    Wiring,
    matching_send,
    segments,
    transfer_times,
)

__all__ = ["Contention", "simulate_shared"]


@dataclass(frozen=True, slots=True)
class Contention:
    """How a machine whose ranks share processors stretches their work, measured.

    When more ranks (and other jobs) are runnable than there are processors, the OS gives
    each a processor in time slices: an action usually runs at full speed and is now and
    then descheduled for a slice of someone else's, so its wall time is its time alone times
    a heavy-tailed factor (on the 2-core machine of the benchmark: median 1.1-1.4, mean
    1.4-2.1 with 4 ranks). A pipeline pays for the tail, not for the mean: one descheduled
    action delays every rank that waits for it. A mean cost per kind cannot model that;
    sampling the factors can (``simulate_shared(..., contention=...)``). Transfers are sampled too:
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
                matching_send(w.action): _Span(w.start, w.end) for ivs in tl.waits for w in ivs
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
            transfers.extend(transfer_times(tl))
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


def simulate_shared(
    schedule: Schedule,
    costs: Costs | None = None,
    *,
    cores: int | None = None,
    contention: Contention | None = None,
    seed: int = 0,
) -> Timeline:
    """Timeline of ``schedule`` with its ranks sharing processors; give ``cores`` or
    ``contention``.

    ``cores``: the ranks share that many processors: whoever computes or posts progresses at
    ``min(1, cores / n)`` while ``n`` ranks do (fluid processor sharing), and ``costs`` are
    each action's time on a processor of its own. With ``cores`` >= the number of ranks this
    is ``titan_pipeline.simulate``.

    ``contention``: ranks share processors in time slices, as measured: each compute action
    takes its cost (time alone) times a stretch factor, and each post a posting time, drawn
    (generator seeded with ``seed``) from what was observed while as many other ranks were
    busy as are busy in the replay when it starts; each transfer takes a drawn transfer
    time. One call is one sample; take the bubble over many seeds for its distribution.
    """
    costs = costs or Costs()
    if (cores is None) == (contention is None):
        raise ValueError(
            "simulate_shared needs exactly one of cores= (fluid sharing) or contention= "
            f"(measured time slicing), got cores={cores!r}, contention="
            f"{'None' if contention is None else 'a Contention'}"
        )
    if contention is not None:
        rng = random.Random(seed)

        def draw(seg: Seg, others: int, wakes: bool, base: float) -> float:
            if isinstance(seg, Action):
                factor = contention._draw_stretch(others, base, rng)
                return base if factor is None else base * factor
            table = contention.waking if wakes and contention.waking else contention.posting
            took = contention._draw(table, others, rng)
            return base if took is None else took

        latency = (lambda: rng.choice(contention.transfer)) if contention.transfer else None
        return _replay_shared(schedule, costs, lambda n: 1.0, draw, latency)
    if isinstance(cores, bool) or not isinstance(cores, int) or cores < 1:
        raise ValueError(f"cores must be an int >= 1, got {cores!r}")
    return _replay_shared(schedule, costs, lambda n: min(1.0, cores / n))


def _replay_shared(
    schedule: Schedule,
    costs: Costs,
    speed: Callable[[int], float],
    draw: Callable[[Seg, int, bool, float], float] | None = None,
    latency: Callable[[], float] | None = None,
) -> Timeline:
    """``simulator._replay`` (simulation semantics) with the ranks sharing processors.

    Costs are then a rank's work on a processor of its own. Computing and posting need a
    processor; while ``n`` ranks do, each progresses at ``speed(n)`` (processor sharing, as
    an OS scheduler gives equal shares); waiting ranks need none. ``draw(segment, others,
    wakes, cost)``, if given, sets each segment's work when it starts, knowing how many other
    ranks are busy then (and, for a post, whether it sends to a rank waiting for that data);
    ``latency()``, if given, each transfer's time instead of ``costs.communication``. Event
    by event: the next event is the earliest end of a piece of work at the current rates or
    the earliest arrival of data some rank waits for.
    """
    segs = [segments(acts) for acts in schedule.actions]
    wiring = Wiring(schedule, segs, costs.communication, latency)
    num = len(segs)
    pos = [0] * num
    left: list[float | None] = [None] * num  # work left on the current segment, None: not begun
    began = [0.0] * num
    intervals: list[list[Interval]] = [[] for _ in range(num)]
    now = 0.0
    while True:
        moved = True
        wake: list[float] = []
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
            assert draw is not None  # ranks are drawn only when draw is given
            wakes = _wakes_a_waiting_rank(wiring, r, pos, left)
            left[r] = draw(wiring.segs[r][pos[r]], others, wakes, _begun(left[r]))
        busy = [r for r in range(num) if left[r] is not None]
        if not busy and not wake:
            break
        rate = speed(len(busy)) if busy else 0.0
        step = min([_begun(left[r]) / rate for r in busy] + [t - now for t in wake])
        now += step
        for r in busy:
            left[r] = rest = _begun(left[r]) - step * rate
            if rest <= 1e-12 * max(1.0, now):
                _finish_segment(r, pos[r], now, began, wiring, intervals)
                pos[r] += 1
                left[r] = None
    stuck = wiring.stuck(pos)
    if stuck:
        raise DeadlockError(stuck)
    return Timeline(tuple(map(tuple, intervals)))


def _begun(work: float | None) -> float:
    """The work left on a segment that has begun (not None)."""
    assert work is not None
    return work


def _wakes_a_waiting_rank(wiring: Wiring, r: int, pos: list[int], left: list[float | None]) -> bool:
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
    wiring: Wiring,
    pos: list[int],
    left: list[float | None],
    began: list[float],
    intervals: list[list[Interval]],
    wake: list[float],
    drawn: list[int],
    draw: Callable[[Seg, int, bool, float], float] | None,
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
    wiring: Wiring,
    intervals: list[list[Interval]],
) -> None:
    seg = wiring.segs[r][si]
    if isinstance(seg, Action):
        intervals[r].append(Interval(seg, began[r], now))
    else:
        for op in wiring.ops(r, si):
            wiring.post[op] = now
