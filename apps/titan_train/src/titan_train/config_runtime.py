"""The job's sections for how a step runs — MoE dispatch, compilation, profiling — beside
``titan_train.config`` (which holds the job config and re-exports these)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["CompileConfig", "MoEConfig", "ProfilingConfig"]


@dataclass(kw_only=True, slots=True)
class MoEConfig:
    """How MoE layers run (their sizes are the model's)."""

    dispatch: Literal["all_to_all", "symm_mem"] = "all_to_all"
    """Expert-parallel token exchange (parallel.ep > 1): all_to_all (NCCL / gloo collectives)
    or symm_mem (dist_moe's one-sided puts into a symmetric-memory heap: CUDA with NCCL, a
    shared-memory emulation on CPU; capacity-padded buffers, no host sync)."""
    symm_mem_max_tokens: int = 0
    """symm_mem: most tokens one rank passes to a MoE layer in one call, which sizes the
    static buffers (0: the call's own count, the same on every rank in training)."""
    grouped_gemm: Literal["torch", "triton", "cute"] = "torch"
    """Kernel of the routed experts' grouped GEMMs (dist_moe ``GroupedExperts(gemm=...)``):
    torch (``torch._grouped_mm``, any device); triton (dist_moe's Triton kernel: a CUDA
    device, fp32 or bf16, ragged groups, no host sync); cute (dist_moe's CuTe DSL kernel: an
    SM90 / SM100 GPU, bf16, MoE layers in a capacity layout)."""
    static_shapes: bool = True
    """Dropless MoE buffers sized from shapes alone (dist_moe ``static_shapes``): no host
    sync, bitwise the same numerics; under all_to_all EP each rank sends every rank a block
    of its T tokens (memory: ep x T rows each way, and expert buffers for the worst case).
    False: exact sizes, read back on the host every layer (one sync each)."""


@dataclass(kw_only=True, slots=True)
class CompileConfig:
    """How the train step runs: eagerly, with each block compiled, or as one graph."""

    mode: Literal["eager", "local", "graph"] = "eager"
    """local: each block torch.compile'd; graph: the step's forward, loss, backward and
    gradient reduction as one FX graph (titan_train.graph), bitwise equal to eager."""
    enabled: bool = False
    """Older spelling of mode='local'."""
    passes: tuple[str, ...] = ("noop", "dce", "bucket")
    """Graph passes (mode=graph): noop, dce, bucket, memory keep every bit; inductor (opt-in)
    may change numerics."""
    bucket_mb: float = 25.0
    """bucket pass: most MiB of input per merged all-gather / reduce-scatter."""
    memory_budget: float = 0.0
    """memory pass: keep at most this fraction of the graph's saved activation bytes,
    recomputing the rest (0: follow remat.policy)."""
    dump_graph: str = ""
    """Folder to write each step graph to as text (per-node memory, passes applied)."""
    precompile: str = ""
    """Artifact file: written (traced on rank 0) when missing, else loaded without tracing."""


@dataclass(kw_only=True, slots=True)
class ProfilingConfig:
    """Traces and memory snapshots (the per-phase step times are always logged)."""

    trace_steps: str = ""
    """``a:b``: run torch.profiler over steps a to b (1-based) and write
    ``<run>/profiling/trace_rank<r>.json`` (Chrome / Perfetto); empty: no trace."""
    memory_snapshot: bool = False
    """CUDA: record the allocator's history and dump it (``memory_snapshot_rank<r>.pickle``);
    CPU: a table of the bytes each module saves for backward in the first step."""
    flight_recorder: int = 2000
    """Multi-rank runs: torch's collective flight recorder keeps the last N collectives of
    every process group (NCCL or gloo); on a watchdog timeout or a failed step each rank
    writes ``<run>/profiling/flight_recorder_rank<r>.json`` and ``stacks_rank<r>.txt``.
    0: off. An environment that sets TORCH_FR_BUFFER_SIZE itself wins."""
