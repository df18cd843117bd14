"""Attention backends: forward + backward time and peak memory vs sequence length, and the
debug recipe's training step at 4k / 16k tokens with the dense mask (before) and varlen (after).

    uv run python libs/titan_models/benchmarks/attention.py            # CPU, ~10-20 min
    uv run python libs/titan_models/benchmarks/attention.py --device cuda --seqs 1024,4096,16384,32768

Every measurement runs in a fresh process (``--worker``), so its peak is its own: on CPU the
growth of the resident set's high-water mark (``VmHWM``, reset through ``/proc/self/clear_refs``)
over what the inputs (and, for the training step, the weights, gradients and optimizer state)
already held, with glibc's mmap threshold fixed so freed blocks leave the resident set; on CUDA ``torch.cuda.max_memory_allocated`` over the same baseline. Peak memory
and its growth with S transfer to accelerators; wall times on a shared CPU do not (they are
printed, with the machine's load average, and are noisy).

Shapes: the attention of the ``llama3`` ``debug`` flavour (8 query heads, 4 kv heads, head dim
32), batch 1, fp32 on CPU (bf16 on CUDA), with 16 equal documents per sequence and with one.
The training step: that whole model (4 layers, dim 256, vocab 264 as with the byte tokenizer),
AdamW, cross-entropy, 32 documents per sequence.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

BACKENDS = ("sdpa", "varlen", "flex")
HEADS, KV_HEADS, HEAD_DIM = 8, 4, 32


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


class _Peak:
    """Peak bytes allocated above the baseline taken at ``start`` (device memory on CUDA, the
    process's resident set on CPU)."""

    def __init__(self, device):
        import torch

        self.torch, self.device = torch, device

    def start(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize()
            self.torch.cuda.reset_peak_memory_stats()
            self.base = self.torch.cuda.memory_allocated()
        else:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset VmHWM to the current resident set
            self.base = _rss_kib("VmRSS") * 1024

    def stop(self) -> int:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize()
            return self.torch.cuda.max_memory_allocated() - self.base
        return _rss_kib("VmHWM") * 1024 - self.base


def _attention_worker(backend: str, seq: int, docs: int, device_name: str) -> dict:
    import torch

    from titan_models import AttentionMetadata, attend

    device = torch.device(device_name)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    g = torch.Generator(device=device).manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g, device=device, dtype=dtype, requires_grad=True)

    q, k = rand(1, seq, HEADS, HEAD_DIM), rand(1, seq, KV_HEADS, HEAD_DIM)
    v = rand(1, seq, KV_HEADS, HEAD_DIM)
    grad = torch.randn(1, seq, HEADS, HEAD_DIM, generator=g, device=device, dtype=dtype)
    lengths = [seq // docs] * docs
    lengths[-1] += seq - sum(lengths)
    peak = _Peak(device)
    times = []
    for _ in range(2):
        q.grad = k.grad = v.grad = None
        peak.start()
        t0 = time.perf_counter()
        # Metadata inside the measurement: building masks / plans is part of the cost.
        meta = AttentionMetadata.from_lengths([lengths], seq, device, backend=backend)
        attend(q, k, v, meta).backward(grad)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        peak_bytes = peak.stop()
        del meta
    return {"seconds": times[-1], "peak_bytes": peak_bytes}


def _train_worker(backend: str, seq: int, docs: int, device_name: str) -> dict:
    import torch
    import torch.nn.functional as F

    import titan_models

    device = torch.device(device_name)
    cls, config = titan_models.get_model(
        "llama3", "debug", vocab_size=264, max_seq_len=seq, attention_backend=backend
    )
    with torch.device("meta"):
        model = cls(config)
    model.init_weights(device=device, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 264, (1, seq + 1), generator=g).to(device)
    ids = (torch.arange(seq) * docs // seq)[None].to(device)

    def step():
        logits = model(tokens[:, :-1], document_ids=ids)
        F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)

    step()  # gradients and optimizer state exist from here on: they are the baseline
    peak = _Peak(device)
    peak.start()
    t0 = time.perf_counter()
    step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return {"seconds": time.perf_counter() - t0, "peak_bytes": peak.stop()}


def _run(kind: str, backend: str, seq: int, docs: int, device: str, timeout: int) -> dict:
    cmd = [sys.executable, __file__, "--worker", kind, backend, str(seq), str(docs), device]
    # A fixed mmap threshold: every large block is mapped on allocation and unmapped on free,
    # so the resident set follows the live tensors (glibc's adaptive threshold would otherwise
    # keep freed blocks resident and reuse them, hiding part of a later peak).
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 17)}
    try:
        out = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, check=False, env=env
        )
    except subprocess.TimeoutExpired:
        return {"error": f"over {timeout} s"}
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["killed"])[-1]
        return {"error": last[:90]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def _mib(r: dict) -> str:
    return f"{r['peak_bytes'] / 2**20:,.0f}" if "peak_bytes" in r else "-"


def _sec(r: dict) -> str:
    return f"{r['seconds']:.2f}" if "seconds" in r else r.get("error", "-")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seqs", default="1024,4096,16384,32768")
    parser.add_argument("--dense-max", type=int, default=16384, help="longest S for sdpa")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per measurement")
    parser.add_argument("--skip-train", action="store_true")
    parser.add_argument("--worker", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        kind, backend, seq, docs, device = args.worker
        worker = _attention_worker if kind == "attention" else _train_worker
        print(json.dumps(worker(backend, int(seq), int(docs), device)))
        return

    import torch

    device = torch.device(args.device)
    seqs = [int(s) for s in args.seqs.split(",")]
    print(f"# torch {torch.__version__}, device {device}, load average {os.getloadavg()[0]:.1f}")
    print(f"# attention fwd+bwd, batch 1, {HEADS}/{KV_HEADS} heads, head dim {HEAD_DIM}")
    print("\n| backend | docs | S | fwd+bwd s | peak MiB |\n|---|---:|---:|---:|---:|")
    results: dict[tuple[str, int, int], dict] = {}
    for docs in (16, 1):
        for backend in BACKENDS:
            for seq in seqs:
                if backend == "sdpa" and seq > args.dense_max:
                    r = {"error": f"skipped (S > --dense-max {args.dense_max})"}
                elif backend == "flex" and device.type == "cpu":
                    r = {"error": "no FlexAttention backward on CPU"}
                else:
                    r = _run("attention", backend, seq, docs, args.device, args.timeout)
                results[backend, docs, seq] = r
                print(f"| {backend} | {docs} | {seq} | {_sec(r)} | {_mib(r)} |", flush=True)

    print("\nPeak attention memory, 16k / 4k (goal <= 5x; a dense S x S mask gives ~16x):")
    for backend in BACKENDS:
        for docs in (16, 1):
            a, b = results.get((backend, docs, 4096), {}), results.get((backend, docs, 16384), {})
            if "peak_bytes" in a and "peak_bytes" in b:
                print(f"  {backend:6s} {docs:2d} docs: {b['peak_bytes'] / a['peak_bytes']:.1f}x")
    big = [s for s in (16384, 4096) if ("sdpa", 16, s) in results]
    for seq in big:
        a, b = results["sdpa", 16, seq], results.get(("varlen", 16, seq), {})
        if "peak_bytes" in a and "peak_bytes" in b:
            print(f"  dense / varlen at S={seq}, 16 docs: {a['peak_bytes'] / b['peak_bytes']:.1f}x")

    if args.skip_train:
        return
    print("\n# training step (llama3 debug, vocab 264, batch 1, 32 documents per sequence)")
    print("\n| S | backend | step s | peak MiB over weights+grads+AdamW |\n|---:|---|---:|---:|")
    train: dict[tuple[int, str], dict] = {}
    for seq in (4096, 16384):
        for backend in ("sdpa", "varlen"):
            r = _run("train", backend, seq, 32, args.device, args.timeout)
            train[seq, backend] = r
            label = "sdpa (dense mask, before)" if backend == "sdpa" else "varlen (after)"
            print(f"| {seq} | {label} | {_sec(r)} | {_mib(r)} |", flush=True)
    for seq in (4096, 16384):
        a, b = train[seq, "sdpa"], train[seq, "varlen"]
        if "peak_bytes" in a and "peak_bytes" in b:
            print(f"step peak, dense / varlen at S={seq}: {a['peak_bytes'] / b['peak_bytes']:.1f}x")
    print(f"# load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
