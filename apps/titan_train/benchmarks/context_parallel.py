"""Context parallelism: peak activation memory per rank against sequence length and CP degree,
and the fake-backend memory table of a 128K-context Llama 3 8B recipe at CP 8.

Run: ``uv run python apps/titan_train/benchmarks/context_parallel.py`` (CPU, no GPU needed).

Part 1 runs one forward + backward of a Llama 3 model (``--dim``, ``--layers``, fp32) on rank
0's shard of one ``S``-token sequence, for S = 8k, 16k, 32k and CP 1, 2, 4, in the fake-backend
mode (``FakeTensorMode`` tensors + a fake process group of ``cp`` ranks, so nothing is
computed or sent): the peak of every storage allocated during the step that is not a
parameter gradient, counted exactly by ``titan_train.fake.MemoryTracker`` (activations saved
for backward, attention tiles, K/V blocks in flight, logits). CP 1 runs the same
``context_parallel`` backend over one rank, so the ratio isolates the split. The ring keeps
two K/V blocks per layer call (the one in use, the next in flight); all-gather holds every
rank's K/V while a layer attends.

Part 2 is ``titan-train --recipe llama3_8b --comm.fake-world-size 8 --parallel.cp 8
--parallel.dp-shard 1 --training.seq-len 131072 --training.steps 1 --parallel.cp-tile-scores
67108864 --remat.policy full`` (bf16, FSDP over the 8 context-parallel ranks; score tiles of
1448 x 1448 for 32 heads, 256 MiB in fp32): the memory report of one real step of rank 0.
"""

from __future__ import annotations

import argparse
import multiprocessing
import tempfile
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


def _recipe(a: argparse.Namespace) -> None:
    from titan_train.cli import parse_config
    from titan_train.trainer import train

    with tempfile.TemporaryDirectory() as out:
        argv = [
            "--output-dir", out, "--comm.fake-world-size", "8", "--parallel.cp", "8",
            "--parallel.dp-shard", "1", "--training.seq-len", "131072", "--training.steps", "1",
            "--checkpoint.interval", "0", "--parallel.cp-tile-scores", str(1 << 26),
            "--remat.policy", "full",
        ]  # fmt: skip
        train(parse_config(argv, "llama3_8b"))  # prints the memory table


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, nargs="+", default=[8192, 16384, 32768])
    p.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--skip-recipe", action="store_true", help="part 1 only")
    a = p.parse_args()
    _sweep(a)
    if not a.skip_recipe:
        _recipe(a)


if __name__ == "__main__":
    main()
