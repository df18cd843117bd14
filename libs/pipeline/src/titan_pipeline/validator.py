"""Check that a schedule can run: dependencies, matching sends and receives, no deadlock."""

from __future__ import annotations

from titan_pipeline.actions import Action, ActionKind, Schedule
from titan_pipeline.simulator import Costs, DeadlockError, channel_of, replay_schedule

__all__ = ["DeadlockError", "validate"]

F, B, I, W = ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W  # noqa: E741
_FREE = Costs(forward=0.0, backward=0.0, backward_input=0.0, backward_weight=0.0)


def validate(schedule: Schedule) -> None:
    """Raise ``ValueError`` naming the rank and the action at the first problem found.

    Checks, in order: every action names a stage of its rank and a valid microbatch; every
    action's inputs were produced or received earlier on that rank; every (stage,
    microbatch) gets exactly one F and exactly one backward (B, or I and W); on every
    channel the sends and the receives list the same microbatches in the same order; and a
    replay in which a send blocks until its receive is posted finishes (else
    ``DeadlockError`` naming the stuck ranks and the step each waits at).
    """
    owner = schedule.stage_to_rank
    num_stages, num_mb = schedule.num_stages, schedule.num_microbatches
    if not schedule.actions:
        raise ValueError("schedule has no ranks")
    for s, r in enumerate(owner):
        if not 0 <= r < schedule.num_ranks:
            raise ValueError(f"stage_to_rank[{s}] = {r} is not a rank in [0, {schedule.num_ranks})")
    for r in range(schedule.num_ranks):
        if r not in owner:
            raise ValueError(f"rank {r} holds no stage (stage_to_rank={owner})")

    channels: dict[tuple, dict[bool, list[int]]] = {}
    counts: dict[tuple[ActionKind, int, int], int] = {}
    for rank, acts in enumerate(schedule.actions):
        done: set[tuple[ActionKind, int, int]] = set()
        for pos, a in enumerate(acts):
            where = f"rank {rank}, action {pos} ({a})"
            if not (0 <= a.stage < num_stages and 0 <= a.microbatch < num_mb):
                raise ValueError(
                    f"{where}: stage must be in [0, {num_stages}) and microbatch in [0, {num_mb})"
                )
            if owner[a.stage] != rank:
                raise ValueError(f"{where}: stage {a.stage} is held by rank {owner[a.stage]}")
            key = (a.kind, a.stage, a.microbatch)
            if key in done:
                raise ValueError(f"{where}: appears twice")
            missing = _missing_input(a, rank, owner, done)
            if missing:
                raise ValueError(f"{where}: needs {missing} earlier on rank {rank}")
            done.add(key)
            counts[key] = counts.get(key, 0) + 1
            if not a.kind.is_compute:
                channel, is_send = channel_of(a, rank, owner)
                channels.setdefault(channel, {True: [], False: []})[is_send].append(a.microbatch)

    for s in range(num_stages):
        for mb in range(num_mb):
            fwd = counts.get((F, s, mb), 0)
            full = counts.get((B, s, mb), 0)
            split = (counts.get((I, s, mb), 0), counts.get((W, s, mb), 0))
            if fwd != 1 or (full, split) not in (((1, (0, 0))), (0, (1, 1))):
                raise ValueError(
                    f"stage {s} microbatch {mb} (rank {owner[s]}): needs exactly one F and one "
                    f"backward (B, or I and W); has F x{fwd}, B x{full}, I x{split[0]}, W x{split[1]}"
                )

    for (src, dst, kind, stage), ends in sorted(channels.items()):
        sends, recvs = ends[True], ends[False]
        if sends != recvs:
            raise ValueError(
                f"channel rank {src} -> rank {dst} ({kind} of stage {stage}): rank {src} sends "
                f"microbatches {sends} but rank {dst} receives {recvs}; they must match in order"
            )

    replay_schedule(schedule, _FREE, blocking_sends=True)


def _missing_input(a: Action, rank: int, owner: tuple[int, ...], done: set) -> str | None:
    """What ``a`` needs that has not happened yet on ``rank`` (None when nothing)."""
    s, mb, last = a.stage, a.microbatch, len(owner) - 1
    k = a.kind
    if k == ActionKind.SEND_F:
        if s == last or owner[s + 1] == rank:
            return f"a remote next stage (stage {s + 1} is on rank {rank} or does not exist)"
        return None if (F, s, mb) in done else str(Action(F, s, mb))
    if k == ActionKind.SEND_B:
        if s == 0 or owner[s - 1] == rank:
            return f"a remote previous stage (stage {s - 1} is on rank {rank} or does not exist)"
        ok = (B, s, mb) in done or (I, s, mb) in done
        return None if ok else f"{Action(B, s, mb)} or {Action(I, s, mb)}"
    if k == ActionKind.RECV_F:
        if s == 0 or owner[s - 1] == rank:
            return f"a remote previous stage (stage {s - 1} is on rank {rank} or does not exist)"
        return None
    if k == ActionKind.RECV_B:
        if s == last or owner[s + 1] == rank:
            return f"a remote next stage (stage {s + 1} is on rank {rank} or does not exist)"
        return None
    if k == F:
        if s == 0:
            return None
        need = (F, s - 1, mb) if owner[s - 1] == rank else (ActionKind.RECV_F, s, mb)
        return None if need in done else str(Action(*need))
    if k == W:
        return None if (I, s, mb) in done else str(Action(I, s, mb))
    # B or I: the forward of this microbatch, and the gradient of the stage output.
    if (F, s, mb) not in done:
        return str(Action(F, s, mb))
    if s == last:
        return None
    if owner[s + 1] == rank:
        ok = (B, s + 1, mb) in done or (I, s + 1, mb) in done
        return None if ok else f"{Action(B, s + 1, mb)} or {Action(I, s + 1, mb)}"
    need = (ActionKind.RECV_B, s, mb)
    return None if need in done else str(Action(*need))
