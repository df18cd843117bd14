"""Pre-compiled step graphs: written by rank 0, loaded by every rank without tracing.

An artifact is one ``torch.save`` file of plain data (loaded with ``weights_only=True``):
a format version, the fingerprint, and per graph its cache key, the passes applied and the
graph itself as a list of nodes (op, target by name, arguments with node references,
output dtype / shape / stride) plus its tensor constants. Loading rebuilds each
``torch.fx.Graph`` from that list (targets resolved through ``torch.ops``); nothing is
executed or unpickled beyond tensors and builtins.

The fingerprint holds the config fields that shape the graph, the model (class, every
parameter's name, local shape and dtype), the parallel layout (world size, degrees, this
layout's collective groups) and the torch version; a mismatch is refused with one line
naming the first field that differs.
"""

from __future__ import annotations

import dataclasses
import operator
import os
from pathlib import Path
from typing import Any

import torch
from torch import fx

FORMAT = 1
_GRAPH_FIELDS = ("model", "parallel", "remat", "quantize", "lora", "flexshard")
_TRAINING_FIELDS = ("batch_size", "seq_len", "grad_accum", "mixed_precision", "seed")
_COMPILE_FIELDS = ("mode", "passes", "bucket_mb", "memory_budget")


class ArtifactMismatch(ValueError):
    """The artifact was made for another config, model, layout or torch version."""


def fingerprint(step: Any, pm: Any, cfg: Any) -> dict[str, Any]:
    """What a graph depends on, as plain data (compared field by field on load)."""
    asdict = dataclasses.asdict
    config = {k: asdict(getattr(cfg, k)) for k in _GRAPH_FIELDS}
    config["training"] = {k: getattr(cfg.training, k) for k in _TRAINING_FIELDS}
    config["compile"] = {k: getattr(cfg.compile, k) for k in _COMPILE_FIELDS}
    config["data.source"] = cfg.data.source
    sig = step.sig
    model = {
        "class": type(step.model).__qualname__,
        "params": [
            (n, list(p.shape), str(p.dtype)) for n, p in zip(sig.names, sig.params, strict=True)
        ],
    }
    dims = {f.name: getattr(pm.dims, f.name) for f in dataclasses.fields(pm.dims)}
    return {
        "config": _plain(config),
        "model": _plain(model),
        "parallelism": _plain(dims),
        "torch": str(torch.__version__),
    }


def _plain(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_plain(v) for v in x]
    return x if isinstance(x, int | float | str | bool | type(None)) else str(x)


def _first_difference(a: Any, b: Any, path: str) -> str | None:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if k not in a or k not in b:
                return f"{path}.{k}".lstrip(".")
            d = _first_difference(a[k], b[k], f"{path}.{k}")
            if d is not None:
                return d
        return None
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            d = _first_difference(x, y, f"{path}[{i}]")
            if d is not None:
                return d
        return None
    return None if a == b else path.lstrip(".")


def _lookup(d: Any, path: str) -> Any:
    cur = d
    for part in path.replace("[", ".[").split("."):
        if not part:
            continue
        if part.startswith("["):
            idx = int(part[1:-1])
            cur = cur[idx] if isinstance(cur, list) and idx < len(cur) else "<missing>"
        else:
            cur = cur.get(part, "<missing>") if isinstance(cur, dict) else "<missing>"
    return cur


def check_fingerprint(found: dict[str, Any], here: dict[str, Any], path: str) -> None:
    """``ArtifactMismatch`` (one line) naming the first field where the two differ."""
    where = _first_difference(found, here, "")
    if where is None:
        return
    raise ArtifactMismatch(
        f"compile.precompile={path!r} was made for another job: {where} is "
        f"{_lookup(found, where)!r} in the artifact but {_lookup(here, where)!r} here (delete "
        "the file to trace again, or point compile.precompile elsewhere)"
    )


# --- graphs as plain data ---------------------------------------------------------------------


def _encode(a: Any, consts: dict[str, torch.Tensor]) -> Any:
    if isinstance(a, fx.Node):
        return {"node": a.name}
    if isinstance(a, list):
        return {"list": [_encode(x, consts) for x in a]}
    if isinstance(a, tuple):
        return {"tuple": [_encode(x, consts) for x in a]}
    if isinstance(a, torch.dtype):
        return {"dtype": str(a).removeprefix("torch.")}
    if isinstance(a, torch.device):
        return {"device": str(a)}
    if isinstance(a, torch.layout | torch.memory_format):
        return {"enum": str(a).removeprefix("torch.")}
    if isinstance(a, float) and (a != a or a in (float("inf"), float("-inf"))):
        return {"float": repr(a)}
    if isinstance(a, bool | int | float | str | type(None)):
        return a
    raise TypeError(f"cannot store graph argument {a!r} ({type(a).__name__}) in an artifact")


def _decode(a: Any, env: dict[str, fx.Node]) -> Any:
    if not isinstance(a, dict):
        return a
    (kind, v), *_ = a.items()
    if kind == "node":
        return env[v]
    if kind == "list":
        return [_decode(x, env) for x in v]
    if kind == "tuple":
        return tuple(_decode(x, env) for x in v)
    if kind == "dtype":
        return getattr(torch, v)
    if kind == "device":
        return torch.device(v)
    if kind == "enum":
        return getattr(torch, v)
    if kind == "float":
        return float(v)
    raise ValueError(f"unknown graph argument kind {kind!r} in the artifact")


def _target_name(n: fx.Node) -> str:
    t = n.target
    if isinstance(t, torch._ops.OpOverload):
        return f"{t.namespace}::{t._schema.name.split('::')[-1]}.{t._overloadname}"
    if t is operator.getitem:
        return "operator.getitem"
    raise TypeError(f"cannot store graph target {t!r} in an artifact")


def _resolve(name: str) -> Any:
    if name == "operator.getitem":
        return operator.getitem
    ns, rest = name.split("::")
    op, overload = rest.rsplit(".", 1)
    return getattr(getattr(getattr(torch.ops, ns), op), overload)


def _val_spec(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return {"t": [list(v.shape), list(v.stride()), str(v.dtype).removeprefix("torch.")]}
    if isinstance(v, list | tuple):
        return {"seq": [_val_spec(x) for x in v]}
    return None


def _val(spec: Any) -> Any:
    if spec is None:
        return None
    if "seq" in spec:
        return [_val(x) for x in spec["seq"]]
    shape, stride, dtype = spec["t"]
    return torch.empty_strided(shape, stride, dtype=getattr(torch, dtype), device="meta")


def encode_graph(gm: fx.GraphModule) -> dict[str, Any]:
    """``gm`` as plain data (nodes and tensor constants)."""
    consts: dict[str, torch.Tensor] = {}
    nodes = []
    for n in gm.graph.nodes:
        rec: dict[str, Any] = {"name": n.name, "op": n.op}
        if n.op == "call_function":
            rec["target"] = _target_name(n)
        elif n.op == "get_attr":
            rec["target"] = n.target
            consts[n.target] = getattr(gm, n.target).detach().cpu()
        rec["args"] = _encode(tuple(n.args), consts)
        rec["kwargs"] = {k: _encode(v, consts) for k, v in n.kwargs.items()}
        meta = {k: n.meta[k] for k in ("phase", "micro", "recomputed") if k in n.meta}
        rec["meta"] = {**meta, "val": _val_spec(n.meta.get("val"))}
        nodes.append(rec)
    return {"nodes": nodes, "constants": consts}


def decode_graph(data: dict[str, Any], device: torch.device) -> fx.GraphModule:
    """The graph module ``encode_graph`` stored (constants moved to ``device``)."""
    g = fx.Graph()
    env: dict[str, fx.Node] = {}
    root = torch.nn.Module()
    for name, t in data["constants"].items():
        setattr(root, name, t.to(device))
    for rec in data["nodes"]:
        args = _decode(rec["args"], env)
        kwargs = {k: _decode(v, env) for k, v in rec["kwargs"].items()}
        if rec["op"] == "placeholder":
            node = g.placeholder(rec["name"])
        elif rec["op"] == "get_attr":
            node = g.get_attr(rec["target"])
        elif rec["op"] == "call_function":
            node = g.call_function(_resolve(rec["target"]), args, kwargs)
        elif rec["op"] == "output":
            node = g.output(args[0])
        else:
            raise ValueError(f"unknown node kind {rec['op']!r} in the artifact")
        node.name = rec["name"]
        meta = dict(rec["meta"])
        node.meta.update({k: v for k, v in meta.items() if k != "val"})
        node.meta["val"] = _val(meta.get("val"))
        env[rec["name"]] = node
    return fx.GraphModule(root, g)


# --- files ------------------------------------------------------------------------------------


def save_artifact(path: str | Path, step: Any, fp: dict[str, Any]) -> None:
    """Write ``step``'s graphs with fingerprint ``fp`` (atomically: a temp file renamed)."""
    graphs = {
        key: {"graph": encode_graph(gm), "passes": list(step.stats.passes)}
        for key, gm in step.graphs.items()
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + f".tmp{os.getpid()}")
    torch.save({"format": FORMAT, "fingerprint": fp, "graphs": graphs}, tmp)
    tmp.replace(path)


def load_artifact(path: str | Path, fp: dict[str, Any]) -> dict[str, Any]:
    """The graphs of the artifact at ``path`` (cache key -> record), its fingerprint checked."""
    data = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ArtifactMismatch(
            f"compile.precompile={str(path)!r} is not a graph artifact of format {FORMAT}"
        )
    check_fingerprint(data["fingerprint"], fp, str(path))
    return data["graphs"]


def attach_precompiled(step: Any, pm: Any, cfg: Any) -> None:
    """Load ``compile.precompile`` into ``step`` when it exists (no tracing for its keys);
    otherwise have rank 0 write it once its first graph is traced."""
    path = Path(cfg.compile.precompile)
    fp = fingerprint(step, pm, cfg)
    if path.exists():
        from titan_train.errors import ConfigError

        try:
            graphs = load_artifact(path, fp)
        except ArtifactMismatch as e:
            raise ConfigError(str(e)) from None
        device = step.sig.params[0].device
        for key, rec in graphs.items():
            step.install(key, decode_graph(rec["graph"], device), rec["passes"])
        return
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0:
        step.on_new_graph = lambda: save_artifact(path, step, fp)
