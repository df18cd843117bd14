"""Graph-mode training (``--compile.mode graph``): the train step's forward, loss, backward
and gradient reduction captured as one FX graph with ``make_fx``, passed through readable,
switchable passes, and run in place of the eager step, bitwise equal to it.

``capture.py`` traces, ``collectives.py`` writes flexshard's gather / reduce-scatter as
functional collectives, ``passes.py`` and ``memory.py`` transform the graph, ``dump.py``
prints and diffs graphs, ``artifact.py`` saves and loads pre-compiled graphs, ``runner.py``
caches graphs per input shape and runs them."""

from __future__ import annotations

from typing import Any

from titan_train.graph.checks import check_graph, static_moe_shapes
from titan_train.graph.runner import GraphStats, GraphStep, graph_key

__all__ = [
    "GraphStats",
    "GraphStep",
    "build_graph_step",
    "check_graph",
    "graph_key",
    "static_moe_shapes",
]


def build_graph_step(pm: Any, cfg: Any) -> GraphStep:
    """The ``GraphStep`` of this rank's model (``compile.mode='graph'``), with the
    pre-compiled artifact loaded when ``compile.precompile`` names one."""
    model = pm.parts[0]
    static_moe_shapes(model)
    step = GraphStep(model, cfg, dump_dir=cfg.compile.dump_graph or None)
    if cfg.compile.precompile:
        from titan_train.graph.artifact import attach_precompiled

        attach_precompiled(step, pm, cfg)
    return step
