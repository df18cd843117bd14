"""Context parallelism: peak activation memory per rank against sequence length and CP degree
(fake backend, exact), real gloo step time and memory, and the fake-backend memory table of a
128K-context Llama 3 8B recipe at CP 8.

Run: ``uv run python apps/titan_train/benchmarks/context_parallel.py`` (CPU, no GPU needed;
``--parts fake gloo recipe`` picks parts).

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
--parallel.dp-shard 1 --training.seq-len 131072 --training.steps 1 --parallel.cp-tile-scores
268435456 --remat.policy full`` (bf16, FSDP over the 8 context-parallel ranks): the memory
report of one real step of rank 0. Under fake mode every score tile is a few dozen Python-level
ops, so the run's time grows with the number of tiles: tiles of 2^28 scores (2896 x 2896 for
32 heads; 1 GiB in fp32) make 64x fewer than the default 2^22 (4x fewer than 2^26) and count a larger
transient tile in the peak (an upper bound for smaller tiles).
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


def _recipe(a: argparse.Namespace) -> None:
    from titan_train.cli import parse_config
    from titan_train.trainer import train

    with tempfile.TemporaryDirectory() as out:
        argv = [
            "--output-dir", out, "--comm.fake-world-size", "8", "--parallel.cp", "8",
            "--parallel.dp-shard", "1", "--training.seq-len", "131072", "--training.steps", "1",
            "--checkpoint.interval", "0", "--parallel.cp-tile-scores", str(a.recipe_tile_scores),
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
        "--recipe-tile-scores",
        type=int,
        default=1 << 28,
        help="score elements per attention tile in the 128K recipe run (its time grows with "
        "the number of tiles: every tile is a few dozen Python-level ops under fake mode)",
    )
    p.add_argument(
        "--parts", nargs="+", choices=["fake", "gloo", "recipe"], default=["fake", "gloo", "recipe"]
    )
    a = p.parse_args()
    if "fake" in a.parts:
        _sweep(a)
    if "gloo" in a.parts:
        _gloo(a)
    if "recipe" in a.parts:
        _recipe(a)


if __name__ == "__main__":
    main()
