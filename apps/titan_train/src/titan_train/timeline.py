"""Step phases per rank and the timeline across ranks (``<run>/profiling/timeline.png``).

At each log step every rank appends the mean seconds per step of each phase since its
previous log line (``StepPhases.read``: data, forward, backward, optimizer, collectives,
validation, checkpoint) to ``<run>/profiling/phases_rank<r>.jsonl``: no collective, each rank
writes its own file. At the end of a run rank 0 draws ``timeline.png``: one lane per rank,
seconds on the x axis, each log interval laid out as its phases in the order they run. A rank
that computes longer, or waits longer in its collectives, stands out at a glance.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["PHASE_ORDER", "PhaseLog", "draw_timeline"]

PHASE_ORDER = (
    "data",
    "forward",
    "backward",
    "forward_backward",
    "optimizer",
    "collectives",
    "validation",
    "checkpoint",
)
"""The phases in the order a step runs them (unknown phases are drawn after these)."""


class PhaseLog:
    """This rank's ``phases_rank<r>.jsonl``; a resumed run keeps the lines up to its step."""

    def __init__(self, out_dir: Path, rank: int, resumed_step: int | None) -> None:
        self.path = out_dir / f"phases_rank{rank}.jsonl"
        kept = []
        if resumed_step is not None and self.path.exists():
            for line in self.path.read_text().splitlines():
                try:
                    if json.loads(line)["step"] <= resumed_step:
                        kept.append(line)
                except (ValueError, KeyError, TypeError):
                    continue
        out_dir.mkdir(parents=True, exist_ok=True)
        self.path.write_text("".join(f"{line}\n" for line in kept))

    def add(self, step: int, steps: int, phases: dict[str, float]) -> None:
        """The interval ending at ``step``: ``steps`` steps, ``phases`` (``<phase>_s`` per step)."""
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, "steps": steps, **phases}) + "\n")


def _read(path: Path) -> list[dict]:
    rows = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and "step" in row:
            rows.append(row)
    return rows


def draw_timeline(out_dir: Path) -> Path | None:
    """Draw ``out_dir/timeline.png`` from every ``phases_rank<r>.jsonl`` there (None: none)."""
    files = {int(p.stem.removeprefix("phases_rank")): p for p in out_dir.glob("phases_rank*.jsonl")}
    lanes = {rank: _read(path) for rank, path in sorted(files.items())}
    if not any(lanes.values()):
        return None
    from matplotlib import colormaps
    from matplotlib.figure import Figure

    names = list(PHASE_ORDER)
    for rows in lanes.values():
        for row in rows:
            names += [k[:-2] for k in row if k.endswith("_s") and k[:-2] not in names]
    colors = {n: colormaps["tab10"](i % 10) for i, n in enumerate(names)}
    spans: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for rank, rows in lanes.items():
        t = 0.0
        for row in rows:
            for name in names:
                width = float(row.get(f"{name}_s", 0.0)) * int(row.get("steps", 1))
                if width > 0:
                    spans.setdefault((rank, name), []).append((t, width))
                    t += width
    fig = Figure(figsize=(9, 1.2 + 0.5 * len(lanes)))  # not pyplot: no process-wide state
    ax = fig.subplots()
    shown = set()
    for (rank, name), bars in spans.items():
        label = None if name in shown else name
        shown.add(name)
        ax.broken_barh(bars, (rank - 0.4, 0.8), facecolors=colors[name], label=label)
    ax.set_yticks(list(lanes), [f"rank {r}" for r in lanes])
    ax.invert_yaxis()
    ax.set_xlabel("seconds (the phases of the logged steps, in order)")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=min(len(shown), 8), fontsize=8)
    fig.tight_layout()
    path = out_dir / "timeline.png"
    tmp = out_dir / "timeline.png.tmp"
    fig.savefig(tmp, dpi=120, format="png")
    tmp.replace(path)
    return path
