"""Context parallelism: peak activation memory per rank against sequence length and CP degree
(fake backend, exact), real gloo step time and memory, and the fake-backend memory table of a
128K-context Llama 3 8B recipe at CP 8.

Run: ``uv run python apps/titan_train/benchmarks/context_parallel.py`` (CPU, no GPU needed;
``--parts tiles kernels fake gloo recipe`` picks parts).

Part ``tiles`` counts, from the plan the backend executes, the attention tiles one rank runs
per layer at 128K CP 8 (Llama 3 8B: 32 heads, batch 1) for each tile kernel at its default
tile size, plain causal and with sliding windows of 128 and 4096.

Part ``kernels`` runs the bare context-parallel attention (forward + backward) on ``--kernel-cp``
real gloo ranks (one thread each) for each tile kernel side by side: tiles per call, the
slowest rank's time and its ratio to the ``torch`` kernel, and the largest difference from
the ``torch`` kernel's output. On CPU, ``flex`` runs un-compiled (FlexAttention's CPU compile
is forward-only): it materialises each tile's scores, so its time there says nothing of a GPU.

Part ``fake`` runs one forward + backward of a Llama 3 model (``--dim``, ``--layers``, fp32) on
rank 0's shard of one ``S``-token sequence, for S = 8k, 16k, 32k and CP 1, 2, 4, in the
fake-backend mode (``FakeTensorMode`` tensors + a fake process group of ``cp`` ranks, so nothing
is computed or sent): the peak of every storage allocated during the step that is not a
parameter gradient, counted exactly by ``titan_train.fake.MemoryTracker`` (activations saved
for backward, attention tiles, K/V blocks in flight, logits). CP 1 runs the same
``context_parallel`` backend over one rank, so the ratio isolates the split. The ring keeps
two K/V blocks per layer call (the one in use, the next in flight); all-gather holds every
rank's K/V while a layer attends.

Part ``gloo`` runs ``cp`` real processes on gloo (one thread each, as torchrun sets it) with a
tiny Llama 3 (``--gloo-dim``, ``--gloo-layers``, ``--gloo-heads``, vocab 1024) for the same S and
CP: the slowest rank's step time, the bytes autograd saves for backward (exact, counted by
``torch.autograd.graph.saved_tensors_hooks``, weights left out) and the growth of the peak RSS
during the first step (a real whole-process measure: it includes transient score tiles, K/V
blocks in flight and the allocator's slack). On a 2-core machine CP 4 oversubscribes the cores
and the timings of a shared machine are noisy.

Part ``recipe`` is ``titan-train --recipe llama3_8b --comm.fake-world-size 8 --parallel.cp 8
--parallel.dp-shard 1 --training.seq-len 131072 --training.steps 1 --parallel.cp-tile-kernel
sdpa --remat.policy full`` (bf16, FSDP over the 8 context-parallel ranks): the memory report
of one real step of rank 0 and its tiles per layer. Under fake mode every tile is a few
Python-level ops, so the run's time grows with the number of tiles (17 per layer with the
fused kernels' whole-chunk tiles; 8,487 with the ``torch`` kernel's default 2^22 scores).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor

import torch


def _peak_activation_bytes(seq: int, cp: int, algorithm: str, dim: int, layers: int) -> int:
    """Rank 0's peak bytes of one forward + backward (in a fresh process: one fake group)."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import titan_models
    from titan_train.fake import MemoryTracker

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=cp)
    cls, config = titan_models.get_model(
        "llama3",
        "debug",
        dim=dim,
        num_layers=layers,
        num_heads=dim // 64,
        num_kv_heads=max(1, dim // 256),
        head_dim=64,
        ffn_hidden_dim=4 * dim,
        vocab_size=32768,
        max_seq_len=seq,
    )
    with torch.device("meta"):
        model = cls(config)
    model.context_parallel = titan_models.ContextParallel(algorithm=algorithm)
    tracker = MemoryTracker()
    with FakeTensorMode(allow_non_fake_inputs=True), tracker:
        tokens = torch.zeros(1, seq // cp, dtype=torch.long, device="meta")
        start = len(tracker.events)
        logits = model(tokens)
        F.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
        grads = {tracker.key_of(p.grad) for p in model.parameters()}
        peak = tracker.peak_above(start, len(tracker.events), grads)
    dist.destroy_process_group()
    return peak


def _in_process(*args) -> int:
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=spawn) as pool:
        return pool.submit(_peak_activation_bytes, *args).result()


def _sweep(a: argparse.Namespace) -> None:
    print(f"Llama 3 (dim {a.dim}, {a.layers} layers, vocab 32768), fp32, batch 1: rank 0's peak")
    print("activation memory of one forward + backward, MiB (fake backend, exact storage count)")
    print(f"{'S':>7} {'cp':>3} {'algorithm':>10} {'MiB':>10} {'vs cp 1':>8}")
    for seq in a.seq:
        base = None
        for cp in a.cp:
            for algorithm in ("ring", "allgather") if cp > 1 else ("ring",):
                peak = _in_process(seq, cp, algorithm, a.dim, a.layers)
                base = base or peak
                print(
                    f"{seq:>7} {cp:>3} {algorithm:>10} {peak / 2**20:>10.1f} {peak / base:>8.3f}",
                    flush=True,
                )


def _gloo_rank(seq: int, algorithm: str, dim: int, layers: int, heads: int, steps: int) -> dict:
    """One rank of a real gloo job: its shard of one ``seq``-token sequence through a tiny
    Llama 3, a warm-up step, then ``steps`` timed forward + backward steps."""
    import resource

    import torch.distributed as dist
    import torch.nn.functional as F

    import titan_models

    cls, config = titan_models.get_model(
        "llama3",
        "debug",
        dim=dim,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=dim // heads,
        ffn_hidden_dim=2 * dim,
        vocab_size=1024,
        max_seq_len=seq,
        attention_backend="context_parallel",
    )
    model = cls(config)
    model.context_parallel = cp = titan_models.ContextParallel(algorithm=algorithm)
    tokens = cp.shard(torch.randint(0, 1024, (1, seq), generator=torch.Generator().manual_seed(0)))
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    def step(count_saved: bool = False) -> None:
        if count_saved:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                logits = model(tokens)
        else:
            logits = model(tokens)
        F.cross_entropy(logits.flatten(0, 1), tokens.flatten(), reduction="sum").backward()
        model.zero_grad(set_to_none=True)

    rss_before = _rss_bytes()
    step(count_saved=True)  # the first step: saved tensors and the growth of the peak RSS
    rss_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    dist.barrier()
    return {
        "seconds": (time.perf_counter() - start) / steps,
        "saved": sum(saved.values()),
        "rss_growth": rss_peak - rss_before,
    }


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _gloo(a: argparse.Namespace) -> None:
    from titan_testing import run_distributed

    print(
        f"\nReal gloo ranks (one thread each; cp 4 oversubscribes the 2 cores of this machine, "
        f"shared with other jobs: timings are noisy): Llama 3 dim {a.gloo_dim}, {a.gloo_layers} "
        f"layer(s), {a.gloo_heads} heads, vocab 1024, fp32, batch 1, {a.algorithm}. Per rank: "
        "step time (forward + backward, the slowest rank, mean of "
        f"{a.steps}); bytes autograd saves for backward (exact, saved_tensors_hooks, weights "
        "left out); peak RSS growth during the first step (real, includes transient tiles, "
        "K/V blocks in flight and allocator slack), MiB"
    )
    print(f"{'S':>7} {'cp':>3} {'step s':>8} {'saved MiB':>10} {'vs cp 1':>8} {'RSS MiB':>9}")
    for seq in a.seq:
        base = None
        for cp in a.cp:
            ranks = run_distributed(
                _gloo_rank, cp, seq, a.algorithm, a.gloo_dim, a.gloo_layers, a.gloo_heads,
                a.steps, num_threads=1, timeout=1800,
            )  # fmt: skip
            seconds = max(r["seconds"] for r in ranks)
            saved = max(r["saved"] for r in ranks)
            rss = max(r["rss_growth"] for r in ranks)
            base = base or saved
            print(
                f"{seq:>7} {cp:>3} {seconds:>8.2f} {saved / 2**20:>10.1f} {saved / base:>8.3f} "
                f"{rss / 2**20:>9.1f}",
                flush=True,
            )


def _tiles(a: argparse.Namespace) -> None:
    from titan_models.components.context_parallel import tile_count
    from titan_models.components.context_parallel_tiles import KERNELS, tile_size

    seq, cp, heads = 131072, 8, 32
    local = seq // cp
    print(f"Attention tiles per layer per rank (the most over ranks), S={seq}, CP {cp}, {heads}")
    print("heads, batch 1, each kernel's default tile size (from the plan the backend runs)")
    print(f"{'kernel':>7} {'window':>7} {'tile':>6} {'tiles':>7}")
    for kernel in KERNELS:
        for window in (None, 128, 4096):
            tile = tile_size(kernel, local, 1, heads, window, 1 << 22)
            tiles = max(tile_count(r, cp, local, window, False, tile) for r in range(cp))
            print(f"{kernel:>7} {window or '-':>7} {tile:>6} {tiles:>7}", flush=True)


def _kernel_rank(seq: int, heads: int, kv_heads: int, head_dim: int, steps: int) -> dict:
    """One gloo rank: the bare context-parallel attention of its shard, every kernel."""
    import torch.distributed as dist

    import titan_models
    from titan_models.components import attend, flex
    from titan_models.components.context_parallel import shard_metadata

    flex._EAGER_FLEX = True  # CPU: FlexAttention's compile there is forward-only
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, seq, n, head_dim, generator=g) for n in (heads, kv_heads, kv_heads))
    rows = {}
    for kernel in ("torch", "sdpa", "flex"):
        cp = titan_models.ContextParallel(tile_kernel=kernel)
        mine = [cp.shard(t).requires_grad_() for t in (q, k, v)]
        meta = shard_metadata(cp, 1, seq // cp.size, "cpu", positions=None, document_ids=None)

        def step(mine=mine, meta=meta):
            out = attend(*mine, meta)
            out.sum().backward()
            return out.detach()

        out = step()  # warm-up
        dist.barrier()
        start = time.perf_counter()
        for _ in range(steps):
            step()
        dist.barrier()
        rows[kernel] = {
            "seconds": (time.perf_counter() - start) / steps,
            "tiles": cp.stats.most,
            "out": out,
        }
    reference = rows["torch"]["out"]
    return {
        kernel: {
            "seconds": r["seconds"],
            "tiles": r["tiles"],
            "diff": (r["out"] - reference).abs().max().item(),
        }
        for kernel, r in rows.items()
    }


def _kernels(a: argparse.Namespace) -> None:
    from titan_testing import run_distributed

    print(
        f"\nContext-parallel attention alone, forward + backward, S={a.kernel_seq}, CP "
        f"{a.kernel_cp} on gloo (one thread per rank), {a.kernel_heads} query / "
        f"{a.kernel_kv_heads} kv heads of {a.kernel_head_dim}, fp32, batch 1, ring, causal: "
        f"the slowest rank's time (mean of {a.steps} after a warm-up); flex un-compiled on CPU"
    )
    ranks = run_distributed(
        _kernel_rank, a.kernel_cp, a.kernel_seq, a.kernel_heads, a.kernel_kv_heads,
        a.kernel_head_dim, a.steps, num_threads=1, timeout=1800,
    )  # fmt: skip
    base = max(r["torch"]["seconds"] for r in ranks)
    print(f"{'kernel':>7} {'tiles':>6} {'seconds':>8} {'vs torch':>9} {'max |diff|':>11}")
    for kernel in ranks[0]:
        seconds = max(r[kernel]["seconds"] for r in ranks)
        diff = max(r[kernel]["diff"] for r in ranks)
        tiles = ranks[0][kernel]["tiles"]
        print(f"{kernel:>7} {tiles:>6} {seconds:>8.3f} {seconds / base:>9.3f} {diff:>11.1e}")


def _recipe(a: argparse.Namespace) -> None:
    from titan_train.cli import parse_config
    from titan_train.trainer import train

    with tempfile.TemporaryDirectory() as out:
        argv = [
            "--output-dir", out, "--comm.fake-world-size", "8", "--parallel.cp", "8",
            "--parallel.dp-shard", "1", "--training.seq-len", "131072", "--training.steps", "1",
            "--checkpoint.interval", "0", "--parallel.cp-tile-kernel", a.recipe_tile_kernel,
            "--remat.policy", "full",
        ]  # fmt: skip
        train(parse_config(argv, "llama3_8b"))  # prints the memory table


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, nargs="+", default=[8192, 16384, 32768])
    p.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--gloo-dim", type=int, default=128)
    p.add_argument("--gloo-layers", type=int, default=1)
    p.add_argument("--gloo-heads", type=int, default=2)
    p.add_argument("--algorithm", choices=["ring", "allgather"], default="ring")
    p.add_argument("--steps", type=int, default=1, help="timed gloo steps (after one warm-up)")
    p.add_argument(
        "--recipe-tile-kernel",
        choices=["torch", "flex", "sdpa"],
        default="sdpa",
        help="tile kernel of the 128K recipe run (torch: 8,487 tiles per layer, each a few "
        "dozen Python-level ops under fake mode)",
    )
    p.add_argument("--kernel-seq", type=int, default=4096)
    p.add_argument("--kernel-cp", type=int, default=2)
    p.add_argument("--kernel-heads", type=int, default=8)
    p.add_argument("--kernel-kv-heads", type=int, default=2)
    p.add_argument("--kernel-head-dim", type=int, default=64)
    parts = ["tiles", "kernels", "fake", "gloo", "recipe"]
    p.add_argument("--parts", nargs="+", choices=parts, default=parts)
    a = p.parse_args()
    if "tiles" in a.parts:
        _tiles(a)
    if "kernels" in a.parts:
        _kernels(a)
    if "fake" in a.parts:
        _sweep(a)
    if "gloo" in a.parts:
        _gloo(a)
    if "recipe" in a.parts:
        _recipe(a)


if __name__ == "__main__":
    main()
