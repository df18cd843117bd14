"""Rollout throughput and trainer idle time against the number of generator replicas.

Generators of a fixed per-token latency (``titan_rl.simulated.LatencyGenerator``: they sleep,
so N replicas overlap as N accelerators would, apart from this machine's cores) and a trainer
of a fixed step time (``LatencyPolicy``), joined by the real controller, work buffer and
router. Replicas are threads of this process, or with ``--actors`` Monarch actors, one
process each (the same path as ``DistributedGRPO``: requests and replies pickled).

    uv run python libs/titan_rl/benchmarks/dataflow_scaling.py
    uv run python libs/titan_rl/benchmarks/dataflow_scaling.py --actors

Prints one row per replica count and the ratio of rollouts/s at the most replicas to one.
"""

from __future__ import annotations

import argparse
import functools
import os

from titan_rl import GRPOConfig, RewardResult, SamplingParams
from titan_rl.controller import Controller, DataflowConfig
from titan_rl.router import LocalReplica, Router
from titan_rl.simulated import LatencyGenerator, LatencyPolicy
from titan_rl.tasks import ExactMatchTask
from titan_rl.workers import TaskRollouts


class _Bytes:
    bos_id, eos_id, pad_id = 256, 257, 258

    def encode(self, text):
        return list(text.encode())

    def decode(self, ids):
        return bytes(i for i in ids if i < 256).decode(errors="replace")


class _FirstByteTask(ExactMatchTask):
    def score(self, prompt, response_ids):
        return RewardResult(float(response_ids[0] < 128), "correct")


def _problem(i: int) -> tuple[str, str]:
    return f"{i}+{i}=", str(2 * i)


def _generator(index: int, latency: float) -> LatencyGenerator:
    return LatencyGenerator(token_latency_s=latency)


def measure(replicas: int, args: argparse.Namespace) -> dict[str, float]:
    """Steady-state rates over ``args.steps`` steps (the first, start-up, step dropped)."""
    cfg = GRPOConfig(
        num_prompts=args.prompts,
        group_size=args.group_size,
        sampling=SamplingParams(max_new_tokens=args.tokens),
        mode="async",
        max_offpolicy_steps=args.max_lag,
    )
    if args.actors:
        from titan_rl.actors import MonarchReplica

        factory = functools.partial(_generator, latency=args.token_latency)
        pool = [MonarchReplica(factory, i, 1) for i in range(replicas)]
    else:
        pool = [
            LocalReplica(LatencyGenerator(token_latency_s=args.token_latency), f"r{i}")
            for i in range(replicas)
        ]
    router = Router(pool)
    source = TaskRollouts(
        _FirstByteTask(_Bytes(), _problem),
        num_prompts=args.prompts,
        group_size=args.group_size,
        sampling=cfg.sampling,
    )
    ctl = Controller(
        LatencyPolicy(step_s=args.step_time),
        router,
        source,
        cfg,
        DataflowConfig(rollout_workers=2 * replicas),
    )
    try:
        hist = ctl.run(args.steps + 1)[1:]
    finally:
        router.close()
    wall = sum(m["step_time_s"] for m in hist)
    return {
        "rollouts_per_s": sum(m["rollouts_per_s"] * m["step_time_s"] for m in hist) / wall,
        "tokens_per_s": sum(m["generator_tokens_per_s"] * m["step_time_s"] for m in hist) / wall,
        "idle": sum(m["trainer_idle_fraction"] for m in hist) / len(hist),
        "lag": max(m["policy_lag_max"] for m in hist),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--actors", action="store_true", help="replicas as Monarch actor processes")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--prompts", type=int, default=8, help="groups per step (one request each)")
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--tokens", type=int, default=16, help="max_new_tokens per request")
    p.add_argument("--token-latency", type=float, default=0.005, help="seconds per decode step")
    p.add_argument("--step-time", type=float, default=0.05, help="seconds per trainer step")
    p.add_argument("--max-lag", type=int, default=2, help="max_offpolicy_steps")
    args = p.parse_args()
    where = "Monarch actors (one process each)" if args.actors else "threads of this process"
    print(
        f"replicas: {where}; {args.prompts} requests of {args.group_size} rows x "
        f"{args.tokens} tokens per step at {args.token_latency * 1e3:.1f} ms/token; "
        f"trainer step {args.step_time * 1e3:.0f} ms; K = {args.max_lag}; "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    print("| replicas | rollouts/s | tokens/s | vs 1 replica | trainer idle | max lag |")
    print("|---:|---:|---:|---:|---:|---:|")
    rows = {n: measure(n, args) for n in args.replicas}
    base = rows[min(rows)]["rollouts_per_s"]
    for n, r in rows.items():
        print(
            f"| {n} | {r['rollouts_per_s']:.1f} | {r['tokens_per_s']:.0f} | "
            f"{r['rollouts_per_s'] / base:.2f}x | {r['idle']:.2f} | {r['lag']} |"
        )
    top = max(rows)
    print(
        f"rollouts/s with {top} replicas / with {min(rows)}: "
        f"{rows[top]['rollouts_per_s'] / base:.2f}x"
    )


if __name__ == "__main__":
    main()
