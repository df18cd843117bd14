"""Per-run cost of ``run_sandboxed`` vs a bare ``subprocess.run`` of the same program.

The baseline is what an unsandboxed reward would do: ``python -I -S -c CODE`` with stdin given
and stdout/stderr captured. Ours: ``run_sandboxed`` with ``isolation="namespaces"`` (the
default) and with ``isolation="none"`` (the supervisor process and limits, no namespaces).
Rows interleave the three round by round; the table gives the median wall time per run, the
median CPU time of the child processes per run (less sensitive to other jobs on the machine
than wall time), and the overhead over the bare subprocess in ms and as a ratio. The program
reads one line and prints it doubled, so each run is dominated by process start-up.

    uv run python libs/titan_rl/benchmarks/sandbox_overhead.py --rounds 30
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time

from titan_rl import SandboxLimits, run_sandboxed

CODE = "print(int(input()) * 2)\n"
STDIN = "21\n"
LIMITS = SandboxLimits(wall_time_s=10.0)


def _bare() -> str:
    out = subprocess.run(
        [sys.executable, "-I", "-S", "-c", CODE],
        input=STDIN,
        capture_output=True,
        text=True,
        timeout=LIMITS.wall_time_s,
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
    )
    return out.stdout


def _sandboxed(isolation: str) -> str:
    result = run_sandboxed(CODE, stdin=STDIN, limits=LIMITS, isolation=isolation)
    assert result.status == "ok", result
    return result.stdout


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    if args.rounds < 1:
        raise SystemExit(f"--rounds={args.rounds} must be >= 1")
    engines = {
        "bare subprocess (python -I -S)": _bare,
        'run_sandboxed(isolation="none")': lambda: _sandboxed("none"),
        'run_sandboxed(isolation="namespaces")': lambda: _sandboxed("namespaces"),
    }
    load_before = os.getloadavg()
    for run in engines.values():  # warm-up: page cache, cgroup probe
        assert run() == "42\n"
    wall: dict[str, list[float]] = {name: [] for name in engines}
    cpu: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(args.rounds):
        for name, run in engines.items():
            cpu0, t0 = _children_cpu_s(), time.perf_counter()
            run()
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(_children_cpu_s() - cpu0)
    probe = run_sandboxed(CODE, stdin=STDIN, limits=LIMITS)
    base_wall = statistics.median(wall[next(iter(engines))])
    base_cpu = statistics.median(cpu[next(iter(engines))])
    print(
        f"rounds: {args.rounds}; memory limit applied by: {probe.memory_limit}; "
        f"python {sys.version.split()[0]}; {os.cpu_count()} CPUs"
    )
    print("| run | wall ms (median) | child CPU ms (median) | wall overhead ms | wall ratio |")
    print("|---|---:|---:|---:|---:|")
    for name in engines:
        w, c = statistics.median(wall[name]), statistics.median(cpu[name])
        print(
            f"| {name} | {w * 1e3:.1f} | {c * 1e3:.1f} | {(w - base_wall) * 1e3:+.1f} | "
            f"{w / base_wall:.2f}x |"
        )
    names = list(engines)
    print(
        "child CPU overhead per run: "
        f"none {(statistics.median(cpu[names[1]]) - base_cpu) * 1e3:+.1f} ms, "
        f"namespaces {(statistics.median(cpu[names[2]]) - base_cpu) * 1e3:+.1f} ms"
    )
    load = ", ".join(f"{x:.1f}" for x in load_before + os.getloadavg())
    print(f"load average (1, 5, 15 min) before, after: {load}")


if __name__ == "__main__":
    main()
