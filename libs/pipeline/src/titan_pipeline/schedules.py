"""Schedule generators: compute-only orders per rank, then communication inserted mechanically.

Notation: ``p`` ranks, ``m`` microbatches, ``v`` stages per rank. Stages are placed either in
a loop (stage ``s`` on rank ``s % p``; GPipe, 1F1B, ZB-H1, Interleaved 1F1B) or in a V (rank
``r`` holds stages ``r`` and ``2p - 1 - r``; ZBV, DualPipeV), so that the first and the last
stage live on rank 0 and the turn of the V needs no communication.
"""

from __future__ import annotations

from collections.abc import Callable

from titan_pipeline.actions import Action, ActionKind, Schedule

__all__ = ["SCHEDULES", "STAGES_PER_RANK", "add_communication", "build_schedule", "stage_to_rank"]

F, B, I, W = ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W  # noqa: E741


def stage_to_rank(num_ranks: int, stages_per_rank: int, style: str = "loop") -> tuple[int, ...]:
    """Rank of each stage: ``"loop"`` (``s % p``) or ``"v"`` (two stages per rank, in a V)."""
    if style == "loop":
        return tuple(s % num_ranks for s in range(num_ranks * stages_per_rank))
    if style == "v":
        if stages_per_rank != 2:
            raise ValueError(f"style='v' needs stages_per_rank=2, got {stages_per_rank}")
        return tuple(range(num_ranks)) + tuple(reversed(range(num_ranks)))
    raise ValueError(f"style must be 'loop' or 'v', got {style!r}")


def add_communication(schedule: Schedule) -> Schedule:
    """Insert SEND/RECV actions into a compute-only schedule (any communication is dropped).

    The compute lists are replayed in lock-step rounds: in each round every rank runs its
    next action if that action's input was produced in an earlier round. A value produced
    in round ``k`` is sent right after its producer, and its receive is posted on the
    consumer at the start of the same round ``k``, before whatever that rank computes in
    it. Posting a receive never blocks, so receives go as early as that: with gloo a
    transfer starts only once both ends are posted (a rendezvous), and a receive posted one
    compute action ahead lets the data move while the consumer is still busy, instead of
    after it. Every send is posted in the round whose start holds its receive, so the
    result cannot deadlock even when a send blocks until its receive is posted (the
    validator checks exactly that); the runtime waits for a receive only right before the
    action that consumes it.
    """
    owner = schedule.stage_to_rank
    last = schedule.num_stages - 1
    compute = schedule.compute_only()
    num_ranks = len(compute)
    out: list[list[Action]] = [[] for _ in range(num_ranks)]
    produced: dict[tuple[str, int, int], int] = {}  # value -> round it was produced in
    pos = [0] * num_ranks
    rnd = 0
    while any(pos[r] < len(compute[r]) for r in range(num_ranks)):
        ran: list[Action | None] = [None] * num_ranks
        for r in range(num_ranks):
            if pos[r] == len(compute[r]):
                continue
            a = compute[r][pos[r]]
            need = _input_value(a, last)
            if need is not None and produced.get(need, rnd) >= rnd:
                continue
            ran[r] = a
            pos[r] += 1
        if not any(ran):
            stuck = {
                r: str(compute[r][pos[r]]) for r in range(num_ranks) if pos[r] < len(compute[r])
            }
            detail = "; ".join(f"rank {r} waits at {a}" for r, a in stuck.items())
            raise ValueError(
                f"compute order deadlocks: ranks {sorted(stuck)} wait for inputs never produced "
                f"({detail})"
            )
        sends: list[list[Action]] = [[] for _ in range(num_ranks)]
        for a in ran:
            if a is None:
                continue
            s, mb = a.stage, a.microbatch
            if a.kind == F:
                produced[("F", s, mb)] = rnd
                if s < last and owner[s + 1] != owner[s]:
                    sends[owner[s]].append(Action(ActionKind.SEND_F, s, mb))
                    out[owner[s + 1]].append(Action(ActionKind.RECV_F, s + 1, mb))
            elif a.kind in (B, I):
                produced[("B", s, mb)] = rnd
                if s > 0 and owner[s - 1] != owner[s]:
                    sends[owner[s]].append(Action(ActionKind.SEND_B, s, mb))
                    out[owner[s - 1]].append(Action(ActionKind.RECV_B, s - 1, mb))
        for r, a in enumerate(ran):
            if a is not None:
                out[r].append(a)
            out[r].extend(sends[r])
        rnd += 1
    return Schedule(schedule.name, schedule.num_microbatches, owner, tuple(map(tuple, out)))


def _input_value(a: Action, last: int) -> tuple[str, int, int] | None:
    """The value a compute action consumes from another stage (None when it has none).

    W and the loss-side backward consume only their own stage's state, which the rank's own
    order guarantees.
    """
    if a.kind == F and a.stage > 0:
        return ("F", a.stage - 1, a.microbatch)
    if a.kind in (B, I) and a.stage < last:
        return ("B", a.stage + 1, a.microbatch)
    return None


def build_schedule(
    name: str, *, num_ranks: int, num_microbatches: int, stages_per_rank: int | None = None
) -> Schedule:
    """Generate schedule ``name`` (one of ``SCHEDULES``) with communication, validated.

    ``stages_per_rank`` defaults to the schedule's own (``STAGES_PER_RANK[name]``); only
    ``interleaved_1f1b`` takes another value (any >= 2).
    """
    from titan_pipeline.validator import validate  # validator imports this module

    if name not in SCHEDULES:
        raise ValueError(f"schedule name must be one of {sorted(SCHEDULES)}, got {name!r}")
    if stages_per_rank is None:
        stages_per_rank = STAGES_PER_RANK[name]
    for field, value in (
        ("num_ranks", num_ranks),
        ("num_microbatches", num_microbatches),
        ("stages_per_rank", stages_per_rank),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{field} must be an int >= 1, got {value!r}")
    generate, check = SCHEDULES[name]
    check(num_ranks, num_microbatches, stages_per_rank)
    orders, mapping = generate(num_ranks, num_microbatches, stages_per_rank)
    compute = Schedule(name, num_microbatches, mapping, tuple(tuple(o) for o in orders))
    schedule = add_communication(compute)
    validate(schedule)
    return schedule


# --- requirements -----------------------------------------------------------------------


def _needs_one_stage_per_rank(name: str) -> Callable[[int, int, int], None]:
    def check(p: int, m: int, v: int) -> None:
        if v != 1:
            raise ValueError(f"{name} needs stages_per_rank=1, got stages_per_rank={v}")

    return check


def _check_interleaved(p: int, m: int, v: int) -> None:
    if v < 2:
        raise ValueError(f"interleaved_1f1b needs stages_per_rank >= 2 (use '1f1b' for 1), got {v}")
    if m < p or m % p:
        raise ValueError(
            f"interleaved_1f1b needs num_microbatches to be a positive multiple of "
            f"num_ranks={p}, got num_microbatches={m}"
        )


def _check_v(name: str, min_microbatches: Callable[[int], int]) -> Callable[[int, int, int], None]:
    def check(p: int, m: int, v: int) -> None:
        if v != 2:
            raise ValueError(
                f"{name} needs stages_per_rank=2 (a V of two stages per rank), got {v}"
            )
        need = min_microbatches(p)
        if m < need:
            raise ValueError(f"{name} with num_ranks={p} needs num_microbatches >= {need}, got {m}")

    return check


# --- generators: compute-only order per rank --------------------------------------------

_Orders = tuple[list[list[Action]], tuple[int, ...]]


def _gpipe(p: int, m: int, v: int) -> _Orders:
    orders = [
        [Action(F, r, i) for i in range(m)] + [Action(B, r, i) for i in range(m)] for r in range(p)
    ]
    return orders, stage_to_rank(p, 1)


def _one_f_one_b(p: int, m: int, v: int) -> _Orders:
    orders = []
    for r in range(p):
        warmup = min(p - 1 - r, m)
        seq = [Action(F, r, i) for i in range(warmup)]
        for i in range(m - warmup):
            seq += [Action(F, r, warmup + i), Action(B, r, i)]
        seq += [Action(B, r, i) for i in range(m - warmup, m)]
        orders.append(seq)
    return orders, stage_to_rank(p, 1)


def _interleaved(p: int, m: int, v: int) -> _Orders:
    # Megatron-LM's interleaved 1F1B: microbatches go through the local stages in groups of p.
    total = v * m

    def unit(k: int, backward: bool) -> tuple[int, int]:
        chunk = (k // p) % v
        if backward:
            chunk = v - 1 - chunk
        return chunk, (k // (p * v)) * p + k % p

    orders = []
    for r in range(p):
        warmup = min((p - r - 1) * 2 + (v - 1) * p, total)

        def act(kind: ActionKind, k: int, r: int = r) -> Action:
            chunk, mb = unit(k, kind == B)
            return Action(kind, chunk * p + r, mb)

        seq = [act(F, k) for k in range(warmup)]
        for k in range(total - warmup):
            seq += [act(F, warmup + k), act(B, k)]
        seq += [act(B, k) for k in range(total - warmup, total)]
        orders.append(seq)
    return orders, stage_to_rank(p, v)


def _zb_h1(p: int, m: int, v: int) -> _Orders:
    # 1F1B's order of F and I, and each W placed where the rank would otherwise wait (the
    # greedy rule of the zero-bubble paper under T_F = T_I = T_W), but never so late that
    # more than p microbatches are alive on a rank: 1F1B's peak (on its first rank), which
    # is ZB-H1's memory bound. Under unit costs this leaves 1/3 of 1F1B's bubble.
    base, mapping = _one_f_one_b(p, m, 1)
    main = [[Action(I if a.kind == B else F, a.stage, a.microbatch) for a in seq] for seq in base]
    return _fill_weight_grads(main, mapping, [p] * p), mapping


def _fill_weight_grads(
    main: list[list[Action]], mapping: tuple[int, ...], max_alive: list[int]
) -> list[list[Action]]:
    """Unit-time list scheduling: the next F/I if its input is ready, else a pending W.

    A W also goes first when the next action is an F and ``max_alive[rank]`` microbatches
    are already alive (F done, W not yet) on that rank.
    """
    p, last = len(main), len(mapping) - 1
    done_at: dict[tuple[ActionKind, int, int], int] = {}
    pos, alive = [0] * p, [0] * p
    pending: list[list[Action]] = [[] for _ in range(p)]
    orders: list[list[Action]] = [[] for _ in range(p)]
    t = 0
    while any(pos[r] < len(main[r]) or pending[r] for r in range(p)):
        started: list[Action] = []
        for r in range(p):
            choice = None
            if pos[r] < len(main[r]):
                a = main[r][pos[r]]
                dep = _input_value(a, last)
                ready = dep is None or done_at.get((F if dep[0] == "F" else I, *dep[1:]), t) < t
                full = a.kind == F and alive[r] >= max_alive[r] and pending[r]
                if ready and not full:
                    choice = a
                    pos[r] += 1
                    if a.kind == I:
                        pending[r].append(Action(W, a.stage, a.microbatch))
                    else:
                        alive[r] += 1
            if choice is None and pending[r]:
                choice = pending[r].pop(0)
                alive[r] -= 1
            if choice is not None:
                orders[r].append(choice)
                started.append(choice)
        for a in started:
            done_at[(a.kind, a.stage, a.microbatch)] = t
        t += 1
    return orders


def _zbv(p: int, m: int, v: int) -> _Orders:
    # ZB-V (zero-bubble paper, section 6), counts as in torch.distributed.pipelining's
    # ScheduleZBVZeroBubble: generated for max(m, 2p - 1) microbatches, extras dropped.
    n = max(m, 2 * p - 1)
    orders = []
    for r in range(p):
        s0, s1 = r, 2 * p - 1 - r
        seq: list[Action] = []
        f0 = f1 = b0 = b1 = 0
        for _ in range(2 * (p - r) - 1):
            seq.append(Action(F, s0, f0))
            f0 += 1
        for _ in range(r):
            seq += [Action(F, s1, f1), Action(F, s0, f0)]
            f1, f0 = f1 + 1, f0 + 1
        for _ in range(p - r):
            seq += [Action(F, s1, f1), Action(I, s1, b1), Action(W, s1, b1)]
            f1, b1 = f1 + 1, b1 + 1
        while f1 < f0 or f0 < n:
            if f0 < n:
                seq.append(Action(F, s0, f0))
                f0 += 1
            seq += [Action(I, s0, b0), Action(W, s0, b0)]
            b0 += 1
            seq += [Action(F, s1, f1), Action(I, s1, b1), Action(W, s1, b1)]
            f1, b1 = f1 + 1, b1 + 1
        w0, w1 = b0, b1
        for _ in range(r):
            seq += [Action(I, s0, b0), Action(I, s1, b1)]
            b0, b1 = b0 + 1, b1 + 1
        for _ in range(p - r):
            seq += [Action(I, s0, b0), Action(W, s0, w0)]
            b0, w0 = b0 + 1, w0 + 1
        seq += [Action(W, s1, i) for i in range(w1, b1)]
        seq += [Action(W, s0, i) for i in range(w0, b0)]
        orders.append([a for a in seq if a.microbatch < m])
    return orders, stage_to_rank(p, 2, "v")


def _dualpipev(p: int, m: int, v: int) -> _Orders:
    # DualPipeV (DeepSeek; order as in torch.distributed.pipelining's ScheduleDualPipeV).
    # Its overlapped "F and B of two microbatches" steps are emitted as F then B: one device
    # stream here has nothing to overlap them with.
    return [_dualpipev_rank(p, m, r) for r in range(p)], stage_to_rank(p, 2, "v")


def _dualpipev_rank(p: int, m: int, r: int) -> list[Action]:
    s0, s1 = r, 2 * p - 1 - r
    seq: list[Action] = []
    nxt: dict[tuple[ActionKind, int], int] = {}
    weights: list[Action] = []

    def add(kind: ActionKind, stage: int) -> None:
        key = (F if kind == F else I, stage)  # B and I share the backward counter
        mb = nxt.get(key, 0)
        nxt[key] = mb + 1
        seq.append(Action(kind, stage, mb))
        if kind == I:
            weights.append(Action(W, stage, mb))

    def add_weight() -> None:
        if weights:
            seq.append(weights.pop(0))

    for _ in range((p - r - 1) * 2):
        add(F, s0)
    for _ in range(r + 1):
        add(F, s0)
        add(F, s1)
    for _ in range(p - r - 1):
        add(I, s1)
        add_weight()
        add(F, s1)
    for _ in range(m - 2 * p + r + 1):
        add(F, s0)
        add(B, s1)
        add(F, s1)
        add(B, s0)
    for _ in range(p - r - 1):
        add(B, s1)
        add(F, s1)
        add(B, s0)
    split = False
    for i in range(r + 1):
        if i == (r + 1) // 2 and r % 2 == 1:
            split = True
        add(I if split else B, s1)
        if i == (r + 1) // 2 and r % 2 == 0:
            split = True
        add(I if split else B, s0)
    for _ in range(p - r - 1):
        add_weight()
        add(I if split else B, s0)
    while weights:
        add_weight()
    return seq


SCHEDULES: dict[str, tuple[Callable[[int, int, int], _Orders], Callable[[int, int, int], None]]] = {
    "gpipe": (_gpipe, _needs_one_stage_per_rank("gpipe")),
    "1f1b": (_one_f_one_b, _needs_one_stage_per_rank("1f1b")),
    "interleaved_1f1b": (_interleaved, _check_interleaved),
    "zb_h1": (_zb_h1, _needs_one_stage_per_rank("zb_h1")),
    "zbv": (_zbv, _check_v("zbv", lambda p: 1)),
    "dualpipev": (_dualpipev, _check_v("dualpipev", lambda p: 2 * p)),
}
"""name -> (generator, requirement check) for ``build_schedule``."""

STAGES_PER_RANK: dict[str, int] = {
    "gpipe": 1,
    "1f1b": 1,
    "interleaved_1f1b": 2,
    "zb_h1": 1,
    "zbv": 2,
    "dualpipev": 2,
}
"""name -> stages each rank holds (``build_schedule``'s default): a model cut for ``p`` ranks
needs ``p * STAGES_PER_RANK[name]`` stages. ``interleaved_1f1b`` also takes any value >= 2."""
