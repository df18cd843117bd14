"""Schedules: generated lists are valid, text/CSV round-trip, the validator catches errors."""

from __future__ import annotations

import pytest

from titan_pipeline import (
    SCHEDULES,
    STAGES_PER_RANK,
    Action,
    ActionKind,
    DeadlockError,
    Schedule,
    add_communication,
    build_schedule,
    simulate,
    validate,
)

V_SCHEDULES = {"interleaved_1f1b", "zbv", "dualpipev"}


def _configs():
    for name in sorted(SCHEDULES):
        for p in (1, 2, 3, 4):
            for m in (1, 2, 3, 4, 6, 8, 12):
                yield name, p, m


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_every_accepted_config_validates_and_covers_every_microbatch(name):
    v = 2 if name in V_SCHEDULES else 1
    built = 0
    for p in (1, 2, 3, 4):
        for m in (1, 2, 3, 4, 6, 8, 12):
            try:
                s = build_schedule(name, num_ranks=p, num_microbatches=m, stages_per_rank=v)
            except ValueError as e:
                assert "num_microbatches" in str(e), e  # only microbatch requirements refuse
                continue
            built += 1
            validate(s)  # build_schedule validated it; validate is idempotent
            kinds = {(a.kind, a.stage, a.microbatch) for acts in s.actions for a in acts}
            for stage in range(s.num_stages):
                for mb in range(m):
                    assert (ActionKind.F, stage, mb) in kinds
                    full = (ActionKind.B, stage, mb) in kinds
                    split = (ActionKind.I, stage, mb) in kinds and (
                        ActionKind.W,
                        stage,
                        mb,
                    ) in kinds
                    assert full != split
    assert built >= 10


def test_split_backward_only_in_zero_bubble_schedules():
    def kinds(name, v):
        s = build_schedule(name, num_ranks=4, num_microbatches=8, stages_per_rank=v)
        return {a.kind for acts in s.actions for a in acts}

    assert ActionKind.I not in kinds("1f1b", 1) and ActionKind.I not in kinds("gpipe", 1)
    assert ActionKind.B not in kinds("zb_h1", 1) and ActionKind.B not in kinds("zbv", 2)
    assert {ActionKind.B, ActionKind.I, ActionKind.W} <= kinds("dualpipev", 2)


def test_each_schedule_knows_its_stages_per_rank():
    # the table a trainer cuts its model by, and build_schedule's default
    assert STAGES_PER_RANK.keys() == SCHEDULES.keys()
    for name, v in STAGES_PER_RANK.items():
        s = build_schedule(name, num_ranks=2, num_microbatches=4)
        assert s.num_stages == 2 * v and all(len(s.stages_of_rank(r)) == v for r in range(2))
        if v != 1:
            with pytest.raises(ValueError, match="stages_per_rank"):
                build_schedule(name, num_ranks=2, num_microbatches=4, stages_per_rank=1)
    assert build_schedule("interleaved_1f1b", num_ranks=2, num_microbatches=4, stages_per_rank=3)


def test_v_schedules_put_first_and_last_stage_on_rank_0():
    s = build_schedule("zbv", num_ranks=4, num_microbatches=8, stages_per_rank=2)
    assert s.stage_to_rank == (0, 1, 2, 3, 3, 2, 1, 0)
    # the turn of the V (stage 3 -> 4) stays on rank 3: no communication for it
    comm = [a for a in s.actions[3] if not a.kind.is_compute]
    assert not any(a.kind == ActionKind.SEND_F and a.stage == 3 for a in comm)


@pytest.mark.parametrize(
    ("name", "kwargs", "needle"),
    [
        ("nope", {}, "schedule name must be one of"),
        ("1f1b", {"stages_per_rank": 2}, "stages_per_rank=1"),
        ("interleaved_1f1b", {"num_microbatches": 6}, "multiple of num_ranks=4"),
        ("interleaved_1f1b", {"stages_per_rank": 1}, "stages_per_rank >= 2"),
        ("zbv", {"stages_per_rank": 3}, "stages_per_rank=2"),
        ("dualpipev", {"num_microbatches": 7}, "num_microbatches >= 8"),
        ("gpipe", {"num_microbatches": 0}, "num_microbatches must be an int >= 1"),
    ],
)
def test_bad_arguments_name_the_value_and_the_requirement(name, kwargs, needle):
    args = {
        "num_ranks": 4,
        "num_microbatches": 8,
        "stages_per_rank": 2 if name in V_SCHEDULES else 1,
    }
    args.update(kwargs)
    with pytest.raises(ValueError, match=needle):
        build_schedule(name, **args)


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_text_and_csv_forms_round_trip(name):
    v = 2 if name in V_SCHEDULES else 1
    s = build_schedule(name, num_ranks=2, num_microbatches=4, stages_per_rank=v)
    again = Schedule.from_text(s.to_text(), name=name)
    assert again == s
    from_csv = Schedule.from_csv(s.to_csv(), name=name)
    assert from_csv.actions == s.actions  # CSV carries no mapping: loop order by default
    if name not in ("zbv", "dualpipev"):
        assert from_csv == s


def test_custom_compute_only_text_gets_communication_inserted():
    text = """
    # hand-written 1F1B on two ranks, two microbatches, compute only
    rank 0: F0.0 F0.1 B0.0 B0.1
    rank 1: F1.0 B1.0 F1.1 B1.1
    """
    s = add_communication(Schedule.from_text(text))
    validate(s)
    assert Action(ActionKind.SEND_F, 0, 1) in s.actions[0]
    assert Action(ActionKind.RECV_B, 0, 0) in s.actions[0]


def test_validator_rejects_deadlock_and_names_the_stuck_ranks():
    # rank 0 waits for a gradient before it sends the activation rank 1 needs to make it
    text = """
    rank 0: F0.0 RECV_B0.0 B0.0 SEND_F0.0
    rank 1: RECV_F1.0 F1.0 B1.0 SEND_B1.0
    """
    with pytest.raises(DeadlockError, match=r"ranks \[0, 1\] are stuck") as info:
        validate(Schedule.from_text(text))
    assert info.value.stuck == {
        0: "B0.0 (for the data of RECV_B0.0)",
        1: "F1.0 (for the data of RECV_F1.0)",
    }


def test_validator_assumes_a_batch_completes_as_one_work():
    # rank 1 posts both receives in one batch; under gloo each op completes on its own and
    # the simulator runs it, but a backend that coalesces the batch into one work (NCCL) makes
    # F1.0 wait for F0.1, which rank 0 computes only after rank 1's first backward
    text = """
    rank 0: F0.0 SEND_F0.0 RECV_B0.0 B0.0 F0.1 SEND_F0.1 RECV_B0.1 B0.1
    rank 1: RECV_F1.0 RECV_F1.1 F1.0 B1.0 SEND_B1.0 F1.1 B1.1 SEND_B1.1
    """
    s = Schedule.from_text(text)
    assert len(simulate(s).intervals[1]) == 4
    with pytest.raises(DeadlockError, match=r"rank 1 waits at F1.0 \(for the data of RECV_F1.0\)"):
        validate(s)


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("rank 0: F0.0 B0.0\nrank 1: F1.0 B1.0", r"rank 0, action 1 \(B0.0\): needs RECV_B0.0"),
        ("rank 0: F0.0 B0.0", None),
        ("rank 0: F0.0", "needs exactly one F and one backward"),
        ("rank 0: F0.0 I0.0", r"has F x1, B x0, I x1, W x0"),
        ("rank 0: F0.0 B0.0 B0.0", "appears twice"),
        ("rank 0: B0.0 F0.0", r"rank 0, action 0 \(B0.0\): needs F0.0"),
        (
            "rank 0: F0.0 F0.1 SEND_F0.1 SEND_F0.0 RECV_B0.0 B0.0 RECV_B0.1 B0.1\n"
            "rank 1: RECV_F1.0 RECV_F1.1 F1.0 F1.1 B1.0 SEND_B1.0 B1.1 SEND_B1.1",
            r"rank 0 sends microbatches \[1, 0\] but rank 1 receives \[0, 1\]",
        ),
    ],
)
def test_validator_errors_name_the_rank_and_the_action(text, needle):
    s = Schedule.from_text(text)
    if needle is None:
        validate(s)
    else:
        with pytest.raises(ValueError, match=needle):
            validate(s)


def test_text_parse_errors():
    with pytest.raises(ValueError, match="KIND<stage>.<microbatch>"):
        Schedule.from_text("rank 0: X0.0")
    with pytest.raises(ValueError, match="listed twice"):
        Schedule.from_text("rank 0: F0.0\nrank 0: B0.0")
    with pytest.raises(ValueError, match="header"):
        Schedule.from_csv("a,b,c,d\n")
