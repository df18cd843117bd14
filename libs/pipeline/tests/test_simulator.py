"""Simulator: textbook bubbles under unit costs, in-flight activations, renderings."""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

import pytest

from titan_pipeline import (
    Action,
    ActionKind,
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


def test_matplotlib_is_an_optional_extra_needed_only_to_draw(monkeypatch, tmp_path):
    meta = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    assert not any(d.startswith("matplotlib") for d in meta["dependencies"])
    assert any(d.startswith("matplotlib") for d in meta["optional-dependencies"]["plot"])
    t = simulate(build_schedule("1f1b", num_ranks=2, num_microbatches=2))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match=r"pip install 'titan-pipeline\[plot\]'"):
        t.to_png(tmp_path / "t.png")
    assert not (tmp_path / "t.png").exists()
    assert t.to_text()  # everything else works without it
