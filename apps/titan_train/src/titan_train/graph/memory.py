"""Per-tensor memory of the step graph: estimates, and the pass that decides for every
activation (a forward value the backward reads) whether it is saved or recomputed.

Estimates come from each node's fake value (``meta['val']``): a node's bytes are those of
the storage it creates (views create none), a value is live from its node to its last
reader, and the *saved activations* are the forward storages some backward node reads.

The ``memory`` pass takes its policy from ``torch_remat`` (the same policy objects the eager
path applies per block): ``torch_remat.Full()`` recomputes every activation that can be
recomputed, ``torch_remat.Selective(save=...)`` keeps the outputs of the named op groups
(``matmul``, ``attention``) and recomputes the rest, ``torch_remat.Budget(f)`` keeps at most
the fraction ``f`` of the saved bytes, recomputing the cheapest first (pointwise before
matmuls, larger first). Recomputation copies the forward nodes, from saved values and
inputs, just before their first backward reader: the same ops on the same values, so the
step's results do not change by one bit. Random, in-place and collective nodes are never
recomputed (they stay saved).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import fx

aten = torch.ops.aten
_MATMULS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "_grouped_mm", "linear"}
_ATTENTION = "scaled_dot_product"


def node_bytes(n: fx.Node) -> int:
    """Bytes of the storage ``n`` creates (0 for views, non-tensors and placeholders)."""
    if n.op != "call_function" or is_view(n):
        return 0
    total = 0
    for v in _tensors(n.meta.get("val")):
        total += v.numel() * v.element_size()
    return total


def _tensors(v: Any) -> Iterable[torch.Tensor]:
    if isinstance(v, torch.Tensor):
        yield v
    elif isinstance(v, list | tuple):
        for x in v:
            yield from _tensors(x)


def is_view(n: fx.Node) -> bool:
    """Whether ``n``'s output aliases one of its inputs (a view, a rename, an in-place op)."""
    t = n.target
    if not isinstance(t, torch._ops.OpOverload):
        return getattr(t, "__name__", "") == "getitem" if callable(t) else False
    return any(r.alias_info is not None for r in t._schema.returns)


def root(n: fx.Node) -> fx.Node:
    """The node whose storage ``n`` views (itself when it creates one)."""
    while n.op == "call_function" and is_view(n) and n.args and isinstance(n.args[0], fx.Node):
        n = n.args[0]
    return n


def phase(n: fx.Node) -> str | None:
    return n.meta.get("phase")


def saved_activations(gm: fx.GraphModule) -> dict[fx.Node, int]:
    """Forward storages read by the backward of the same micro-batch: root -> bytes."""
    out: dict[fx.Node, int] = {}
    for n in gm.graph.nodes:
        if phase(n) != "fwd" or n.op != "call_function":
            continue
        if any(phase(u) == "bwd" and u.meta.get("micro") == n.meta.get("micro") for u in n.users):
            r = root(n)
            if r.op == "call_function" and phase(r) == "fwd":
                out[r] = node_bytes(r)
    return out


def live_bytes(gm: fx.GraphModule) -> dict[fx.Node, int]:
    """Estimated bytes of graph-created storages live after each node (inputs excluded)."""
    nodes = list(gm.graph.nodes)
    last: dict[fx.Node, int] = {}
    for i, n in enumerate(nodes):
        for a in n.all_input_nodes:
            last[root(a)] = i
    frees: dict[int, list[fx.Node]] = {}
    for r, i in last.items():
        frees.setdefault(i, []).append(r)
    live, out = 0, {}
    for i, n in enumerate(nodes):
        live += node_bytes(n)
        out[n] = live
        for r in frees.get(i, []):
            if r.op != "output" and not any(u.op == "output" for u in r.users):
                live -= node_bytes(r)
    return out


def policy_from_config(cfg: Any) -> Any:
    """The torch_remat policy of the memory pass: ``Budget(compile.memory_budget)`` when set,
    else the one ``remat.policy`` names."""
    import torch_remat

    if cfg.compile.memory_budget:
        return torch_remat.Budget(cfg.compile.memory_budget)
    name = cfg.remat.policy
    if name == "full":
        return torch_remat.Full()
    if name == "selective":
        return torch_remat.Selective()
    raise ValueError(
        f"the memory pass needs remat.policy 'full' or 'selective', or compile.memory_budget "
        f"(got remat.policy={name!r})"
    )


def _recomputable(n: fx.Node) -> bool:
    t = n.target
    if n.op != "call_function" or not isinstance(t, torch._ops.OpOverload):
        return n.op == "call_function"  # getitem
    if t._schema.is_mutable or t.namespace == "_c10d_functional":
        return False
    return torch.Tag.nondeterministic_seeded not in t.tags


def _op_name(n: fx.Node) -> str:
    t = n.target
    return t._schema.name.split("::")[-1] if isinstance(t, torch._ops.OpOverload) else ""


def _kept_by(policy: Any, n: fx.Node) -> bool:
    """Whether a Selective policy saves ``n`` (op groups ``matmul`` and ``attention`` and ATen
    op names)."""
    name = _op_name(n)
    for s in policy.save:
        if s == "matmul" and name in _MATMULS:
            return True
        if s == "attention" and _ATTENTION in name:
            return True
        if s.removeprefix("aten.").split(".")[0] == name:
            return True
    return False


def choose_recompute(gm: fx.GraphModule, policy: Any) -> set[fx.Node]:
    """The saved activations ``policy`` recomputes instead (roots)."""
    import torch_remat

    saved = saved_activations(gm)
    candidates = [r for r in saved if _recomputable(r)]
    if isinstance(policy, torch_remat.Full):
        return set(candidates)
    if isinstance(policy, torch_remat.Selective):
        return {r for r in candidates if not _kept_by(policy, r)}
    if isinstance(policy, torch_remat.Budget):
        total = sum(saved.values())
        limit = policy.limit if isinstance(policy.limit, int) else policy.limit * total
        order = sorted(candidates, key=lambda r: (_op_name(r) in _MATMULS, -saved[r]))
        chosen: set[fx.Node] = set()
        for r in order:
            if _saved_with(gm, saved, chosen) <= limit:
                break
            chosen.add(r)
        return chosen
    raise ValueError(f"the memory pass takes Full, Selective or Budget, not {policy!r}")


def _saved_with(gm: fx.GraphModule, saved: dict[fx.Node, int], chosen: set[fx.Node]) -> int:
    """Saved bytes once ``chosen`` is recomputed (what the recomputation reads is saved)."""
    keep = {r for r in saved if r not in chosen}
    seen: set[fx.Node] = set()

    def need(n: fx.Node) -> None:
        for a in n.all_input_nodes:
            r = root(a)
            if r in seen or phase(r) != "fwd" or r.op != "call_function":
                continue
            seen.add(r)
            if r in keep:
                continue
            if r in chosen or (_recomputable(r) and r not in saved):
                need(r)
            else:
                keep.add(r)

    for r in chosen:
        need(r)
    return sum(node_bytes(r) for r in keep)


def apply_memory_policy(gm: fx.GraphModule, policy: Any) -> str:
    """Recompute what ``policy`` does not save, per micro-batch, before its first backward
    reader; returns a summary (saved bytes before -> after)."""
    before = sum(saved_activations(gm).values())
    chosen = choose_recompute(gm, policy)
    g = gm.graph
    copies: dict[tuple[int, fx.Node], fx.Node] = {}
    saved = saved_activations(gm)

    def must_recompute(a: fx.Node) -> bool:
        r = root(a)
        if phase(r) != "fwd" or r.op != "call_function" or not _recomputable(a):
            return False
        return r in chosen or (r not in saved and _recomputable(r))

    def copy(a: fx.Node, micro: int, before_node: fx.Node) -> fx.Node:
        key = (micro, a)
        if key in copies:
            return copies[key]
        args = fx.node.map_arg(
            (a.args, a.kwargs),
            lambda x: copy(x, micro, before_node) if must_recompute(x) else x,
        )
        with g.inserting_before(before_node):
            target = a.target
            assert callable(target), f"{a.name}: a call_function node has a callable target"
            new = g.call_function(target, args[0], args[1])
        new.meta = {**a.meta, "phase": "bwd", "micro": micro, "recomputed": True}
        copies[key] = new
        return new

    for u in list(g.nodes):
        if phase(u) != "bwd" or u.meta.get("recomputed"):
            continue
        micro = u.meta.get("micro")
        for a in list(u.all_input_nodes):
            if phase(a) == "fwd" and a.meta.get("micro") == micro and must_recompute(a):
                u.replace_input_with(a, copy(a, micro, u))
    after = sum(saved_activations(gm).values())
    gm.graph.lint()
    return (
        f"{type(policy).__name__}: recomputed {len(chosen)} activations, {len(copies)} "
        f"nodes copied; saved activations {before} -> {after} bytes"
    )
