"""Expert-parallel dispatch over gloo (EP=2 by default): all-to-all vs all-gather-everything.

    python libs/dist_moe/benchmarks/bench_ep_dispatch.py [--world-size 2 --tokens 4096 ...]

Both run the same MoE layer (forward + backward) with the experts sharded over the ranks:

* all-to-all: ``AllToAllDispatcher`` (each token row travels to the ranks owning its experts
  and back: uneven ``all_to_all_single``, plus a tiny count exchange);
* all-gather-everything (the baseline): every rank all-gathers all tokens and their routing,
  runs its local experts on the tokens routed to them, and a reduce-scatter sums the partial
  outputs back to the token owners (backward: reduce-scatter, then all-gather).

Bytes are those a rank sends to other ranks (forward + backward, token payload and routing
metadata; self-copies excluded), summed over ranks and averaged per step. Times: median step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dist_moe import (
    Dispatcher,
    MoE,
    MoEConfig,
    PermuteConfig,
    RouterConfig,
    expert_parallel,
    permute,
    plan_permutation,
    unpermute_and_combine,
)
from dist_moe.placement import ExpertPlacement

_SENT = {"bytes": 0}


def _count(nbytes: int) -> None:
    _SENT["bytes"] += nbytes


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ws = dist.get_world_size()
        out = x.new_empty((ws * x.shape[0], *x.shape[1:]))
        dist.all_gather_into_tensor(out, x.contiguous())
        _count(x.numel() * x.element_size() * (ws - 1))
        return out

    @staticmethod
    def backward(ctx, grad):
        return _ReduceScatter.apply(grad)


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ws = dist.get_world_size()
        out = x.new_empty((x.shape[0] // ws, *x.shape[1:]))
        dist.reduce_scatter_tensor(out, x.contiguous())
        _count(out.numel() * out.element_size() * (ws - 1))
        return out

    @staticmethod
    def backward(ctx, grad):
        return _AllGather.apply(grad)


class AllGatherDispatcher(Dispatcher):
    """Baseline: gather every token everywhere, compute local experts, reduce-scatter back."""

    def __init__(self, num_experts: int, config: PermuteConfig) -> None:
        self.placement = ExpertPlacement.from_group(num_experts)
        self.num_experts = num_experts
        self.num_local_experts = self.placement.num_local_experts
        self.config = config

    def dispatch(self, x_TD, indices_TK, counts=None):
        p = self.placement
        x_all = _AllGather.apply(x_TD)
        idx_all = _AllGather.apply(indices_TK)  # int64, no grad
        # Assignments to other ranks' experts are "not routed" here (-1).
        local = idx_all - p.first_local_expert
        local = torch.where((local >= 0) & (local < p.num_local_experts), local, -1)
        plan = plan_permutation(local, p.num_local_experts, self.config)
        rows = permute(x_all, plan)
        return rows, plan.group_ends, plan

    def combine(self, y_RD, weights_TK, plan):
        w_all = _AllGather.apply(weights_TK)
        y_all = unpermute_and_combine(y_RD, plan, w_all)  # partial sums: local experts only
        return _ReduceScatter.apply(y_all)


def _patch_all_to_all_counter() -> None:
    real = dist.all_to_all_single
    ws, me = dist.get_world_size(), dist.get_rank()

    def counted(output, input, output_split_sizes=None, input_split_sizes=None, group=None):
        per_row = input[0].numel() * input.element_size() if input.shape[0] else 0
        if input_split_sizes is None:
            sent = input.shape[0] // ws * (ws - 1)
        else:
            sent = sum(s for r, s in enumerate(input_split_sizes) if r != me)
        _count(sent * per_row if input.dim() > 1 else sent * input.element_size())
        return real(output, input, output_split_sizes, input_split_sizes, group=group)

    dist.all_to_all_single = counted


def _worker(rank: int, world_size: int, port: int, args, queue) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    _patch_all_to_all_counter()
    torch.manual_seed(0)
    cfg = MoEConfig(
        dim=args.dim,
        hidden_dim=args.hidden_dim,
        router=RouterConfig(num_experts=args.experts, top_k=args.top_k),
        permute=PermuteConfig(alignment=8),
    )
    base = MoE(cfg)
    x = torch.randn(args.tokens, args.dim, generator=torch.Generator().manual_seed(rank))
    g = torch.randn(args.tokens, args.dim, generator=torch.Generator().manual_seed(99 + rank))
    results = {}
    outs = {}
    for name in ("all_to_all", "all_gather"):
        moe = MoE(cfg)
        moe.load_state_dict(base.state_dict())
        expert_parallel(moe)
        if name == "all_gather":
            moe.dispatcher = AllGatherDispatcher(args.experts, cfg.permute)
        times, sent = [], []
        for i in range(args.iters + 2):
            dist.barrier()
            _SENT["bytes"] = 0
            xi = x.clone().requires_grad_()
            t0 = time.perf_counter()
            y = moe(xi)
            (y * g).sum().backward()
            dist.barrier()
            if i >= 2:
                times.append(time.perf_counter() - t0)
                sent.append(_SENT["bytes"])
        outs[name] = y.detach()
        t = torch.tensor([statistics.median(times), statistics.median(sent)], dtype=torch.float64)
        dist.all_reduce(t)  # sum of bytes over ranks; time averaged below
        results[name] = (t[0].item() / world_size, t[1].item())
    results["max_out_diff"] = (outs["all_to_all"] - outs["all_gather"]).abs().max().item()
    if rank == 0:
        queue.put(results)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--hidden-dim", type=int, default=128)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--iters", type=int, default=5)
    args = p.parse_args()
    import socket

    print(
        f"EP={args.world_size} over gloo, fp32 CPU, MoE fwd+bwd: T={args.tokens}/rank "
        f"D={args.dim} I={args.hidden_dim} E={args.experts}"
    )
    print(
        f"{'K':>3} {'a2a MB':>8} {'allgather MB':>13} {'bytes ratio':>12} "
        f"{'a2a ms':>8} {'allgather ms':>13} {'time ratio':>11} {'max |diff|':>11}"
    )
    ctx = mp.get_context("spawn")
    for k in args.top_k:
        args_k = argparse.Namespace(**{**vars(args), "top_k": k})
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        queue = ctx.Queue()
        mp.start_processes(
            _worker,
            args=(args.world_size, port, args_k, queue),
            nprocs=args.world_size,
            start_method="spawn",
        )
        r = queue.get()
        (ta, ba), (tg, bg) = r["all_to_all"], r["all_gather"]
        print(
            f"{k:>3} {ba / 1e6:>8.2f} {bg / 1e6:>13.2f} {bg / ba:>11.2f}x "
            f"{ta * 1e3:>8.1f} {tg * 1e3:>13.1f} {tg / ta:>10.2f}x {r['max_out_diff']:>11.1e}"
        )


if __name__ == "__main__":
    main()
