"""Runtime on real gloo groups: every schedule's gradients and losses equal plain training."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from titan_pipeline import (
    Costs,
    PipelineStage,
    TimelineRecorder,
    balance,
    build_schedule,
    build_stages,
    compare,
    measure_costs,
    run,
    simulate,
    split_microbatches,
    split_units,
)
from titan_pipeline.experimental import Contention, simulate_shared
from titan_testing import run_distributed

NUM_MICROBATCHES = 8
BATCH, DIM = 16, 12
SCHEDULES = [
    ("gpipe", 1),
    ("1f1b", 1),
    ("interleaved_1f1b", 2),
    ("zb_h1", 1),
    ("zbv", 2),
    ("dualpipev", 2),
]


def _units(num_units: int) -> list[nn.Module]:
    torch.manual_seed(0)
    units: list[nn.Module] = [nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh())]
    for _ in range(num_units - 2):
        units.append(nn.Sequential(nn.LayerNorm(DIM), nn.Linear(DIM, DIM), nn.GELU()))
    units.append(nn.Linear(DIM, 3))
    return units


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, DIM, generator=g), torch.randn(BATCH, 3, generator=g)


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, target)


def _reference(num_units: int) -> tuple[dict[str, torch.Tensor], float]:
    """Non-pipelined single-process step on the whole batch: named grads and the loss."""
    units = _units(num_units)
    model = nn.Sequential(*units)
    x, y = _data()
    loss = _loss(model(x), y)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, loss.item()


def _local_grads(units, schedule, rank) -> dict[str, torch.Tensor]:
    costs = [sum(p.numel() for p in u.parameters()) for u in units]
    ranges = balance(costs, schedule.num_stages)
    out = {}
    for s in schedule.stages_of_rank(rank):
        for i in ranges[s]:
            for n, p in units[i].named_parameters():
                out[f"{i}.{n}"] = p.grad.clone()
    return out


def _all_schedules_on_ranks(num_units: int) -> dict:
    """On each rank: every schedule twice, plus bad-input and measured-timeline checks."""
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = _data()
    mbs, tgts = split_microbatches(x, NUM_MICROBATCHES), split_microbatches(y, NUM_MICROBATCHES)
    results: dict = {}
    for name, v in SCHEDULES:
        schedule = build_schedule(
            name, num_ranks=world, num_microbatches=NUM_MICROBATCHES, stages_per_rank=v
        )
        runs = []
        for broadcast in (False, True):  # the second run hands every rank the losses
            units = _units(num_units)
            stages = build_stages(units, schedule, rank)
            losses = run(schedule, stages, mbs, tgts, _loss, broadcast_losses=broadcast)
            runs.append((_local_grads(units, schedule, rank), [loss.item() for loss in losses]))
        (grads, losses), (grads2, broadcast_losses) = runs
        bitwise = grads.keys() == grads2.keys() and all(
            torch.equal(grads[k], grads2[k]) for k in grads
        )
        results[name] = {"grads": grads, "losses": losses, "bitwise": bitwise}
        results[name]["broadcast"] = broadcast_losses
        units = _units(num_units)  # evaluation: the same losses, no gradient anywhere
        stages = build_stages(units, schedule, rank)
        evaluated = run(schedule, stages, mbs, tgts, _loss, forward_only=True)
        no_grads = all(p.grad is None for u in units for p in u.parameters())
        results[name]["eval"] = ([loss.item() for loss in evaluated], no_grads)
        # the same stages again: the shape agreed last run is reused; then a new microbatch
        # shape (rows doubled, so the mean losses stay) must be shared, then the old one again
        again = run(schedule, stages, mbs, tgts, _loss, forward_only=True, broadcast_losses=True)
        doubled = run(
            schedule,
            stages,
            [torch.cat([m, m]) for m in mbs],
            [torch.cat([t, t]) for t in tgts],
            _loss,
            forward_only=True,
        )
        back = run(schedule, stages, mbs, tgts, _loss, forward_only=True)
        results[name]["reshaped"] = [
            [loss.item() for loss in losses] for losses in (again, doubled, back)
        ]

    # stage modules that do not fit: every rank raises the same ValueError, nothing is sent
    units = _units(num_units)
    units[2] = nn.Linear(DIM + 1, DIM)
    schedule = build_schedule("1f1b", num_ranks=world, num_microbatches=NUM_MICROBATCHES)
    try:
        run(schedule, build_stages(units, schedule, rank), mbs, tgts, _loss)
        results["shape_error"] = None
    except ValueError as e:
        results["shape_error"] = str(e)
    # a wrong number of microbatches on the first rank only: every rank still raises
    try:
        stages = build_stages(_units(num_units), schedule, rank)
        run(schedule, stages, mbs[:-1] if rank == 0 else None, tgts, _loss)
        results["count_error"] = None
    except ValueError as e:
        results["count_error"] = str(e)

    # measured timeline, compared with the simulation under the measured costs
    schedule = build_schedule("1f1b", num_ranks=world, num_microbatches=NUM_MICROBATCHES)
    stages = build_stages(_units(num_units), schedule, rank)
    alone = measure_costs(schedule, stages, mbs[0], tgts[0], _loss, repeats=2)
    untouched = all(p.grad is None for st in stages for p in st.module.parameters())
    recorder = TimelineRecorder()
    run(schedule, stages, mbs, tgts, _loss, recorder=recorder)
    measured = recorder.gather()
    contention = Contention.from_timelines([(measured, alone)])
    predicted = simulate_shared(schedule, alone, contention=contention, seed=rank)
    results["alone"] = (
        (alone.forward, alone.backward, alone.backward_input, alone.backward_weight),
        untouched,
        [len(ivs) for ivs in predicted.intervals],
    )
    costs = Costs.from_timeline(measured, schedule.num_stages)
    simulated = simulate(schedule, costs)
    mine = schedule.actions[rank]
    results["timeline"] = (
        [len(ivs) for ivs in measured.intervals],
        measured.bubble_ratio,
        compare(simulated, measured).difference,
        # every communication action has its post (in list order), every receive its wait
        # (in the order of the actions that consume them)
        (
            [iv.action for iv in measured.posts[rank]] == [a for a in mine if not a.kind.is_compute]
            and sorted(str(iv.action) for iv in measured.waits[rank])
            == sorted(str(a) for a in mine if a.kind.name.startswith("RECV"))
        ),
        costs.posting > 0 and costs.communication >= 0,
    )
    return results


def _check(world: int, num_units: int, results: list[dict]) -> None:
    ref_grads, ref_loss = _reference(num_units)
    for name, _ in SCHEDULES:
        merged: dict[str, torch.Tensor] = {}
        losses = []
        for r in results:
            merged.update(r[name]["grads"])
            losses += r[name]["losses"]
            assert r[name]["bitwise"], f"{name}: two runs differ"
        assert merged.keys() == ref_grads.keys(), name
        for k, g in ref_grads.items():
            torch.testing.assert_close(merged[k], g, rtol=0, atol=1e-6, msg=f"{name} {k}")
        assert len(losses) == NUM_MICROBATCHES, name  # only the last stage's rank reports
        evaluated = [x for r in results for x in r[name]["eval"][0]]
        assert evaluated == losses and all(r[name]["eval"][1] for r in results), name
        _, doubled, back = ([x for r in results for x in r[name]["reshaped"][i]] for i in range(3))
        assert back == losses, name
        # asked for, every rank gets the last stage's losses, bitwise (training and evaluation)
        for r in results:
            assert r[name]["broadcast"] == losses and r[name]["reshaped"][0] == losses, name
        assert doubled == pytest.approx(losses, rel=1e-6), name
        assert sum(losses) / NUM_MICROBATCHES == pytest.approx(ref_loss, abs=1e-6)
    # same stage layout and a full backward: the same sums in the same order, bitwise
    for k in ref_grads:
        gp = next(r["gpipe"]["grads"] for r in results if k in r["gpipe"]["grads"])[k]
        ob = next(r["1f1b"]["grads"] for r in results if k in r["1f1b"]["grads"])[k]
        assert torch.equal(gp, ob), k
    for r in results:
        assert "cannot take" in r["shape_error"]
        assert "must match the next stage's input" in r["shape_error"]
        assert (
            "rank 0: microbatches must hold num_microbatches=8 tensors, got 7" in r["count_error"]
        )
        # every rank gets every stage's time alone, the same everywhere
        kinds, untouched, predicted = r["alone"]
        assert kinds == results[0]["alone"][0] and untouched
        assert all(len(k) == world and min(k) > 0 for k in kinds)
        assert predicted == [2 * NUM_MICROBATCHES] * world
        counts, bubble, diff, comm_recorded, calibrated = r["timeline"]
        assert counts == [2 * NUM_MICROBATCHES] * world
        assert 0 <= bubble < 1 and abs(diff) < 1
        assert comm_recorded and calibrated


def test_every_schedule_matches_single_process_training_on_2_ranks():
    results = run_distributed(_all_schedules_on_ranks, 2, 8, timeout=300)
    _check(2, 8, results)


@pytest.mark.slow
@pytest.mark.extended  # the 2-rank run of every schedule is in the fast suite
def test_every_schedule_matches_single_process_training_on_4_ranks():
    results = run_distributed(_all_schedules_on_ranks, 4, 8, timeout=400)
    _check(4, 8, results)


def test_single_process_run_and_bad_batch():
    schedule = build_schedule("zbv", num_ranks=1, num_microbatches=4, stages_per_rank=2)
    units = _units(4)
    x, y = _data()
    losses = run(
        schedule,
        build_stages(units, schedule, 0),
        split_microbatches(x, 4),
        split_microbatches(y, 4),
        _loss,
    )
    ref_grads, ref_loss = _reference(4)
    got = dict(nn.Sequential(*units).named_parameters())
    for k, g in ref_grads.items():
        torch.testing.assert_close(got[k].grad, g, rtol=0, atol=1e-6)
    assert sum(loss.item() for loss in losses) / 4 == pytest.approx(ref_loss, abs=1e-6)
    with pytest.raises(ValueError, match="cannot be split into num_microbatches=3"):
        split_microbatches(x, 3)
    with pytest.raises(ValueError, match="places stages"):
        run(schedule, build_stages(units, schedule, 0)[:1], split_microbatches(x, 4), None, _loss)
    with pytest.raises(ValueError, match="stage_index"):
        PipelineStage(nn.Linear(2, 2), 3, 2)


def test_stage_parameters_feed_a_standard_optimizer():
    # AdamW over the stages' parameters, 3 steps of zbv on one process, against the same
    # AdamW steps of the unsplit model
    schedule = build_schedule("zbv", num_ranks=1, num_microbatches=4)
    units, ref = _units(4), nn.Sequential(*_units(4))
    stages = build_stages(units, schedule, 0)
    assert stages[0].module[0] is units[0] and stages[1].module[0] is units[2]
    named = [n for n, _ in stages[1].named_parameters()]
    assert named == [n for n, _ in stages[1].module.named_parameters()] and named[0] == "0.0.weight"
    opt = torch.optim.AdamW([p for st in stages for p in st.parameters()], lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    x, y = _data()
    for _ in range(3):
        opt.zero_grad()
        run(schedule, stages, split_microbatches(x, 4), split_microbatches(y, 4), _loss)
        opt.step()
        ref_opt.zero_grad()
        _loss(ref(x), y).backward()
        ref_opt.step()
    for (n, p), q in zip(nn.Sequential(*units).named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6, msg=n)


def test_measure_costs_times_each_stage_alone_and_leaves_no_trace():
    schedule = build_schedule("zbv", num_ranks=1, num_microbatches=4, stages_per_rank=2)
    units = _units(4)
    stages = build_stages(units, schedule, 0)
    x, y = _data()
    mbs, tgts = split_microbatches(x, 4), split_microbatches(y, 4)
    marker = torch.full_like(units[0][0].weight, 7.0)
    units[0][0].weight.grad = marker
    costs = measure_costs(schedule, stages, mbs[0], tgts[0], _loss, repeats=2)
    assert len(costs.forward) == len(costs.backward) == len(costs.backward_weight) == 2
    assert min(costs.forward + costs.backward + costs.backward_weight) > 0
    assert units[0][0].weight.grad is marker
    assert all(p.grad is None for u in units[1:] for p in u.parameters())
    assert not any(st._inputs or st._outputs or st._split for st in stages)
    units[0][0].weight.grad = None  # a step afterwards is plain training
    run(schedule, stages, mbs, tgts, _loss)
    ref_grads, _ = _reference(4)
    got = dict(nn.Sequential(*units).named_parameters())
    for k, g in ref_grads.items():
        torch.testing.assert_close(got[k].grad, g, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="repeats must be an int >= 1"):
        measure_costs(schedule, stages, mbs[0], tgts[0], _loss, repeats=0)


def test_split_units_balances_by_parameter_count():
    units = [nn.Linear(10, 10), nn.Linear(10, 1), nn.Linear(1, 1), nn.Linear(10, 10)]
    assert [list(r) for r in balance([110, 11, 2, 110], 2)] == [[0, 1], [2, 3]]
    assert [len(s) for s in split_units(units, 3)] == [1, 2, 1]
    assert [list(r) for r in balance([1, 1, 1, 1], 4)] == [[0], [1], [2], [3]]
    with pytest.raises(ValueError, match="need >= 1 unit each"):
        balance([1, 2], 3)


class _Scaled(nn.Module):
    """A stage whose forward needs a per-microbatch side input."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, *, scale: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)) * scale


@pytest.mark.parametrize("name", ["1f1b", "zb_h1", "zbv"])
def test_stage_kwargs_reach_every_stage_and_hooks_see_every_gradient(name):
    torch.manual_seed(0)
    per_rank = 2 if name == "zbv" else 1
    units = [_Scaled() for _ in range(per_rank)]
    schedule = build_schedule(name, num_ranks=1, num_microbatches=4, stages_per_rank=per_rank)
    x, y = torch.randn(8, DIM), torch.randn(8, DIM)
    scales = [torch.full((2, 1), float(i + 1)) for i in range(4)]
    hooked: list[str] = []
    order: list[tuple[int, int, int]] = []  # (stage, microbatch, hooks fired before it)
    for i, u in enumerate(units):  # post-accumulate-grad hooks are how DP wrappers reduce
        for n, p in u.named_parameters():
            p.register_post_accumulate_grad_hook(lambda _p, n=f"{i}.{n}": hooked.append(n))
    spec = lambda shape, dtype: (shape, dtype)  # noqa: E731
    stages = [PipelineStage(u, s, per_rank, output_spec=spec) for s, u in enumerate(units)]
    losses = run(
        schedule,
        stages,
        split_microbatches(x, 4),
        split_microbatches(y, 4),
        _loss,
        stage_kwargs=[{"scale": s} for s in scales],
        before_backward=lambda st, mb: order.append((st.stage_index, mb, len(hooked))),
    )
    ref_units = [_Scaled() for _ in units]
    for r, u in zip(ref_units, units, strict=True):
        r.load_state_dict(u.state_dict())
    ref_loss = 0.0
    for i, (xm, ym) in enumerate(zip(x.chunk(4), y.chunk(4), strict=True)):
        h = xm
        for r in ref_units:
            h = r(h, scale=scales[i])
        loss = _loss(h, ym)
        (loss / 4).backward()
        ref_loss += loss.item()
        assert losses[i].item() == pytest.approx(loss.item(), abs=1e-6)
    for r, u in zip(ref_units, units, strict=True):
        for (n, p), q in zip(u.named_parameters(), r.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-6, msg=n)
    assert len(hooked) == 4 * sum(len(list(u.parameters())) for u in units)
    # Called before every gradient-producing action, in increasing microbatch order per stage.
    for s in range(per_rank):
        assert [mb for st, mb, _ in order if st == s] == [0, 1, 2, 3]
    assert all(n <= len(hooked) for _, _, n in order)
