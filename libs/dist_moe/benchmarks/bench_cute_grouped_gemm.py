"""CuTe DSL grouped GEMM vs ``torch._grouped_mm`` on one GPU, bf16, with the device's peak.

    python libs/dist_moe/benchmarks/bench_cute_grouped_gemm.py [--experts 8 --rows 2048
        --dim 4096 --hidden 1536 --iters 50 --peak-tflops 989]

Each expert g multiplies its (rows, dim) block by its (hidden, dim) weight (the first GEMM
of a SwiGLU expert, ``nn.Linear`` layout). Two runs: every row live, then half of each
expert's rows live (``counts``): the CuTe kernel skips dead row tiles on the device, while
``torch._grouped_mm`` over the static buffer computes them all. TFLOP/s count live rows.
Checks the live rows against ``torch._grouped_mm`` (relative Frobenius error <= 1e-2) and
exits 1 on a mismatch, 2 when it cannot run (no CUDA, no SM90/SM100, no ``cutlass`` extra).
Prints one ``RESULT`` line per run.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

# dense bf16 tensor-core peaks (TFLOP/s, no sparsity), by device-name substring
_PEAKS = {
    "H100": 989.0,
    "H200": 989.0,
    "H800": 989.0,
    "GH200": 989.0,
    "B200": 2250.0,
    "GB200": 2500.0,
}


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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--rows", type=int, default=2048, help="static rows per expert (x128)")
    p.add_argument("--dim", type=int, default=4096, help="K (x64)")
    p.add_argument("--hidden", type=int, default=1536, help="N (x128)")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--peak-tflops", type=float, default=None, help="override the peak table")
    args = p.parse_args()

    if not torch.cuda.is_available():
        print("RESULT cute_grouped_gemm: cannot run: no CUDA device")
        return 2
    from dist_moe import cute_available, cute_grouped_mm

    if not cute_available():
        print("RESULT cute_grouped_gemm: cannot run: pip install 'titan-dist-moe[cutlass]'")
        return 2
    name = torch.cuda.get_device_name()
    major, minor = torch.cuda.get_device_capability()
    if major not in (9, 10):
        print(f"RESULT cute_grouped_gemm: cannot run: {name} is sm_{major}{minor}, not SM90/SM100")
        return 2
    peak = args.peak_tflops
    if peak is None:
        peak = next(
            (v for k, v in sorted(_PEAKS.items(), key=lambda kv: -len(kv[0])) if k in name), None
        )
    g, m, n, k = args.experts, args.rows, args.hidden, args.dim
    torch.manual_seed(0)
    x = torch.randn(g, m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(g, n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    offs = torch.arange(1, g + 1, device="cuda", dtype=torch.int32) * m
    w_t = w.transpose(-2, -1)
    ok = True
    for label, live in (("all rows live", m), ("half the rows live", m // 2)):
        counts = torch.full((g,), live, device="cuda", dtype=torch.int32)
        out = torch.zeros(g, m, n, device="cuda", dtype=torch.bfloat16)
        cute_grouped_mm(x, w, counts, out=out)
        ref = torch._grouped_mm(x.reshape(g * m, k), w_t, offs=offs).reshape(g, m, n)
        rows = -(-live // 128) * 128
        diff = (out[:, :rows].float() - ref[:, :rows].float()).norm()
        err = (diff / ref[:, :rows].float().norm()).item()
        ok &= err <= 1e-2
        t_cute = _time_ms(lambda c=counts, o=out: cute_grouped_mm(x, w, c, out=o), args.iters)
        t_ref = _time_ms(lambda: torch._grouped_mm(x.reshape(g * m, k), w_t, offs=offs), args.iters)
        flops = 2.0 * g * live * n * k
        tf_cute, tf_ref = flops / t_cute / 1e9, flops / t_ref / 1e9
        peak_s = f"{peak:.0f} TFLOP/s" if peak else "unknown (--peak-tflops)"
        frac = f" ({100 * tf_cute / peak:.1f}% of peak)" if peak else ""
        print(
            f"RESULT cute_grouped_gemm G={g} M={m} N={n} K={k} bf16, {label}: rel err "
            f"{err:.2e} ({'OK' if err <= 1e-2 else 'MISMATCH'} <= 1e-2) | CuTe {tf_cute:.1f} "
            f"TFLOP/s{frac} | torch._grouped_mm {tf_ref:.1f} TFLOP/s | CuTe/torch "
            f"{tf_cute / tf_ref:.2f}x | device peak {peak_s} ({name})",
            flush=True,
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
