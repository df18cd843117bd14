"""Run the captured step graph in place of the eager micro-batch loop.

``GraphStep`` holds one graph per input signature (shapes and dtypes of the micro-batches,
their number): a new shape is traced once, passed through the configured passes and cached.
Each call runs the graph on the app's own tensors (parameters, buffers) and stores the
gradients in the parameters' ``.grad``, exactly where eager backward (and flexshard's
reduction) leaves them: clipping, the optimizer, checkpoints and resume see no difference.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from titan_train.data.packing import Batch
from titan_train.graph.capture import StepSignature, host_checks, signature, trace_step


@dataclass
class GraphStats:
    """What the runner did (counted, for tests and the log)."""

    traces: int = 0
    """Graphs traced on this rank."""
    loaded: int = 0
    """Graphs taken from a pre-compiled artifact (no tracing)."""
    runs: int = 0
    trace_s: float = 0.0
    passes: list[str] = field(default_factory=list)
    """Passes applied to the latest graph, in order."""
    applied: list[tuple[str, str]] = field(default_factory=list)
    """(pass, what it did) for the latest traced graph."""


def graph_key(inputs: Sequence[torch.Tensor], num_micro: int) -> str:
    """The cache key of a step: number of micro-batches, shape and dtype of every input."""
    shapes = ";".join(f"{tuple(t.shape)}:{str(t.dtype).removeprefix('torch.')}" for t in inputs)
    return f"micro={num_micro}|{shapes}"


class GraphStep:
    """The train step's forward + backward (+ gradient reduction) of ``model`` as graphs."""

    def __init__(
        self,
        model: nn.Module,
        cfg: Any,
        *,
        passes: Sequence[str] | None = None,
        dump_dir: str | Path | None = None,
    ) -> None:
        from titan_train.graph.passes import resolve_passes

        self.model = model
        self.cfg = cfg
        self.sig: StepSignature = signature(model)
        self.passes = resolve_passes(cfg.compile.passes if passes is None else passes)
        self.dump_dir = Path(dump_dir) if dump_dir else None
        self.graphs: dict[str, torch.fx.GraphModule] = {}
        self.runnable: dict[str, Any] = {}
        self.stats = GraphStats()
        self.on_new_graph: Any = None
        """Called after a graph is traced and passed (the pre-compile writer)."""

    # -- graphs ------------------------------------------------------------------------------
    def graph_for(self, scale: torch.Tensor, micro: Sequence[Batch]) -> tuple[str, list]:
        """The cache key and inputs of this step, tracing (and passing) a graph when new."""
        inputs = self.sig.inputs(scale, micro)
        key = graph_key(inputs, len(micro))
        if key not in self.graphs:
            t0 = time.perf_counter()
            gm = trace_step(self.model, self.cfg, self.sig, inputs, len(micro))
            self.stats.traces += 1
            self.stats.trace_s += time.perf_counter() - t0
            self.add_graph(key, gm)
            if self.on_new_graph is not None:
                self.on_new_graph()
        return key, inputs

    def add_graph(self, key: str, gm: torch.fx.GraphModule) -> None:
        """Pass ``gm`` through the configured passes and cache it under ``key``."""
        from titan_train.graph.passes import run_passes

        before = gm.graph.python_code("self").src if self.dump_dir else None
        applied = run_passes(gm, self.passes, self.sig, self.cfg)
        self.stats.passes = [name for name, _ in applied]
        self.stats.applied = applied
        self.graphs[key] = gm
        if self.dump_dir is not None:
            from titan_train.graph.dump import dump_step

            dump_step(self.dump_dir, key, gm, applied, self.sig, before=before)

    def install(self, key: str, gm: torch.fx.GraphModule, passes: Sequence[str]) -> None:
        """Use ``gm`` (already passed through ``passes``) for ``key``: no tracing."""
        self.graphs[key] = gm
        self.stats.loaded += 1
        self.stats.passes = list(passes)
        if self.dump_dir is not None:
            from titan_train.graph.dump import dump_step

            dump_step(self.dump_dir, key, gm, [(p, "loaded") for p in passes], self.sig)

    # -- one step ----------------------------------------------------------------------------
    def run(self, scale: torch.Tensor, micro: Sequence[Batch]) -> torch.Tensor:
        """Forward and backward of ``micro``; gradients set on the parameters; returns the
        summed (scaled) loss on the device."""
        host_checks(micro)
        key, inputs = self.graph_for(scale, micro)
        if key not in self.runnable:
            self.runnable[key] = _compile(self.graphs[key], inputs, self.passes)
        out = self.runnable[key](*inputs)
        self.stats.runs += 1
        self._set_grads(out[1:])
        return out[0]

    def _set_grads(self, grads: Sequence[torch.Tensor | None]) -> None:
        from torch.distributed.tensor import DTensor

        for i, g in zip(self.sig.trainable, grads, strict=True):
            if g is None:
                continue
            p = self.sig.params[i]
            dt = self.sig.dtensors[i]
            if dt is not None:
                mesh, placements, shape, stride = dt
                g = DTensor.from_local(
                    g, mesh, placements, run_check=False, shape=shape, stride=stride
                )
            if p.grad is None:
                p.grad = g
            else:
                p.grad.add_(g)


def _compile(gm: torch.fx.GraphModule, inputs: list[torch.Tensor], passes: Sequence[str]) -> Any:
    """The callable that runs ``gm``: the graph module itself, or Inductor's compiled form
    when the opt-in ``inductor`` pass is on (numerics may differ from eager)."""
    if "inductor" not in passes:
        return gm
    from torch._inductor.compile_fx import compile_fx

    # compile_fx functionalises the graph first (its in-place buffer updates included) and
    # writes the mutations back to the inputs.
    with torch.no_grad():
        compiled = compile_fx(gm, inputs)
    return compiled
