"""Ranks sharing processors (``titan_pipeline.experimental``): fluid sharing and the measured
contention model reduce to the plain replay where they should, and calibrate from timelines."""

from __future__ import annotations

import pytest

from titan_pipeline import Action, ActionKind, Costs, Interval, Timeline, build_schedule, simulate
from titan_pipeline.experimental import Contention, simulate_shared


@pytest.mark.parametrize(
    ("name", "v"), [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1), ("zbv", 2)]
)
def test_shared_processors_reduce_to_the_plain_replay_with_a_core_per_rank(name, v):
    s = build_schedule(name, num_ranks=4, num_microbatches=8, stages_per_rank=v)
    uneven = Costs(
        forward=tuple(1.0 + 0.25 * i for i in range(s.num_stages)),
        backward=2.5,
        backward_input=1.25,
        backward_weight=0.75,
        communication=0.3,
        posting=0.125,
    )
    for costs in (uneven, Costs()):  # Costs(): free posts and transfers
        plain, shared = simulate(s, costs), simulate_shared(s, costs, cores=4)
        for a, b in zip(plain.intervals, shared.intervals, strict=True):
            assert [i.action for i in a] == [i.action for i in b]
            assert [i.start for i in a] == pytest.approx([i.start for i in b])
            assert [i.end for i in a] == pytest.approx([i.end for i in b])


def test_two_ranks_on_one_core_share_it():
    # GPipe, 2 ranks, 2 microbatches, F=1, B=2: F0.1 (rank 0) overlaps F1.0 (rank 1) and
    # both run at half speed: 1 + 2 for the pair
    s = build_schedule("gpipe", num_ranks=2, num_microbatches=2)
    t = simulate_shared(s, Costs(), cores=1)
    f01 = t.intervals[0][1]
    f10 = t.intervals[1][0]
    assert (f01.start, f01.end) == (1.0, 3.0) and (f10.start, f10.end) == (1.0, 3.0)
    # one core that is never idle: the makespan is all the work, 2 x (1 + 1 + 2 + 2),
    # against 9 with a core per rank
    assert t.total_time == pytest.approx(12.0) and simulate(s).total_time == 9.0
    with pytest.raises(ValueError, match="cores must be an int >= 1"):
        simulate_shared(s, cores=0)


@pytest.mark.parametrize(("name", "v"), [("1f1b", 1), ("zb_h1", 1), ("dualpipev", 2)])
def test_contention_with_unit_stretch_and_fixed_posts_is_the_plain_replay(name, v):
    s = build_schedule(name, num_ranks=4, num_microbatches=8, stages_per_rank=v)
    costs = Costs(forward=1.5, backward=2.5, communication=0.3, posting=0.125)
    fixed = Contention(stretch=((1.0,),) * 4, posting=((0.125,),) * 4, transfer=(0.3,))
    # the drawn transfer time replaces Costs.communication
    free = Costs(forward=1.5, backward=2.5, posting=0.125)
    plain, drawn = simulate(s, costs), simulate_shared(s, free, contention=fixed, seed=3)
    for a, b in zip(plain.intervals, drawn.intervals, strict=True):
        assert [(i.action, i.start, i.end) for i in a] == [
            (i.action, pytest.approx(i.start), pytest.approx(i.end)) for i in b
        ]
    # a constant stretch of 2 with free posts and transfers is the replay at doubled costs
    doubled = simulate(s, Costs(forward=3.0, backward=5.0, backward_input=2, backward_weight=2))
    stretched = simulate_shared(
        s, Costs(forward=1.5, backward=2.5), contention=Contention(((2.0,),), ((0.0,),))
    )
    assert stretched.total_time == pytest.approx(doubled.total_time)
    assert stretched.bubble_ratio == pytest.approx(doubled.bubble_ratio)


def test_contention_stretches_by_how_many_other_ranks_are_busy():
    # GPipe, 2 ranks, 2 microbatches, F=1, B=2, free posts: alone x1, with one other busy x3
    s = build_schedule("gpipe", num_ranks=2, num_microbatches=2)
    t = simulate_shared(s, Costs(), contention=Contention(((1.0,), (3.0,)), ((0.0,), (0.0,))))
    got = [[(str(i.action), i.start, i.end) for i in ivs] for ivs in t.intervals]
    assert got == [
        # rank 1 posts its receives at 0, so F0.0 starts with one other busy rank
        [("F0.0", 0.0, 3.0), ("F0.1", 3.0, 6.0), ("B0.0", 9.0, 15.0), ("B0.1", 15.0, 17.0)],
        # F1.0 and F0.1 begin together (both x3); F1.1 and B1.0 run alone
        [("F1.0", 3.0, 6.0), ("F1.1", 6.0, 7.0), ("B1.0", 7.0, 9.0), ("B1.1", 9.0, 15.0)],
    ]


def test_contention_draws_stretch_from_actions_of_similar_length():
    # one rank: F (1 alone) draws only the factor seen on an action of ~1, B (2.5) only the
    # one seen on ~2.5; without lengths either factor may be drawn for either
    s = build_schedule("gpipe", num_ranks=1, num_microbatches=4)
    by_length = Contention(((1.0, 3.0),), ((0.0,),), stretch_alone=((2.4, 1.1),))
    assert by_length.stretch == ((3.0, 1.0),) and by_length.stretch_alone == ((1.1, 2.4),)
    costs = Costs(forward=1.0, backward=2.5)
    for seed in range(5):
        t = simulate_shared(s, costs, contention=by_length, seed=seed)
        assert t.total_time == pytest.approx(4 * (3.0 + 2.5))
    mixed = {
        simulate_shared(
            s, costs, contention=Contention(((3.0, 1.0),), ((0.0,),)), seed=k
        ).total_time
        for k in range(20)
    }
    assert len(mixed) > 1
    with pytest.raises(ValueError, match="one time alone per stretch sample"):
        Contention(((3.0, 1.0),), ((0.0,),), stretch_alone=((1.0,),))


def test_contention_samples_depend_only_on_the_seed():
    s = build_schedule("zbv", num_ranks=2, num_microbatches=4, stages_per_rank=2)
    c = Contention(((1.0, 1.5, 4.0), (1.0, 2.0, 6.0)), ((0.1, 0.5), (0.2, 0.9)))
    runs = [simulate_shared(s, Costs(), contention=c, seed=k) for k in (0, 0, 1)]
    assert runs[0].intervals == runs[1].intervals != runs[2].intervals
    with pytest.raises(ValueError, match=r"exactly one of cores= .* or contention="):
        simulate_shared(s, contention=c, cores=2)
    with pytest.raises(ValueError, match=r"exactly one of cores= .* or contention="):
        simulate_shared(s)


def test_contention_calibrates_from_measured_timelines():
    f = ActionKind
    intervals = (
        (Interval(Action(f.F, 0, 0), 0.0, 1.0), Interval(Action(f.F, 0, 1), 1.5, 3.0)),
        (Interval(Action(f.F, 1, 0), 1.5, 3.5), Interval(Action(f.B, 1, 0), 4.0, 5.0)),
    )
    posts = (
        (Interval(Action(f.SEND_F, 0, 0), 1.0, 1.1), Interval(Action(f.SEND_F, 0, 1), 3.2, 3.6)),
        (Interval(Action(f.RECV_F, 1, 0), 0.5, 0.9),),
    )
    alone = Costs(forward=1.0, backward=(0.5, 0.5))
    # rank 1 waited for F1.0's input from 1.0, before the send's post ended (1.1), until 1.5
    waits = ((), (Interval(Action(f.RECV_F, 1, 0), 1.0, 1.5),))
    c = Contention.from_timelines([(Timeline(intervals, posts, waits), alone)])
    assert c.transfer == pytest.approx((0.4,))
    # F0.0 started alone (rank 1 had not posted yet), B1.0 too; F0.1 and F1.0 together
    assert sorted(c.stretch[0]) == [1.0, 2.0] and sorted(c.stretch[1]) == [1.5, 2.0]
    # each factor with the time alone of its action, sorted by it
    assert c.stretch_alone == ((0.5, 1.0), (1.0, 1.0)) and c.stretch[0] == (2.0, 1.0)
    # rank 1 posted while rank 0 computed, rank 0 its second send while rank 1 computed; its
    # first send went to rank 1 waiting for it (from 1.0), while no other rank was busy
    assert c.posting[1] == pytest.approx((0.4, 0.4)) and c.posting[0] == ()
    assert c.waking[0] == pytest.approx((0.1,)) and c.waking[1] == ()
    with pytest.raises(ValueError, match="at least one"):
        Contention.from_timelines([])
    with pytest.raises(ValueError, match=r"Contention.stretch must hold samples >= 0"):
        Contention(((1.0, -0.5),), ((0.1,),))
