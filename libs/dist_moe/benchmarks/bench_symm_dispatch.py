"""Dispatch + combine latency: symmetric memory vs all-to-all, on several GPUs.

    torchrun --standalone --nproc-per-node 8 libs/dist_moe/benchmarks/bench_symm_dispatch.py \
        [--tokens 4096 --dim 4096 --experts 64 --top-k 8 --iters 30]
    torchrun --standalone --nproc-per-node 2 .../bench_symm_dispatch.py --emulate   # CPU smoke

Times only the exchange: the experts are the identity, so one forward is pack, dispatch,
combine and the weighted sum. Rows: ``AllToAllDispatcher`` dropless (counts exchange, one
host read of the split sizes, uneven all-to-all) and in capacity mode (even all-to-all, no
host sync), ``SymmMemDispatcher`` in capacity mode run eagerly and replayed from a CUDA
graph (it captures: static shapes, no host sync). Each rank holds ``--tokens`` tokens.
Checks every output against the all-to-all one of the same layout (bitwise: same rows summed
in the same order) and exits 1 on a mismatch; prints one ``RESULT`` line (rank 0).
``--emulate`` runs the same on CPU over gloo with the shared-memory emulation: it checks the
script, its times mean nothing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from dist_moe import AllToAllDispatcher, PermuteConfig, SymmMemDispatcher


class _Identity:
    """Experts that return their rows: only the exchange is timed."""

    def __call__(self, rows, group_ends, weights=None):
        return rows

    def split_weights(self, sizes):
        return [None] * len(sizes)


def _timed(fn, iters: int, cuda: bool) -> float:
    """Median microseconds per call (ranks aligned by a barrier before each call)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        dist.barrier()
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--dim", type=int, default=4096)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--capacity-factor", type=float, default=1.25)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--emulate", action="store_true", help="CPU + gloo + shared-memory emulation")
    args = p.parse_args()
    if "RANK" not in os.environ:
        print("run me with torchrun (see the docstring)")
        return 2
    cuda = not args.emulate
    if cuda and not torch.cuda.is_available():
        print("RESULT symm_dispatch: cannot run: no CUDA device (use --emulate on CPU)")
        return 2
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda") if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    t, d, e, k = args.tokens, args.dim, args.experts, args.top_k
    gen = torch.Generator(device=device).manual_seed(rank)
    x = torch.randn(t, d, device=device, dtype=dtype, generator=gen)
    scores = torch.rand(t, e, device=device, generator=gen)
    indices = scores.topk(k, dim=-1).indices
    weights = torch.rand(t, k, device=device, generator=gen).to(dtype)
    experts = _Identity()
    dropless = PermuteConfig()
    capacity = PermuteConfig(capacity_factor=args.capacity_factor)

    def run(dispatcher):
        with torch.no_grad():
            return dispatcher.forward_experts(experts, x, indices, weights)

    a2a_dropless = AllToAllDispatcher(e, None, dropless)
    a2a_capacity = AllToAllDispatcher(e, None, capacity)
    symm = SymmMemDispatcher(e, None, capacity, emulate=args.emulate)
    want = run(a2a_capacity)
    got = run(symm)
    ok = torch.equal(got, want)
    rows = {
        "all_to_all dropless": _timed(lambda: run(a2a_dropless), args.iters, cuda),
        "all_to_all capacity": _timed(lambda: run(a2a_capacity), args.iters, cuda),
        "symm_mem capacity": _timed(lambda: run(symm), args.iters, cuda),
    }
    if cuda:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            run(symm)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = run(symm)
        graph.replay()
        torch.cuda.synchronize()
        ok &= torch.equal(static_out, want)
        rows["symm_mem capacity, CUDA graph"] = _timed(graph.replay, args.iters, cuda)
    flags = torch.tensor([int(ok)], device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    ok = bool(flags.item())
    if rank == 0:
        base = rows["all_to_all capacity"]
        cells = " | ".join(f"{n} {us:.0f} us ({base / us:.2f}x)" for n, us in rows.items())
        where = torch.cuda.get_device_name() if cuda else "CPU emulation: times meaningless"
        print(
            f"RESULT symm_dispatch EP={world} T={t}/rank D={d} E={e} K={k} "
            f"capacity_factor={args.capacity_factor} {str(dtype)[6:]}: outputs "
            f"{'equal (bitwise)' if ok else 'MISMATCH'} | {cells} | speed-up vs all_to_all "
            f"capacity in parentheses ({where})",
            flush=True,
        )
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
