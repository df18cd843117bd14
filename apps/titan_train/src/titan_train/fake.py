"""Fake-backend mode: one CPU process stands for a rank of a job of any size and runs real
steps of it without allocating or communicating anything.

``titan-train --recipe R --comm.fake-world-size N`` joins a fake process group as rank ``r``
of ``N`` (``torch.testing._internal.distributed.fake_pg``: every collective returns at once),
builds the mesh on the recipe's device type, builds and parallelises the model exactly as a
real run does, and runs ``training.steps`` steps under ``FakeTensorMode``: every tensor has a
shape, a dtype and a device but no data, and any mix with a real CPU tensor raises. It does
this for one rank of each pipeline stage (rank 0's position in the other dimensions) and
writes ``runs/<name>/memory.json``: per stage, the bytes of parameters, gradients and
optimizer state that rank holds, the peak of everything else allocated during forward and
backward (activations and temporaries, an exact count of live storages), flexshard's peak of
gathered parameters, the global parameter count, and ``peak_bytes_per_rank``: the largest
rank's sum of all of these.

Fake tensors live on ``meta`` (see ``titan_train.device.FAKE_DEVICE``); MoE layers use
static-capacity dispatch (capacity factor 1: the activations of perfectly balanced routing),
since data-dependent shapes have no value to read; autocast is off (flexshard's mixed
precision still casts the gathered weights).
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import resource
import time
import weakref
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import titan_models
from titan_train.build import Job, build_loaders, build_optimizer, build_parallel, resolve
from titan_train.config import JobConfig
from titan_train.device import FAKE_DEVICE, init_fake_process_group
from titan_train.errors import ConfigError
from titan_train.layout import ParallelDims
from titan_train.parallelize import ParallelModel


class _FusedAttentionMemory(torch.autograd.Function):
    """What a fused attention kernel (flash / FlexAttention / cuDNN) keeps: it saves q, k, v,
    the output and an fp32 ``(B, S, H)`` log-sum-exp, and materialises no score matrix. On
    fake tensors only the shapes and the saved storages matter."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = q.new_empty((*q.shape[:-1], v.shape[-1]))
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        q, k, v, _, _ = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _fused_attention_memory(
    q_BSHE: torch.Tensor,
    k_BLKE: torch.Tensor,
    v_BLKV: torch.Tensor,
    meta: titan_models.AttentionMetadata,
    prepared: Any,
    *,
    window: int | None,
    sinks: torch.Tensor | None,
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    """A ``titan_models`` attention backend (``BackendForward``) with a fused kernel's memory."""
    return _FusedAttentionMemory.apply(q_BSHE, k_BLKE, v_BLKV)


FAKE_ATTENTION = "fused_memory_model"
"""The attention backend of fake mode: an accelerator's fused kernels cannot run on fake
``meta`` tensors (FlexAttention refuses the device), so their memory is modelled instead."""


def static_moe(model: nn.Module) -> None:
    """Static-capacity dispatch (capacity factor 1) in every MoE layer of ``model``."""
    import dist_moe

    for module in model.modules():
        if isinstance(module, dist_moe.MoE):
            permute = dataclasses.replace(module.config.permute, capacity_factor=1.0)
            module.config = dataclasses.replace(module.config, permute=permute)
            module.dispatcher = dist_moe.LocalDispatcher(module.config.router.num_experts, permute)


class MemoryTracker(TorchDispatchMode):
    """Every storage an op creates, from allocation to its last reference: a timeline of
    (storage key, +bytes) / (key, -bytes) events. Views share their base's storage, so each
    byte counts once."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[int, int]] = []
        self._live: dict[int, tuple[int, int]] = {}  # id(storage) -> (key, bytes)
        self._next = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "cpu":
                self._track(t.untyped_storage())
        return out

    def _track(self, storage: torch.UntypedStorage) -> None:
        if id(storage) in self._live:
            return
        key, nbytes = self._next, storage.nbytes()
        self._next += 1
        self._live[id(storage)] = (key, nbytes)
        self.events.append((key, nbytes))
        weakref.finalize(storage, self._free, id(storage))

    def _free(self, ident: int) -> None:
        key, nbytes = self._live.pop(ident)
        self.events.append((key, -nbytes))

    def key_of(self, tensor: torch.Tensor) -> int | None:
        """The key of ``tensor``'s storage if it is tracked (alive)."""
        entry = self._live.get(id(tensor.untyped_storage()))
        return entry[0] if entry else None

    def peak_above(self, start: int, stop: int, excluded: set[int]) -> int:
        """Highest sum of bytes allocated after event ``start`` and still alive, over events
        ``start..stop``, leaving out storages in ``excluded``."""
        live = peak = 0
        for key, delta in self.events[start:stop]:
            if key not in excluded:
                live += delta
                peak = max(peak, live)
        return peak


def _nbytes(tensors: Sequence[torch.Tensor]) -> int:
    seen, total = set(), 0
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        if t.device.type == "cpu" or id(t.untyped_storage()) in seen:
            continue
        seen.add(id(t.untyped_storage()))
        total += t.untyped_storage().nbytes()
    return total


def _representative_ranks(dims: ParallelDims) -> list[int]:
    """Rank 0's position in every dimension but ``pp``, on each pipeline rank (``pp`` is the
    outermost mesh axis)."""
    return [s * (dims.world_size // dims.pp) for s in range(dims.pp)]


def run_fake(cfg: JobConfig | Job) -> dict[str, Any]:
    """The fake-backend run of ``cfg`` (a config with ``comm.fake_world_size``, or its
    resolved ``Job``): ``training.steps`` steps, 0 for a plan; writes and returns the memory
    report."""
    job = cfg if isinstance(cfg, Job) else resolve(cfg)
    cfg, dims = job.cfg, job.dims
    if not cfg.comm.fake_world_size:
        raise ConfigError("run_fake needs comm.fake_world_size (the world the process stands for)")
    loader, _ = build_loaders(job, dp_rank=0)
    batches = [next(loader) for _ in range(cfg.training.steps)]  # real tensors, made outside
    stages = []
    # One fresh process per rank: torch's DeviceMesh caches outlive a destroyed process group.
    spawn = multiprocessing.get_context("spawn")
    for rank in _representative_ranks(dims):
        start = time.perf_counter()
        with ProcessPoolExecutor(max_workers=1, mp_context=spawn) as pool:
            row = pool.submit(_run_rank, job, rank, batches).result()
        row["seconds"] = round(time.perf_counter() - start, 2)
        stages.append(row)
    total = job.num_params()
    report = {
        "recipe": cfg.name,
        "model": f"{cfg.model.family} {cfg.model.flavor}",
        "parameters": total,
        "world_size": dims.world_size,
        "layout": {
            k: getattr(dims, k) for k in ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep")
        },
        "device_type": "cuda" if cfg.training.device == "auto" else cfg.training.device,
        "steps": cfg.training.steps,
        "seq_len": cfg.training.seq_len,
        "batch_size": cfg.training.batch_size,
        "stages": stages,
        "peak_rss_bytes": max(
            resource.getrusage(who).ru_maxrss * 1024
            for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
        ),
    }
    report["total_bytes_per_rank"] = max(_total(row) for row in stages)
    # The largest rank's peak: parameters, gradients, optimizer, activations, gathered buffers.
    report["peak_bytes_per_rank"] = report["total_bytes_per_rank"]
    report["fits"] = fits(report["total_bytes_per_rank"])
    run_dir = Path(cfg.output_dir) / cfg.name
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "memory.json").write_text(json.dumps(report, indent=2) + "\n")
    _print(report)
    return {"memory": report, "run_dir": run_dir, "losses": [], "step": cfg.training.steps}


def _run_rank(job: Job, rank: int, batches: list[Any]) -> dict[str, Any]:
    """Rank ``rank``'s fake steps and memory (in a fresh process: see ``run_fake``)."""
    cfg, dims, config = job.cfg, job.dims, job.model_config

    device_type = "cuda" if cfg.training.device == "auto" else cfg.training.device
    if hasattr(config, "attention_backend"):
        backend = titan_models.resolve_attention_backend(config.attention_backend, device_type)
        if dims.cp > 1:  # the context-parallel backend runs on fake tensors as it is
            backend = "context_parallel"
        elif backend in ("flex", "varlen") and device_type == "cuda":  # fused kernels there
            titan_models.register_attention_backend(FAKE_ATTENTION, _fused_attention_memory)
            backend = FAKE_ATTENTION
        config = dataclasses.replace(config, attention_backend=backend)
    try:
        return _fake_steps(dataclasses.replace(job, model_config=config), rank, batches)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _fake_steps(job: Job, rank: int, batches: list[Any]) -> dict[str, Any]:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from titan_train.materialize import materialize
    from titan_train.parallelize import build_stages
    from titan_train.trainer import train_step

    cfg, dims, config = job.cfg, job.dims, job.model_config
    init_fake_process_group(dims.world_size, rank)
    mesh_type = "cuda" if cfg.training.device == "auto" else cfg.training.device
    pm = build_parallel(job, mesh_type, edit=static_moe)
    stage = pm.schedule.stages_of_rank(pm.meshes["pp"].get_local_rank()) if pm.schedule else [0]
    tracker = MemoryTracker()
    marks: dict[str, Any] = {}
    with FakeTensorMode(allow_non_fake_inputs=True), tracker:
        materialize(pm, FAKE_DEVICE, seed=cfg.training.seed, fill=False)
        if dims.pp > 1:
            build_stages(pm, cfg)
        optimizer = build_optimizer(pm, cfg)
        params = pm.parameters()
        for i, batch in enumerate(batches):
            marks["start"] = len(tracker.events)

            def on_grads(i: int = i) -> None:
                marks["grads"] = len(tracker.events)
                grads = [p.grad for p in params if p.grad is not None]
                marks["grad_keys"] = {tracker.key_of(g) for g in grads}
                marks["grad_bytes"] = _nbytes(grads)

            train_step(pm, optimizer, batch.to(FAKE_DEVICE), cfg, on_grads=on_grads)
        flats = {
            tracker.key_of(b.flat)
            for part in (pm.flexshard_parts() if pm.sharded else [])
            for st in part.flexshard_state.all_states()
            for b in st.buckets
            if b.flat is not None
        }
        states = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
        row: dict[str, Any] = {
            "rank": rank,
            "stages": list(stage),
            "params_bytes": _nbytes(params),
            "grads_bytes": marks.get("grad_bytes", 0),
            "optimizer_bytes": _nbytes(states),
        }
        if batches:  # the last step: optimizer state exists, as in steady state
            excluded = marks["grad_keys"] | flats
            row["activations_peak_bytes"] = tracker.peak_above(
                marks["start"], marks["grads"], excluded
            )
        else:  # a plan (--dry-run): what a step would hold, from the shapes
            from titan_train.materialize import local_bytes

            bf16 = cfg.training.mixed_precision == "bf16"
            need = local_bytes(pm, optimizer=cfg.optimizer.name, bf16=bf16)
            row["grads_bytes"], row["optimizer_bytes"] = need["grads"], need["optimizer"]
            row["gathered_params_peak_bytes"] = need["gathered"]
            row["activations_estimate_bytes"] = activation_estimate(cfg, dims, config, pm)
        if pm.context_parallel is not None:  # the plan's tiles of one layer's attention call
            row["cp_tiles_per_layer"] = pm.context_parallel.stats.most
        if pm.sharded and batches:  # flexshard's count of gathered buffers (peak above shards)
            parts = pm.flexshard_parts()
            mems = [st.mem for part in parts for st in part.flexshard_state.all_states()]
            row["gathered_params_peak_bytes"] = sum(m.peak - m.current for m in mems)
    return row


def activation_estimate(
    cfg: JobConfig,
    dims: ParallelDims,
    config: titan_models.TransformerConfig,
    pm: ParallelModel,
) -> int:
    """Activation bytes one rank keeps for backward, from the shapes (``--dry-run``, where no
    step runs). Per transformer block ``s·b·h·(10 + 24/tp)`` bytes in 16-bit compute
    (Korthikanti et al. 2022 without sequence parallelism, fused attention: no ``s²`` term);
    under full remat only the block's input (``2·s·b·h``) plus one block recomputed in
    backward; ``every_nth``: one block in n kept whole. Tokens are this rank's (micro-batch,
    context shard); a first pipeline stage holds ``min(pp, microbatches)`` microbatches
    (1F1B). The rank with the head adds fp32 logits and their gradient. An estimate: a fake
    step (``--comm.fake-world-size N --training.steps 1``) measures the peak."""
    t, p = cfg.training, cfg.parallel
    micro = t.batch_size // (p.pp_microbatches if dims.pp > 1 else t.grad_accum)
    sbh = micro * t.seq_len // dims.cp * config.dim * (2 if t.mixed_precision == "fp32" else 1)
    whole = sbh * (10 + 24 / dims.tp)
    kept = {"full": 2 * sbh, "every_nth": whole / cfg.remat.every_nth + 2 * sbh}
    per_block = kept.get(cfg.remat.policy, whole)
    blocks = sum(len(part.layers) for part in pm.parts if getattr(part, "layers", None))
    in_flight = min(dims.pp, p.pp_microbatches) if dims.pp > 1 else 1
    total = blocks * per_block * in_flight + (whole if cfg.remat.policy != "none" else 0)
    if any(getattr(part, "output", None) is not None for part in pm.parts):
        tokens = sbh // config.dim
        total += 2 * 4 * tokens * config.vocab_size // dims.tp
    return int(total)


ACCELERATORS = (("H100", 80), ("H200", 141), ("GB300", 288))
"""Accelerators the dry run checks a layout against: (name, memory in GB, 10⁹ bytes)."""

HEADROOM = 0.9
"""Fraction of an accelerator's memory a rank may plan to use (the rest: CUDA context,
allocator fragmentation, communication buffers)."""


def fits(bytes_per_rank: int) -> dict[str, bool]:
    """Per accelerator of ``ACCELERATORS``: whether a rank needing ``bytes_per_rank`` fits in
    ``HEADROOM`` of its memory."""
    return {name: bytes_per_rank <= HEADROOM * gb * 1e9 for name, gb in ACCELERATORS}


def verdicts(report: dict[str, Any]) -> list[str]:
    """Per accelerator: whether the largest rank's total fits in ``HEADROOM`` of its memory."""
    fits = report["fits"]
    return [f"{n} {gb} GB: {'fits' if fits[n] else 'does not fit'}" for n, gb in ACCELERATORS]


_COLUMNS = (
    ("params", "params_bytes"),
    ("grads", "grads_bytes"),
    ("optimizer", "optimizer_bytes"),
    ("activations", "activations_peak_bytes"),
    ("gathered", "gathered_params_peak_bytes"),
)


def _activations(row: dict[str, Any]) -> int | None:
    return row.get("activations_peak_bytes", row.get("activations_estimate_bytes"))


def _total(row: dict[str, Any]) -> int:
    parts = [row.get(k) for _, k in _COLUMNS if k != "activations_peak_bytes"]
    return sum(v or 0 for v in parts) + (_activations(row) or 0)


def _print(report: dict[str, Any]) -> None:
    """The per-rank memory table (GiB), then one verdict line per accelerator."""
    gib = 2**30
    layout = " ".join(f"{k}={v}" for k, v in report["layout"].items())
    estimated = any("activations_estimate_bytes" in row for row in report["stages"])
    names = [n if n != "activations" or not estimated else "activ. (est.)" for n, _ in _COLUMNS]
    lines = [
        f"{report['model']}: {report['parameters'] / 1e9:.2f} B parameters, "
        f"{report['world_size']} ranks ({layout}); per rank, GiB:",
        "  ".join(f"{c:>13}" for c in ("stage", *names, "total", "seconds")),
    ]
    for row in report["stages"]:
        values = [row.get(k) for _, k in _COLUMNS]
        values[3] = _activations(row)
        cells = ["-" if v is None else f"{v / gib:.2f}" for v in values]
        stage = ",".join(map(str, row["stages"]))
        total = f"{_total(row) / gib:.2f}"
        lines.append("  ".join(f"{c:>13}" for c in (stage, *cells, total, f"{row['seconds']:.1f}")))
    tiles = [row["cp_tiles_per_layer"] for row in report["stages"] if "cp_tiles_per_layer" in row]
    if tiles:
        lines.append(f"context-parallel attention: {max(tiles)} tiles per layer per rank")
    lines.append("per rank: " + "; ".join(verdicts(report)))
    print("\n".join(lines), flush=True)
