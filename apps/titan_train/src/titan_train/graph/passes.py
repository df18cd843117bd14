"""Passes over the step graph.

Default passes keep every bit of the result (a test fails if one does not):

* ``noop``: drop nodes that only rename a tensor (``alias``, ``detach``, views to the same
  shape); their users read the input directly.
* ``dce``: drop nodes whose result nobody reads, unless they mutate, communicate or draw
  random numbers (dropping those would change what happens, or the random stream).
* ``bucket``: merge runs of all-gathers / reduce-scatters over the same group and dtype into
  one collective each, up to ``compile.bucket_mb`` MiB of input: the inputs are packed
  side by side (rank-major for reduce-scatter), the outputs cut back out, so every rank
  exchanges and sums exactly the same numbers.
* ``memory``: the per-tensor save / recompute / offload decisions of ``memory.py``, from the
  ``remat.policy`` / ``compile.memory_budget`` (opt-in: it trades compute for memory, never
  bits).

Opt-in passes that may change numerics: ``inductor`` (the whole graph compiled by Inductor,
``runner._compile``).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx

from titan_train.graph.collectives import is_collective

aten = torch.ops.aten
C10D = torch.ops._c10d_functional

DEFAULT_PASSES = ("noop", "dce", "bucket")
NUMERICS_PRESERVING = ("noop", "dce", "bucket", "memory")
OPT_IN = ("inductor",)
ALL_PASSES = (*NUMERICS_PRESERVING, *OPT_IN)


def resolve_passes(names: Sequence[str]) -> tuple[str, ...]:
    """``names`` checked; ``ValueError`` naming the unknown one."""
    for n in names:
        if n not in ALL_PASSES:
            raise ValueError(
                f"compile.passes: {n!r} is not a pass; passes: {', '.join(ALL_PASSES)} (default "
                f"{', '.join(DEFAULT_PASSES)}; inductor may change numerics)"
            )
    return tuple(names)


def run_passes(
    gm: fx.GraphModule, passes: Sequence[str], sig: Any, cfg: Any
) -> list[tuple[str, str]]:
    """Apply the graph passes of ``passes`` in the fixed order noop, dce, memory, bucket;
    returns (pass, what it did) for each one applied."""
    applied: list[tuple[str, str]] = []
    table: dict[str, Callable[[], str]] = {
        "noop": lambda: remove_noops(gm),
        "dce": lambda: remove_dead_code(gm),
        "memory": lambda: _memory(gm, cfg),
        "bucket": lambda: bucket_collectives(gm, int(cfg.compile.bucket_mb * 2**20)),
    }
    for name in ("noop", "dce", "memory", "bucket"):
        if name in passes:
            applied.append((name, table[name]()))
    gm.graph.lint()
    gm.recompile()
    if "inductor" in passes:
        applied.append(("inductor", "whole graph compiled by Inductor (numerics may differ)"))
    return applied


def _memory(gm: fx.GraphModule, cfg: Any) -> str:
    from titan_train.graph.memory import apply_memory_policy, policy_from_config

    return apply_memory_policy(gm, policy_from_config(cfg))


# --- no-ops and dead code ---------------------------------------------------------------------

_RENAMES = {aten.alias.default, aten.detach.default}
_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.expand.default}


def _val(n: Any) -> Any:
    return n.meta.get("val") if isinstance(n, fx.Node) else None


def remove_noops(gm: fx.GraphModule) -> str:
    """Drop renames and same-shape views; returns a summary."""
    removed = 0
    for n in list(gm.graph.nodes):
        if n.op != "call_function":
            continue
        src = n.args[0] if n.args else None
        same = False
        if n.target in _RENAMES:
            same = True
        elif n.target in _VIEWS and isinstance(src, fx.Node):
            a, b = _val(src), _val(n)
            same = (
                isinstance(a, torch.Tensor)
                and isinstance(b, torch.Tensor)
                and a.shape == b.shape
                and a.stride() == b.stride()
            )
        if same and isinstance(src, fx.Node):
            n.replace_all_uses_with(src)
            gm.graph.erase_node(n)
            removed += 1
    return f"removed {removed} no-op nodes"


def _keep(n: fx.Node) -> bool:
    if n.op != "call_function":
        return True
    t = n.target
    if isinstance(t, torch._ops.OpOverload):
        if t._schema.is_mutable or t.namespace == "_c10d_functional":
            return True
        if torch.Tag.nondeterministic_seeded in t.tags:
            return True
    return False


def remove_dead_code(gm: fx.GraphModule) -> str:
    """Drop unread nodes that neither mutate, communicate nor draw random numbers."""
    removed = 0
    for n in reversed(list(gm.graph.nodes)):
        if not n.users and not _keep(n):
            gm.graph.erase_node(n)
            removed += 1
    return f"removed {removed} dead nodes"


# --- collective bucketing ---------------------------------------------------------------------


def _fake_call(graph: fx.Graph, op: Any, args: tuple, meta_from: fx.Node) -> fx.Node:
    """A new node ``op(*args)`` with its ``val`` computed on meta tensors shaped like the
    values of its inputs (collectives: their output shape)."""
    node = graph.call_function(op, args)

    def meta(a: fx.Node) -> torch.Tensor:
        v = a.meta["val"]
        return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta")

    margs = fx.node.map_arg(args, meta)
    if op == C10D.all_gather_into_tensor.default:
        x, world = margs[0], margs[1]
        val = x.new_empty((x.shape[0] * world, *x.shape[1:]))
    elif op == C10D.reduce_scatter_tensor.default:
        x, world = margs[0], margs[2]
        val = x.new_empty((x.shape[0] // world, *x.shape[1:]))
    elif op == C10D.wait_tensor.default:
        val = margs[0]
    else:
        val = op(*margs)
    node.meta["val"] = val
    node.meta["phase"] = meta_from.meta.get("phase")
    node.meta["micro"] = meta_from.meta.get("micro")
    return node


def _collective_groups(gm: fx.GraphModule, cap: int) -> list[list[fx.Node]]:
    """Runs of mergeable collectives, in graph order: same op, group and dtype, each run's
    inputs summing to at most ``cap`` bytes."""
    runs: dict[tuple, list[list[fx.Node]]] = {}
    for n in gm.graph.nodes:
        if n.op != "call_function" or not is_collective(n):
            continue
        if n.target not in (
            C10D.all_gather_into_tensor.default,
            C10D.reduce_scatter_tensor.default,
        ):
            continue
        waits = [u for u in n.users if u.target == C10D.wait_tensor.default]
        if len(n.users) != 1 or len(waits) != 1:
            continue
        x = n.args[0].meta["val"]
        key = (n.target, *n.args[1:], x.dtype, x.device)
        bucket = runs.setdefault(key, [[]])
        size = x.numel() * x.element_size()
        current = bucket[-1]
        used = sum(_arg(c).meta["val"].numel() * x.element_size() for c in current)
        if current and used + size > cap:
            bucket.append([])
        bucket[-1].append(n)
    return [r for groups in runs.values() for r in groups if len(r) > 1]


def _arg(n: fx.Node) -> fx.Node:
    """A collective's input tensor node."""
    first = n.args[0]
    assert isinstance(first, fx.Node), f"{n.name}: a collective takes a tensor node first"
    return first


def bucket_collectives(gm: fx.GraphModule, cap_bytes: int) -> str:
    """Merge runs of all-gathers and reduce-scatters (see the module doc)."""
    g = gm.graph
    before = sum(1 for n in g.nodes if n.op == "call_function" and is_collective(n))
    order = {n: i for i, n in enumerate(g.nodes)}
    for run in _collective_groups(gm, cap_bytes):
        inputs = [_arg(c) for c in run]
        anchor = max(inputs, key=lambda a: order[a])
        waits = [next(iter(c.users)) for c in run]
        gather = run[0].target == C10D.all_gather_into_tensor.default
        world = run[0].args[1] if gather else run[0].args[2]

        def call(op: Any, args: tuple, like: fx.Node = run[0]) -> fx.Node:
            return _fake_call(g, op, args, like)

        with g.inserting_after(anchor):
            numels = [a.meta["val"].numel() for a in inputs]
            if gather:
                flats = [call(aten.reshape.default, (a, [-1])) for a in inputs]
                packed = call(aten.cat.default, (flats,))
                coll = call(run[0].target, (packed, *run[0].args[1:]))
            else:
                rows = [call(aten.reshape.default, (a, [world, -1])) for a in inputs]
                packed = call(aten.reshape.default, (call(aten.cat.default, (rows, 1)), [-1]))
                coll = call(run[0].target, (packed, *run[0].args[1:]))
            done = call(C10D.wait_tensor.default, (coll,))
            total = sum(numels)
            outs = []
            table = call(aten.view.default, (done, [world, total])) if gather else done
            off = 0
            for a, w in zip(inputs, waits, strict=True):
                shape = list(w.meta["val"].shape)
                n = a.meta["val"].numel() // (1 if gather else world)
                src = table
                piece = call(aten.slice.Tensor, (src, 1 if gather else 0, off, off + n))
                outs.append(call(aten.reshape.default, (piece, shape)))
                off += n
        for w, o, c in zip(waits, outs, run, strict=True):
            w.replace_all_uses_with(o)
            g.erase_node(w)
            g.erase_node(c)
        _stable_toposort(gm)
        order = {n: i for i, n in enumerate(g.nodes)}
    after = sum(1 for n in g.nodes if n.op == "call_function" and is_collective(n))
    return f"collectives {before} -> {after}"


def _stable_toposort(gm: fx.GraphModule) -> None:
    """Reorder the graph so every node follows its inputs, moving as little as possible
    (nodes keep their relative order unless an input comes later)."""
    g = gm.graph
    nodes = list(g.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    deps = {n: set(n.all_input_nodes) for n in nodes}
    _mutation_edges(nodes, index, deps)
    users: dict[fx.Node, list[fx.Node]] = {n: [] for n in nodes}
    for n, ds in deps.items():
        for d in ds:
            users[d].append(n)
    pending = {n: len(ds) for n, ds in deps.items()}
    heap = [index[n] for n in nodes if pending[n] == 0]
    heapq.heapify(heap)
    out = []
    while heap:
        n = nodes[heapq.heappop(heap)]
        out.append(n)
        for u in users[n]:
            pending[u] -= 1
            if pending[u] == 0:
                heapq.heappush(heap, index[u])
    if len(out) != len(nodes):
        raise RuntimeError("step graph has a cycle after bucketing")
    if out == nodes:
        return
    cursor = out[0]
    for n in out[1:]:
        cursor.append(n)
        cursor = n


def _mutation_edges(
    nodes: list[fx.Node], index: dict[fx.Node, int], deps: dict[fx.Node, set[fx.Node]]
) -> None:
    """An in-place op stays after every earlier reader of the tensor it writes, and before
    every later one (data edges alone do not order them)."""
    for n in nodes:
        t = n.target
        if n.op != "call_function" or not isinstance(t, torch._ops.OpOverload):
            continue
        if not t._schema.is_mutable:
            continue
        for arg, a in zip(t._schema.arguments, n.args, strict=False):
            if not (arg.alias_info and arg.alias_info.is_write and isinstance(a, fx.Node)):
                continue
            for r in a.users:
                if r is n:
                    continue
                if index[r] < index[n]:
                    deps[n].add(r)
                else:
                    deps[r].add(n)
