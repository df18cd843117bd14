"""Simulator: textbook bubbles under unit costs, in-flight activations, renderings."""

from __future__ import annotations

import pytest

from titan_pipeline import (
    Action,
    ActionKind,
    Contention,
    Costs,
    Interval,
    Timeline,
    build_schedule,
    compare,
    simulate,
)


@pytest.mark.parametrize(("p", "m"), [(2, 4), (2, 8), (4, 4), (4, 8), (4, 16), (8, 32)])
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_gpipe_and_1f1b_bubble_is_p_minus_1_over_m_plus_p_minus_1(name, p, m):
    t = simulate(build_schedule(name, num_ranks=p, num_microbatches=m))
    assert t.bubble_ratio == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)


@pytest.mark.parametrize(("p", "m", "v"), [(2, 4, 2), (2, 8, 2), (4, 8, 2), (4, 16, 2), (4, 8, 3)])
def test_interleaved_bubble_is_p_minus_1_over_vm_plus_p_minus_1(p, m, v):
    # each of the v stages on a rank costs 1/v of the rank's share: unit costs per stage
    t = simulate(
        build_schedule("interleaved_1f1b", num_ranks=p, num_microbatches=m, stages_per_rank=v)
    )
    assert t.bubble_ratio == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12)


@pytest.mark.parametrize(("p", "m"), [(2, 8), (4, 8), (4, 16), (8, 32)])
def test_zb_h1_idle_time_is_one_third_of_1f1b_with_the_same_peak_memory(p, m):
    costs = Costs(forward=1, backward_input=1, backward_weight=1, backward=2)
    zb = simulate(build_schedule("zb_h1", num_ranks=p, num_microbatches=m), costs)
    one = simulate(build_schedule("1f1b", num_ranks=p, num_microbatches=m), costs)
    idle = lambda t: t.total_time * p - sum(t.busy_time(r) for r in range(p))  # noqa: E731
    assert idle(zb) == pytest.approx(idle(one) / 3)
    assert max(zb.peak_in_flight) == max(one.peak_in_flight) == p


@pytest.mark.parametrize(("p", "m"), [(2, 4), (2, 8), (4, 8), (4, 16), (8, 16)])
@pytest.mark.parametrize("name", ["zbv", "dualpipev"])
def test_v_schedules_leave_only_the_start_up_bubble_for_m_at_least_2p(name, p, m):
    # zero bubble in the steady state: each rank idles p - 1 units (waiting for its first
    # input) out of 6m units of work, whatever m is
    t = simulate(build_schedule(name, num_ranks=p, num_microbatches=m, stages_per_rank=2))
    assert t.bubble_ratio == pytest.approx((p - 1) / (6 * m + p - 1), abs=1e-12)


@pytest.mark.parametrize(("p", "m"), [(2, 8), (4, 8), (4, 16)])
def test_peak_in_flight_1f1b_at_most_p_and_gpipe_m(p, m):
    one = simulate(build_schedule("1f1b", num_ranks=p, num_microbatches=m))
    gp = simulate(build_schedule("gpipe", num_ranks=p, num_microbatches=m))
    assert one.peak_in_flight == tuple(p - r for r in range(p))
    assert gp.peak_in_flight == (m,) * p


def test_communication_cost_delays_receivers():
    s = build_schedule("1f1b", num_ranks=2, num_microbatches=4)
    free = simulate(s)
    slow = simulate(s, Costs(communication=0.5))
    assert slow.intervals[1][0].start == 1.5  # F0 on rank 0 ends at 1, arrives 0.5 later
    assert slow.total_time > free.total_time


def test_receives_are_posted_one_round_ahead_so_transfers_overlap_compute():
    # GPipe's last stage posts the receive of microbatch k before it computes microbatch
    # k - 1: with a transfer no longer than that forward, only the first one is exposed
    s = build_schedule("gpipe", num_ranks=2, num_microbatches=4)
    assert [str(a) for a in s.actions[1][:5]] == [
        "RECV_F1.0",
        "RECV_F1.1",
        "F1.0",
        "RECV_F1.2",
        "F1.1",
    ]
    t = simulate(s, Costs(communication=0.5))
    starts = [iv.start for iv in t.intervals[1][:4]]
    assert starts == [1.5, 2.5, 3.5, 4.5]


def test_posting_cost_and_rendezvous_transfer():
    s = build_schedule("1f1b", num_ranks=2, num_microbatches=2)
    t = simulate(s, Costs(posting=0.25, communication=0.5))
    # rank 1 posts its receive at 0.25; rank 0 computes F0.0 (0-1) and posts until 1.25;
    # the data is usable 0.5 after the later end: 1.75
    assert t.intervals[1][0].start == 1.75
    assert t.intervals[0][1].start == 1.25  # F0.1 waits for the SEND_F0.0 post


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
        plain, shared = simulate(s, costs), simulate(s, costs, cores=4)
        for a, b in zip(plain.intervals, shared.intervals, strict=True):
            assert [i.action for i in a] == [i.action for i in b]
            assert [i.start for i in a] == pytest.approx([i.start for i in b])
            assert [i.end for i in a] == pytest.approx([i.end for i in b])


def test_two_ranks_on_one_core_share_it():
    # GPipe, 2 ranks, 2 microbatches, F=1, B=2: F0.1 (rank 0) overlaps F1.0 (rank 1) and
    # both run at half speed: 1 + 2 for the pair
    s = build_schedule("gpipe", num_ranks=2, num_microbatches=2)
    t = simulate(s, Costs(), cores=1)
    f01 = t.intervals[0][1]
    f10 = t.intervals[1][0]
    assert (f01.start, f01.end) == (1.0, 3.0) and (f10.start, f10.end) == (1.0, 3.0)
    # one core that is never idle: the makespan is all the work, 2 x (1 + 1 + 2 + 2),
    # against 9 with a core per rank
    assert t.total_time == pytest.approx(12.0) and simulate(s).total_time == 9.0
    with pytest.raises(ValueError, match="cores must be an int >= 1"):
        simulate(s, cores=0)


@pytest.mark.parametrize(("name", "v"), [("1f1b", 1), ("zb_h1", 1), ("dualpipev", 2)])
def test_contention_with_unit_stretch_and_fixed_posts_is_the_plain_replay(name, v):
    s = build_schedule(name, num_ranks=4, num_microbatches=8, stages_per_rank=v)
    costs = Costs(forward=1.5, backward=2.5, communication=0.3, posting=0.125)
    fixed = Contention(stretch=((1.0,),) * 4, posting=((0.125,),) * 4, transfer=(0.3,))
    # the drawn transfer time replaces Costs.communication
    free = Costs(forward=1.5, backward=2.5, posting=0.125)
    plain, drawn = simulate(s, costs), simulate(s, free, contention=fixed, seed=3)
    for a, b in zip(plain.intervals, drawn.intervals, strict=True):
        assert [(i.action, i.start, i.end) for i in a] == [
            (i.action, pytest.approx(i.start), pytest.approx(i.end)) for i in b
        ]
    # a constant stretch of 2 with free posts and transfers is the replay at doubled costs
    doubled = simulate(s, Costs(forward=3.0, backward=5.0, backward_input=2, backward_weight=2))
    stretched = simulate(
        s, Costs(forward=1.5, backward=2.5), contention=Contention(((2.0,),), ((0.0,),))
    )
    assert stretched.total_time == pytest.approx(doubled.total_time)
    assert stretched.bubble_ratio == pytest.approx(doubled.bubble_ratio)


def test_contention_stretches_by_how_many_other_ranks_are_busy():
    # GPipe, 2 ranks, 2 microbatches, F=1, B=2, free posts: alone x1, with one other busy x3
    s = build_schedule("gpipe", num_ranks=2, num_microbatches=2)
    t = simulate(s, Costs(), contention=Contention(((1.0,), (3.0,)), ((0.0,), (0.0,))))
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
        t = simulate(s, costs, contention=by_length, seed=seed)
        assert t.total_time == pytest.approx(4 * (3.0 + 2.5))
    mixed = {
        simulate(s, costs, contention=Contention(((3.0, 1.0),), ((0.0,),)), seed=k).total_time
        for k in range(20)
    }
    assert len(mixed) > 1
    with pytest.raises(ValueError, match="one time alone per stretch sample"):
        Contention(((3.0, 1.0),), ((0.0,),), stretch_alone=((1.0,),))


def test_contention_samples_depend_only_on_the_seed():
    s = build_schedule("zbv", num_ranks=2, num_microbatches=4, stages_per_rank=2)
    c = Contention(((1.0, 1.5, 4.0), (1.0, 2.0, 6.0)), ((0.1, 0.5), (0.2, 0.9)))
    runs = [simulate(s, Costs(), contention=c, seed=k) for k in (0, 0, 1)]
    assert runs[0].intervals == runs[1].intervals != runs[2].intervals
    with pytest.raises(ValueError, match="not both"):
        simulate(s, contention=c, cores=2)


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


def test_costs_from_a_timeline_calibrate_posting_and_transfer():
    f = ActionKind
    intervals = (
        (Interval(Action(f.F, 0, 0), 0.0, 1.0),),
        (Interval(Action(f.F, 1, 0), 3.0, 4.0),),
    )
    posts = (
        (Interval(Action(f.SEND_F, 0, 0), 1.0, 1.2),),
        (Interval(Action(f.RECV_F, 1, 0), 0.0, 0.4),),
    )
    # the wait blocked from 0.5 until 3.0; both ends were posted by 1.2: transfer 1.8
    waits = ((), (Interval(Action(f.RECV_F, 1, 0), 0.5, 3.0),))
    c = Costs.from_timeline(Timeline(intervals, posts, waits), 2)
    assert c.posting == pytest.approx(0.3) and c.communication == pytest.approx(1.8)
    assert c.forward == (1.0, 1.0)
    assert Costs.from_timeline(Timeline(intervals), 2).communication == 0.0


def test_per_stage_costs_and_costs_from_a_timeline():
    s = build_schedule("gpipe", num_ranks=2, num_microbatches=2)
    t = simulate(s, Costs(forward=(1.0, 3.0), backward=(2.0, 6.0)))
    assert t.total_time == pytest.approx(1 + 3 + 3 + 6 + 6 + 2)
    again = simulate(s, Costs.from_timeline(t, s.num_stages))
    assert again.intervals == t.intervals
    assert compare(t, again).difference == 0


def test_text_and_png_rendering(tmp_path):
    t = simulate(build_schedule("zbv", num_ranks=2, num_microbatches=4, stages_per_rank=2))
    text = t.to_text()
    lines = text.splitlines()
    assert len(lines) == 4 and lines[0].startswith("rank  0 |F")
    assert set(lines[0].split("|")[1]) <= set("FIWfiw.")
    assert "f" in lines[0] and "." in lines[2]  # rank 0's second stage; rank 1 waits first
    png = t.to_png(tmp_path / "zbv.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_compare_needs_the_same_ranks():
    t = simulate(build_schedule("1f1b", num_ranks=2, num_microbatches=4))
    with pytest.raises(ValueError, match="ranks"):
        compare(t, Timeline((t.intervals[0],)))
    assert isinstance(t.intervals[0][0], Interval)
