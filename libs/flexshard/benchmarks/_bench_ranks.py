"""Per-rank bodies of the flexshard benchmarks (imported by the scripts next to it).

They live in their own module because ``run_distributed`` sends functions by reference:
a function defined in a script run as ``__main__`` would re-run that script on every rank.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

import flexshard as fs
from flexshard.testing import TinyTransformer, lm_batch


def _rss_peak_reset() -> int:
    """Reset the peak resident set size (Linux) and return the current one, in bytes."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    return _status("VmRSS")


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _init_(model: torch.nn.Module, seed: int) -> None:
    """Elementwise init of whatever each rank holds (plain tensors or DTensor shards)."""
    g = torch.Generator().manual_seed(seed + dist.get_rank())
    with torch.no_grad():
        for p in model.parameters():
            t = p.to_local() if hasattr(p, "to_local") else p
            t.copy_(torch.randn(t.shape, generator=g) * 0.02)


def _model(cfg: dict[str, Any]) -> TinyTransformer:
    """The benchmark model of ``cfg`` (on the current default device)."""
    return TinyTransformer(
        vocab=cfg["vocab"],
        dim=cfg["dim"],
        n_layers=cfg["layers"],
        n_heads=cfg["heads"],
        hidden=cfg["hidden"],
    )


def train_step_bench(lib: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """Step time and peak memory of one library on the same model (meta init, AdamW)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    with torch.device("meta"):
        model = _model(cfg)
    if lib == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        fs.shard(model, prefetch=cfg.get("prefetch", 1))
    model.to_empty(device="cpu")
    _init_(model, 0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    base = _rss_peak_reset()
    times = []
    b = cfg["batch"]
    for step in range(cfg["warmup"] + cfg["steps"]):
        x, y = lm_batch(cfg["vocab"], b * world, cfg["seq"], seed=step)
        x, y = x[rank * b : (rank + 1) * b], y[rank * b : (rank + 1) * b]
        dist.barrier()
        t0 = time.perf_counter()
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        dist.barrier()
        if step >= cfg["warmup"]:
            times.append(time.perf_counter() - t0)
    return {
        "step_s": statistics.median(times),
        "peak_bytes": _status("VmHWM") - base,
        "param_bytes_local": sum(
            (p.to_local() if hasattr(p, "to_local") else p).numel() * 4 for p in model.parameters()
        ),
    }


def _muon_setup(mode: str, cfg: dict[str, Any]):
    from flexshard.optim import Muon

    torch.manual_seed(0)
    model = _model(cfg)
    if mode == "owned":
        buckets = []
        for i in range(cfg["layers"]):
            pre = f"layers.{i}."
            buckets.append(
                fs.Bucket(
                    lambda f, p, pre=pre: f.startswith(pre) and p.dim() == 2,
                    fs.Owned(balance="flops"),
                )
            )
            buckets.append(
                fs.Bucket(lambda f, p, pre=pre: f.startswith(pre) and p.dim() == 1, fs.Shard(0))
            )
        buckets.append(fs.Bucket(["tok_emb.weight", "head.weight", "norm.weight"], fs.Shard(0)))
    else:
        buckets = None
    fs.shard(model, buckets=buckets)

    def is_mat(n, p):
        return n.startswith("layers.") and len(fs.param_info(p).shape) == 2

    named = list(model.named_parameters())
    opt = Muon(
        [
            {"params": [p for n, p in named if is_mat(n, p)], "use_muon": True},
            {"params": [p for n, p in named if not is_mat(n, p)], "use_muon": False},
        ],
        lr=0.02,
    )
    return model, opt


def muon_step_bench(cfg: dict[str, Any]) -> dict[str, Any]:
    """Time of Muon's optimizer step alone: Owned (Newton–Schulz on the owner, no
    collective) vs the Shard(0) baseline (gather the update, orthogonalise everywhere).
    Both models live in the same ranks and their steps alternate, so a change in machine
    load hits both alike."""
    rank, world = dist.get_rank(), dist.get_world_size()
    runs = {mode: _muon_setup(mode, cfg) for mode in ("gather", "owned")}
    times: dict[str, list[float]] = {mode: [] for mode in runs}
    for step in range(cfg["warmup"] + cfg["steps"]):
        x, y = lm_batch(cfg["vocab"], 2 * world, 16, seed=step)
        x, y = x[2 * rank : 2 * rank + 2], y[2 * rank : 2 * rank + 2]
        for mode, (model, opt) in runs.items():
            F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
            dist.barrier()
            t0 = time.perf_counter()
            opt.step()
            dist.barrier()
            if step >= cfg["warmup"]:
                times[mode].append(time.perf_counter() - t0)
            opt.zero_grad()
    return {
        mode: {"step_s": statistics.median(times[mode]), "optim_comm": runs[mode][1].comm.as_dict()}
        for mode in runs
    }


def fp8_gather_bench(
    quantize: str | None, cfg: dict[str, Any], param_dtype: torch.dtype | None = torch.bfloat16
) -> dict[str, Any]:
    """Bytes (counted from the send buffers) and time of gathering BlockShard buckets, and the
    all-gather bytes of one training step (forward and backward) with the same buckets.
    ``param_dtype=None``: no mixed precision (the gather sends the fp32 parameters)."""
    torch.manual_seed(0)
    model = _model(cfg)
    blk = cfg["block"]
    buckets = []
    for i in range(cfg["layers"]):
        pre = f"layers.{i}."
        buckets.append(
            fs.Bucket(
                lambda f, p, pre=pre: f.startswith(pre) and p.dim() == 2,
                fs.BlockShard(blk),
                quantize=quantize,
            )
        )
        buckets.append(
            fs.Bucket(lambda f, p, pre=pre: f.startswith(pre) and p.dim() == 1, fs.Replicate())
        )
    buckets.append(
        fs.Bucket(["tok_emb.weight", "head.weight"], fs.BlockShard(blk), quantize=quantize)
    )
    buckets.append(fs.Bucket("norm.weight", fs.Replicate()))
    mp = fs.MixedPrecision(param_dtype=param_dtype) if param_dtype is not None else None
    fs.shard(model, buckets=buckets, mp=mp)
    state = model.flexshard_state
    times = []
    for i in range(cfg["warmup"] + cfg["steps"]):
        if i == cfg["warmup"]:
            fs.comm_stats(model).reset()
        dist.barrier()
        t0 = time.perf_counter()
        for b in state.buckets:
            b.gather_async()
        for b in state.buckets:
            b.wait_gather()
        dist.barrier()
        times.append(time.perf_counter() - t0)
        model.reshard()
    per_gather = fs.comm_stats(model).bytes["all_gather"] // cfg["steps"]
    fs.comm_stats(model).reset()
    x, y = lm_batch(cfg["vocab"], 2, 32, seed=dist.get_rank())
    F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten()).backward()
    return {
        "gather_s": statistics.median(times[cfg["warmup"] :]),
        "bytes_per_gather": per_gather,
        "bytes_per_step": fs.comm_stats(model).bytes["all_gather"],
    }
