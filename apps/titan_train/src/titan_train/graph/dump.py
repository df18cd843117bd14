"""The step graph as readable text, and the diff of two such texts.

``dump_step`` writes, per traced graph, ``<name>.txt``: a header (the cache key, the passes
applied and what each did, nodes per phase, collectives, estimated peak of graph-made
storage, saved activation bytes) and one line per node::

    %mm_3 = aten.mm.default(%view_7, %t_1)   # fwd[0] f32[32, 64]  +8.0 KiB  live 1.2 MiB

(its phase and micro-batch, output dtype and shape, the bytes its storage adds, the
estimated live bytes after it). ``<name>.traced.py`` is the graph's Python code as traced,
before any pass, and ``<name>.passes.diff`` the diff from it to the code after the passes.
``python -m titan_train.graph.dump A.txt B.txt`` diffs two dumps (two configs' graphs),
ignoring the memory columns.
"""

from __future__ import annotations

import difflib
import hashlib
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import fx

from titan_train.graph.collectives import count_collectives
from titan_train.graph.memory import live_bytes, node_bytes, saved_activations


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _arg(a: Any) -> str:
    if isinstance(a, fx.Node):
        return f"%{a.name}"
    if isinstance(a, list | tuple):
        inner = ", ".join(_arg(x) for x in a)
        return f"[{inner}]"
    return repr(a)


def _shape(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        dt = str(v.dtype).removeprefix("torch.")
        short = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "int64": "i64"}
        return f"{short.get(dt, dt)}{list(v.shape)}"
    if isinstance(v, list | tuple):
        return "(" + ", ".join(_shape(x) for x in v) + ")"
    return type(v).__name__


def graph_text(gm: fx.GraphModule, applied: Sequence[tuple[str, str]] = (), key: str = "") -> str:
    """The readable text of ``gm`` (see the module doc)."""
    live = live_bytes(gm)
    phases: dict[str, int] = {}
    for n in gm.graph.nodes:
        p = n.meta.get("phase") or n.op
        phases[p] = phases.get(p, 0) + 1
    saved = sum(saved_activations(gm).values())
    lines = [
        f"# step graph {key}",
        "# passes: " + ("; ".join(f"{p} ({what})" for p, what in applied) or "none"),
        "# nodes: " + ", ".join(f"{k} {v}" for k, v in phases.items()),
        f"# collectives: {count_collectives(gm) or 'none'}",
        f"# estimated peak of graph-made storage {_size(max(live.values(), default=0))}, "
        f"saved activations {_size(saved)}",
        "",
    ]
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            body = f"%{n.name} = input"
        elif n.op == "output":
            body = f"return {_arg(n.args[0])}"
        else:
            target = n.target if n.op == "get_attr" else _target(n)
            args = ", ".join(
                [_arg(a) for a in n.args] + [f"{k}={_arg(v)}" for k, v in n.kwargs.items()]
            )
            body = f"%{n.name} = {target}({args})"
        where = n.meta.get("phase") or ""
        if "micro" in n.meta and where in ("fwd", "bwd"):
            where += f"[{n.meta['micro']}]"
        if n.meta.get("recomputed"):
            where += " recomputed"
        cols = (
            f"{where} {_shape(n.meta.get('val'))}  +{_size(node_bytes(n))}  live {_size(live[n])}"
        )
        lines.append(f"{body}   # {cols}")
    return "\n".join(lines) + "\n"


def _target(n: fx.Node) -> str:
    t = n.target
    if isinstance(t, torch._ops.OpOverload):
        return f"{t.namespace}.{t._schema.name.split('::')[-1]}.{t._overloadname}"
    return getattr(t, "__name__", str(t))


def dump_name(key: str) -> str:
    """File stem of the graph of cache key ``key``."""
    return "step_" + hashlib.sha256(key.encode()).hexdigest()[:12]


def dump_step(
    folder: Path,
    key: str,
    gm: fx.GraphModule,
    applied: Sequence[tuple[str, str]],
    sig: Any,
    *,
    before: str | None = None,
) -> Path:
    """Write the text of ``gm`` (and its traced code and the passes' diff) to ``folder``;
    returns the text file."""
    import torch.distributed as dist

    folder.mkdir(parents=True, exist_ok=True)
    stem = dump_name(key)
    if dist.is_initialized() and dist.get_world_size() > 1:
        stem += f".rank{dist.get_rank()}"
    path = folder / f"{stem}.txt"
    path.write_text(graph_text(gm, applied, key))
    after = gm.graph.python_code("self").src
    if before is not None:
        (folder / f"{stem}.traced.py").write_text(before)
        diff = difflib.unified_diff(
            before.splitlines(), after.splitlines(), "traced", "after passes", lineterm=""
        )
        (folder / f"{stem}.passes.diff").write_text("\n".join(diff) + "\n")
    return path


_COLUMNS = re.compile(r"\s+#.*$")


def diff_dumps(a: str, b: str, name_a: str = "a", name_b: str = "b") -> str:
    """Unified diff of two ``graph_text`` dumps, node lines only (memory columns dropped)."""

    def body(text: str) -> list[str]:
        return [_COLUMNS.sub("", x) for x in text.splitlines() if x and not x.startswith("#")]

    return "\n".join(difflib.unified_diff(body(a), body(b), name_a, name_b, lineterm=""))


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m titan_train.graph.dump A.txt B.txt``: print the diff of two dumps."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2:
        print("usage: python -m titan_train.graph.dump A.txt B.txt", file=sys.stderr)
        return 2
    a, b = (Path(x).read_text() for x in args)
    out = diff_dumps(a, b, args[0], args[1])
    print(out if out else "the graphs are the same")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
