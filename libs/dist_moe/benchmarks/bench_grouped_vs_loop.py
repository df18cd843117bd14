"""MoE layer forward+backward throughput: grouped GEMM experts vs the per-expert loop.

    python libs/dist_moe/benchmarks/bench_grouped_vs_loop.py [--tokens 4096 --dim 256 ...]

Same layer, same weights, same input, same routing (``force_balance`` by default, so every
expert gets T*K/E rows; ``--natural`` routes by the scores instead); only
``experts_impl`` differs. Steps alternate between the two; prints the median tokens/s of
each and their ratio per expert count.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from dist_moe import MoE, MoEConfig, PermuteConfig, RouterConfig


def _step(moe: MoE, x: torch.Tensor, g: torch.Tensor) -> float:
    t0 = time.perf_counter()
    (moe(x) * g).sum().backward()
    dt = time.perf_counter() - t0
    moe.zero_grad(set_to_none=True)
    return dt


def _step_times(a: MoE, b: MoE, x, g, iters: int) -> tuple[float, float]:
    """Median step time of a and b, measured alternately (fair under a varying machine load)."""
    ta, tb = [], []
    for i in range(iters + 2):
        da, db = _step(a, x, g), _step(b, x, g)
        if i >= 2:  # two warm-up steps each
            ta.append(da)
            tb.append(db)
    return statistics.median(ta), statistics.median(tb)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--hidden-dim", type=int, default=128)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--experts", type=int, nargs="+", default=[8, 16, 64])
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--natural", action="store_true", help="route by scores, not force_balance")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"MoE fwd+bwd, fp32 on {torch.get_num_threads()} CPU thread(s), torch {torch.__version__}: "
        f"T={args.tokens} D={args.dim} I={args.hidden_dim} K={args.top_k} "
        f"routing={'natural' if args.natural else 'force_balance'}"
    )
    print(f"{'E':>4} {'rows/expert':>11} {'loop tok/s':>12} {'grouped tok/s':>14} {'ratio':>7}")
    for e in args.experts:
        torch.manual_seed(0)
        cfg = MoEConfig(
            dim=args.dim,
            hidden_dim=args.hidden_dim,
            router=RouterConfig(num_experts=e, top_k=args.top_k, force_balance=not args.natural),
            permute=PermuteConfig(alignment=8),
            experts_impl="grouped_mm",
        )
        grouped = MoE(cfg)
        loop = copy.deepcopy(grouped)
        loop.experts.impl = "loop"
        x = torch.randn(args.tokens, args.dim, requires_grad=True)
        g = torch.randn(args.tokens, args.dim)
        t_loop, t_grouped = _step_times(loop, grouped, x, g, args.iters)
        rows = args.tokens * args.top_k // e
        print(
            f"{e:>4} {rows:>11} {args.tokens / t_loop:>12.0f} {args.tokens / t_grouped:>14.0f} "
            f"{t_loop / t_grouped:>6.2f}x"
        )


if __name__ == "__main__":
    main()
