"""Pack / unpack-and-combine kernels: achieved bandwidth next to the device's copy bandwidth.

    python libs/dist_moe/benchmarks/bench_pack_bandwidth.py [--tokens 16384 --dim 4096
        --experts 64 --top-k 8 --iters 50]

Pack is ``permute_rows`` (each row of the static-capacity expert buffer gathers its token,
or writes zeros if it holds none) and unpack-and-combine is ``combine_rows`` (each token sums
its K weighted rows in fp32), both with the Triton backend, bf16. Bandwidth counts the bytes
each must move (pack: read the routed rows, write the buffer; combine: read T*K rows, write
T rows). The
reference is ``dst.copy_(src)`` of as many bytes (read + write), the best a copy can do on
this device. Checks both kernels against the torch backend (pack bitwise, combine within one
bf16 rounding) and exits 1 on a mismatch, 2 without CUDA. One ``RESULT`` line per kernel.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from dist_moe import PermuteConfig, combine_rows, permute_rows, plan_permutation


def _time_ms(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _copy_gbps(nbytes: int, iters: int) -> float:
    src = torch.empty(nbytes // 2, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    return 2 * nbytes / _time_ms(lambda: dst.copy_(src), iters) / 1e6


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--dim", type=int, default=4096)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--iters", type=int, default=50)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("RESULT pack_bandwidth: cannot run: no CUDA device")
        return 2
    t, d, e, k = args.tokens, args.dim, args.experts, args.top_k
    torch.manual_seed(0)
    x = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
    indices = torch.rand(t, e, device="cuda").argsort(dim=-1)[:, :k]  # K distinct experts
    weights = torch.rand(t, k, device="cuda", dtype=torch.bfloat16)
    # capacity 2.0: a static buffer as the symmetric-memory dispatcher packs it
    plan = plan_permutation(indices, e, PermuteConfig(capacity_factor=2.0, kernels="triton"))
    ra, slot = plan.row_assignment, plan.slot
    routed = int((ra >= 0).sum())
    name = torch.cuda.get_device_name()
    ok = True

    packed = permute_rows(x, ra, k, backend="triton")
    same = torch.equal(packed, permute_rows(x, ra, k, backend="torch"))
    ok &= same
    t_pack = _time_ms(lambda: permute_rows(x, ra, k, backend="triton"), args.iters)
    pack_bytes = (routed + plan.num_rows) * d * 2  # routed rows read, every buffer row written
    copy = _copy_gbps(pack_bytes // 2, args.iters)
    gbps = pack_bytes / t_pack / 1e6
    print(
        f"RESULT pack (permute_rows, Triton) T={t} D={d} E={e} K={k} bf16, {plan.num_rows} rows "
        f"({routed} routed): {'bitwise OK' if same else 'MISMATCH'} | {gbps:.0f} GB/s | device "
        f"copy {copy:.0f} GB/s | {100 * gbps / copy:.0f}% of copy ({name})",
        flush=True,
    )

    y = packed
    got = combine_rows(y, slot, k, weights, backend="triton")
    want = combine_rows(y, slot, k, weights, backend="torch")
    err = ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp(min=1)).item()
    ok &= err <= 2.0**-7
    t_comb = _time_ms(lambda: combine_rows(y, slot, k, weights, backend="triton"), args.iters)
    comb_bytes = (t * k + t) * d * 2
    copy = _copy_gbps(comb_bytes // 2, args.iters)
    gbps = comb_bytes / t_comb / 1e6
    print(
        f"RESULT unpack+combine (combine_rows, Triton, weighted) T={t} D={d} K={k} bf16: "
        f"max rel err {err:.1e} ({'OK' if err <= 2.0**-7 else 'MISMATCH'} <= 2^-7) | {gbps:.0f} "
        f"GB/s | device copy {copy:.0f} GB/s | {100 * gbps / copy:.0f}% of copy ({name})",
        flush=True,
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
