"""Step time of titan_pipeline vs torch.distributed.pipelining, and measured vs simulated bubble.

Same model (an MLP cut into stages), same microbatches, same gloo group; steps of the two
runtimes alternate so that machine noise hits both. Also checks that both produce the same
gradients. Then recorded steps of ours, round-robin over the schedules, give each schedule's
measured bubble, which is compared with three simulations: calibrated from the same step
(mean costs), replayed from the same step (trace), and predicted by the contention model
calibrated on the other schedules' steps only. Run::

    uv run python libs/pipeline/benchmarks/bench_vs_torch.py [--ranks 2 4] [--steps 11]
"""

from __future__ import annotations

import argparse
import importlib.util
import pickle
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import pipelining as tpp

import titan_pipeline as tp
from titan_pipeline.experimental import Contention, simulate_shared
from titan_testing import run_distributed

# ours name -> (torch schedule class or None, stages per rank)
SCHEDULES = {
    "gpipe": ("ScheduleGPipe", 1),
    "1f1b": ("Schedule1F1B", 1),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", 2),
    "zb_h1": (None, 1),
    "zbv": ("ScheduleZBVZeroBubble", 2),
    "dualpipev": ("ScheduleDualPipeV", 2),
}


def _units(num_units: int, dim: int) -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(dim, dim), nn.GELU()) for _ in range(num_units)]


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, target)


def _bench(names: list[str], steps: int, recorded: int, dim: int, batch: int, num_mb: int) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(batch, dim, generator=g), torch.randn(batch, dim, generator=g)
    mbs, tgts = tp.split_microbatches(x, num_mb), tp.split_microbatches(y, num_mb)
    latency = _p2p_latency(mbs[0])
    out = {}
    recordable = {}
    for name in names:
        torch_cls, v = SCHEDULES[name]
        schedule = tp.build_schedule(
            name, num_ranks=world, num_microbatches=num_mb, stages_per_rank=v
        )
        num_units = 2 * schedule.num_stages
        ours_units = _units(num_units, dim)
        ours = tp.build_stages(ours_units, schedule, rank)
        theirs_step = None
        if torch_cls is not None:
            theirs_units = _units(num_units, dim)
            modules = tp.split_units(theirs_units, schedule.num_stages)
            stages = [
                tpp.PipelineStage(
                    modules[s],
                    s,
                    schedule.num_stages,
                    torch.device("cpu"),
                    input_args=(torch.empty(batch // num_mb, dim),),
                )
                for s in schedule.stages_of_rank(rank)
            ]
            cls = getattr(tpp, torch_cls)
            torch_schedule = cls(stages if v > 1 else stages[0], num_mb, loss_fn=_loss)
            first, last = (
                0 in schedule.stages_of_rank(rank),
                (schedule.num_stages - 1 in schedule.stages_of_rank(rank)),
            )

            def theirs_step(first=first, last=last, torch_schedule=torch_schedule):
                args = (x,) if first else ()
                kwargs = {"target": y, "losses": []} if last else {}
                torch_schedule.step(*args, **kwargs)

        def ours_step(schedule=schedule, ours=ours, recorder=None):
            tp.run(schedule, ours, mbs, tgts, _loss, recorder=recorder)

        def timed(fn, params):
            for p in params:
                p.grad = None
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            dist.barrier()
            return time.perf_counter() - t0

        ours_params = [p for u in ours_units for p in u.parameters()]
        ours_t, theirs_t = [], []
        theirs_params = [p for u in theirs_units for p in u.parameters()] if theirs_step else []
        for i in range(steps + 2):  # two warm-up steps
            # who goes first alternates, so neither always runs right after the other
            if i % 2:
                b = timed(theirs_step, theirs_params) if theirs_step else 0.0
                a = timed(ours_step, ours_params)
            else:
                a = timed(ours_step, ours_params)
                b = timed(theirs_step, theirs_params) if theirs_step else 0.0
            if i >= 2:
                ours_t.append(a)
                theirs_t.append(b)
        grad_diff = 0.0
        if theirs_step:
            for p, q in zip(
                [p for u in ours_units for p in u.parameters()],
                [p for u in theirs_units for p in u.parameters()],
                strict=True,
            ):
                if p.grad is not None or q.grad is not None:
                    grad_diff = max(grad_diff, (p.grad - q.grad).abs().max().item())
        recordable[name] = (ours_step, ours_params, schedule, ours)
        diff = torch.tensor([grad_diff])
        dist.all_reduce(diff, op=dist.ReduceOp.MAX)
        out[name] = {
            "ours": statistics.median(ours_t),
            "torch": statistics.median(theirs_t) if theirs_step else None,
            # each step of ours over the torch step next to it in time: the load of a shared
            # machine drifts between steps, less within a pair
            "ratio": (
                statistics.median(a / b for a, b in zip(ours_t, theirs_t, strict=True))
                if theirs_step
                else None
            ),
            "grad_diff": diff.item(),
            "steps": (ours_t, theirs_t),  # every timed step, for --save
            "unit_bubble": tp.simulate(schedule).bubble_ratio,
            "latency": latency,
            "timelines": [],
            "alone": None,
            "v": v,
        }
    # Recorded steps for the bubbles, round-robin over the schedules: the load of a shared
    # machine drifts, and every schedule's steps then sample the same drift as the steps of
    # the other schedules that calibrate its prediction. The times alone are measured in the
    # same rounds (one repeat per round, minimum over rounds): measured in one block, one
    # schedule's could all land in a minute when another job ran (a full backward read
    # 6.2-6.8 ms against 4.2-4.8 for the same stage in the other schedules of that run).
    alone: dict[str, list[tp.Costs]] = {name: [] for name in recordable}
    for _ in range(recorded):
        for name, (step, params, schedule, ours) in recordable.items():
            recorder = tp.TimelineRecorder()
            for p in params:
                p.grad = None
            step(recorder=recorder)
            out[name]["timelines"].append(recorder.gather())
            alone[name].append(tp.measure_costs(schedule, ours, mbs[0], tgts[0], _loss, repeats=1))
    for name, measured in alone.items():
        out[name]["alone"] = _fastest(measured)
    return out


def _fastest(measured: list[tp.Costs]) -> tp.Costs:
    """Per stage and kind, the minimum of several ``measure_costs`` results."""

    def least(kind: str) -> tuple[float, ...]:
        return tuple(map(min, zip(*(getattr(c, kind) for c in measured), strict=True)))

    return tp.Costs(
        forward=least("forward"),
        backward=least("backward"),
        backward_input=least("backward_input"),
        backward_weight=least("backward_weight"),
    )


def _p2p_latency(t: torch.Tensor, rounds: int = 20) -> float:
    """Half the median round trip of ``t`` between ranks 0 and 1, shared with every rank."""
    rank = dist.get_rank()
    buf = torch.empty_like(t)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(t, 1)
            dist.recv(buf, 1)
        elif rank == 1:
            dist.recv(buf, 0)
            dist.send(t, 0)
        times.append((time.perf_counter() - t0) / 2)
    value = torch.tensor([statistics.median(times) if rank == 0 else 0.0], dtype=torch.float64)
    dist.all_reduce(value)
    return value.item()


def _bubbles(results: dict, world: int, num_mb: int, samples: int) -> dict[str, dict]:
    """Measured bubble and three simulations of it per schedule (medians over steps/seeds).

    ``mean``: costs calibrated from the same step (mean per (kind, stage), posting, transfer).
    ``trace``: the same step replayed with each action's own duration.
    ``contention``: the schedule's time alone of each action (``measure_costs``) and the
    ``Contention`` (stretch factors, posting and transfer times) calibrated on the recorded
    steps of the *other* schedules only: a prediction, not a fit.
    """
    out = {}
    for name, r in results.items():
        schedule = tp.build_schedule(
            name, num_ranks=world, num_microbatches=num_mb, stages_per_rank=r["v"]
        )
        others = [q for n, q in results.items() if n != name]
        runs = [(tl, q["alone"]) for q in others for tl in q["timelines"]]
        contention = Contention.from_timelines(runs)
        n = schedule.num_stages
        measured = [tl.bubble_ratio for tl in r["timelines"]]
        out[name] = {
            "measured": statistics.median(measured),
            "spread": (min(measured), max(measured)),
            "mean": statistics.median(
                tp.simulate(schedule, tp.Costs.from_timeline(tl, n)).bubble_ratio
                for tl in r["timelines"]
            ),
            "trace": statistics.median(
                tp.simulate(schedule, tp.Costs.from_timeline(tl, n, trace=True)).bubble_ratio
                for tl in r["timelines"]
            ),
            "contention": statistics.median(
                simulate_shared(schedule, r["alone"], contention=contention, seed=k).bubble_ratio
                for k in range(samples)
            ),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=11)
    parser.add_argument("--recorded", type=int, default=12, help="recorded steps for the bubbles")
    parser.add_argument("--samples", type=int, default=200, help="seeds of the contention model")
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--schedules", nargs="+", default=list(SCHEDULES))
    parser.add_argument("--save", default=None, help="pickle the measured timelines here")
    parser.add_argument(
        "--glibc-malloc-defaults",
        action="store_true",
        help="leave glibc's mmap / trim thresholds alone in the rank processes",
    )
    args = parser.parse_args()
    # By default glibc serves blocks of >= 128 KB (every activation and gradient here) with
    # mmap or trims them back to the OS, adapting its thresholds to what was freed so far, and
    # the next step faults the pages in again: how much of that a step paid depended on each
    # launch's allocation history (2-rank 1F1B, ours / torch over 21 paired steps: 0.89-0.99
    # in 7 launches, 0.91-0.93 in 3 launches with fixed thresholds). Both runtimes run in the
    # same rank processes, so both get the same allocator.
    malloc = (
        {}
        if args.glibc_malloc_defaults
        else {"MALLOC_MMAP_THRESHOLD_": str(64 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}
    )
    print(
        f"MLP of Linear({args.dim},{args.dim})+GELU units, 2 units per stage, batch "
        f"{args.batch}, {args.microbatches} microbatches, gloo on CPU, fp32; median of "
        f"{args.steps} steps after 2 warm-up steps (who goes first alternates); ratio: median "
        f"of ours / torch over pairs of adjacent steps. Bubbles: medians over {args.recorded} "
        "recorded steps of ours (round-robin over the schedules); 'mean costs': each step simulated with costs calibrated from "
        "itself (mean compute per (kind, stage), mean posting, median transfer); 'trace': each "
        "step replayed with its own action durations; 'contention': predicted from each "
        "action's time alone and the stretch / posting / transfer distributions measured on the OTHER "
        f"schedules' steps (median over {args.samples} seeds); diff = measured - simulated"
    )
    print(
        "| ranks | schedule | titan_pipeline ms | torch.pipelining ms | ratio | max grad diff "
        "| bubble unit-cost sim | bubble sim (mean costs, same step) | bubble sim (trace) "
        "| bubble predicted (contention, other schedules) | bubble measured (min–max over steps) "
        "| diff pp (mean costs) | diff pp (contention) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    # The ranks load this file by module name; under "__main__" they would rerun main().
    spec = importlib.util.spec_from_file_location("bench_vs_torch", __file__)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    saved = {}
    for world in args.ranks:
        began = time.perf_counter()
        res = saved[world] = run_distributed(
            module._bench,
            world,
            args.schedules,
            args.steps,
            args.recorded,
            args.dim,
            args.batch,
            args.microbatches,
            timeout=1800,
            num_threads=1,
            env=malloc,
        )[0]
        bubbles = _bubbles(res, world, args.microbatches, args.samples)
        for name, r in res.items():
            b = bubbles[name]
            theirs = f"{1e3 * r['torch']:.1f}" if r["torch"] else "n/a"
            ratio = f"{r['ratio']:.2f}" if r["torch"] else "n/a"
            diff = f"{r['grad_diff']:.1e}" if r["torch"] else "n/a"
            if name == args.schedules[0]:
                print(
                    f"<!-- {world} ranks: ping-pong p2p latency {1e3 * r['latency']:.2f} ms, "
                    f"{time.perf_counter() - began:.0f} s -->"
                )
            print(
                f"| {world} | {name} | {1e3 * r['ours']:.1f} | {theirs} | {ratio} | {diff} "
                f"| {100 * r['unit_bubble']:.1f}% | {100 * b['mean']:.1f}% "
                f"| {100 * b['trace']:.1f}% | {100 * b['contention']:.1f}% "
                f"| {100 * b['measured']:.1f}% ({100 * b['spread'][0]:.0f}–"
                f"{100 * b['spread'][1]:.0f}) "
                f"| {100 * (b['measured'] - b['mean']):+.1f} "
                f"| {100 * (b['measured'] - b['contention']):+.1f} |",
                flush=True,
            )
    if args.save:
        with open(args.save, "wb") as f:
            pickle.dump(saved, f)


if __name__ == "__main__":
    main()
