"""Verifiable rewards: exact match, boxed-answer math, and code run in a sandboxed subprocess.

Every reward returns a ``RewardResult`` whose ``status`` says why it scored what it did, so a
run can tell "the model is wrong" from "the answer could not be read" from "the code crashed".
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

_INTEGER = re.compile(r"[+-]?\d+")


@dataclass(frozen=True, slots=True)
class RewardResult:
    """A scalar reward and the reason for it."""

    score: float
    status: str
    """``correct``, ``wrong``, ``unparseable``, ``truncated``, ``error`` (the reward function
    raised), or a sandbox outcome: ``timeout``, ``memory``, ``crashed``, ``output_limit``."""
    detail: str = ""


def exact_match_reward(completion: str, answer: str) -> RewardResult:
    """1 when ``completion`` (stripped) is exactly ``answer``; non-integers are ``unparseable``."""
    text = completion.strip()
    if text == answer.strip():
        return RewardResult(1.0, "correct")
    if not _INTEGER.fullmatch(text):
        return RewardResult(0.0, "unparseable", f"not an integer: {text[:40]!r}")
    return RewardResult(0.0, "wrong", f"{text} != {answer}")


def last_boxed(text: str) -> str | None:
    r"""Content of the last ``\boxed{...}`` in ``text`` (nested braces allowed), else ``None``."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None  # unbalanced: the answer was cut off


def boxed_math_reward(completion: str, answer: str) -> RewardResult:
    r"""1 when the last ``\boxed{}`` equals ``answer`` (as numbers when both parse, else as text).

    No box, or an unbalanced one, is ``unparseable`` (reported apart from ``wrong``).
    """
    boxed = last_boxed(completion)
    if boxed is None:
        return RewardResult(0.0, "unparseable", "no complete \\boxed{...}")
    got, want = _normalise(boxed), _normalise(answer)
    got_num, want_num = _as_number(got), _as_number(want)
    same = got_num == want_num if got_num is not None and want_num is not None else got == want
    return RewardResult(1.0, "correct") if same else RewardResult(0.0, "wrong", f"{got} != {want}")


def _normalise(text: str) -> str:
    text = text.strip().strip("$").replace(" ", "").replace("\\!", "").replace(",", "")
    text = re.sub(r"\\(?:text|mathrm)\{([^}]*)\}", r"\1", text)
    return re.sub(r"\\[dt]?frac\{([^}]*)\}\{([^}]*)\}", r"\1/\2", text)


def _as_number(text: str) -> Fraction | None:
    try:
        return Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None


# ---------------------------------------------------------------------------------------------
# Sandboxed code execution


@dataclass(frozen=True, kw_only=True, slots=True)
class SandboxLimits:
    """Resource limits of one sandboxed run."""

    wall_time_s: float = 5.0
    """Wall-clock limit; the whole process group is killed when it passes."""
    memory_bytes: int = 256 * 2**20
    """Address-space limit (``RLIMIT_AS``) of the child."""
    output_bytes: int = 1 << 20
    """Largest stdout/stderr file the child may write (``RLIMIT_FSIZE``)."""

    def __post_init__(self) -> None:
        if not self.wall_time_s > 0:
            raise ValueError(f"SandboxLimits.wall_time_s={self.wall_time_s!r} must be > 0")
        if self.memory_bytes < 32 * 2**20:
            raise ValueError(
                f"SandboxLimits.memory_bytes={self.memory_bytes} must be >= 32 MiB "
                "(the Python interpreter itself needs about 20 MiB)"
            )
        if self.output_bytes < 1024:
            raise ValueError(f"SandboxLimits.output_bytes={self.output_bytes} must be >= 1024")


@dataclass(frozen=True, slots=True)
class SandboxResult:
    """What a sandboxed run did."""

    status: str
    """``ok`` (exit 0), ``error`` (non-zero exit), ``timeout``, ``memory``, ``output_limit``,
    ``crashed`` (killed by a signal)."""
    returncode: int | None
    stdout: str
    stderr: str
    wall_s: float
    network_isolation: str
    """``namespace`` (empty network namespace: no interface but loopback) or ``socket_guard``
    (socket creation raises in the child; weaker, used where namespaces are not allowed)."""


# Runs in the child before the untrusted code: limits, then no network, then the code. Kept as
# source text so the child needs nothing but the interpreter (-I -S: no site, no user paths).
_RUNNER = r"""
import ctypes, resource, socket, sys
mem, fsize, cpu = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
isolation = "socket_guard"
libc = ctypes.CDLL(None, use_errno=True)
for flags in (0x40000000, 0x40000000 | 0x10000000):  # CLONE_NEWNET, + CLONE_NEWUSER
    if libc.unshare(flags) == 0:
        isolation = "namespace"
        break
def _refuse(*args, **kwargs):
    raise PermissionError("network access is disabled in the sandbox")
socket.socket = socket.create_connection = socket.getaddrinfo = socket.socketpair = _refuse
sys.stderr.write("__sandbox_network__=" + isolation + "\n")
sys.stderr.flush()
del ctypes, resource, libc, flags, _refuse
source = open(sys.argv[4]).read()
sys.argv = sys.argv[4:]
exec(compile(source, "<sandboxed>", "exec"), {"__name__": "__main__"})
"""


def run_sandboxed(
    code: str, *, stdin: str = "", limits: SandboxLimits | None = None
) -> SandboxResult:
    """Run untrusted Python ``code`` in a limited subprocess; always returns within the limit.

    Wall time: the child runs in its own session and the whole group is SIGKILLed at the limit.
    Memory: ``RLIMIT_AS``. Network: an empty network namespace where the kernel allows one
    (``unshare(CLONE_NEWNET)``, as root or through a user namespace), plus socket creation
    refused inside the interpreter. The child sees no environment variables but ``PATH``.
    """
    limits = limits or SandboxLimits()
    with tempfile.TemporaryDirectory(prefix="titan_rl_sandbox_") as tmp:
        folder = Path(tmp)
        (folder / "runner.py").write_text(_RUNNER)
        (folder / "main.py").write_text(code)
        (folder / "stdin.txt").write_text(stdin)
        args = [
            sys.executable,
            "-I",
            "-S",
            str(folder / "runner.py"),
            str(limits.memory_bytes),
            str(limits.output_bytes),
            str(int(limits.wall_time_s) + 1),
            str(folder / "main.py"),
        ]
        with (
            open(folder / "stdin.txt") as fin,
            open(folder / "stdout.txt", "w") as fout,
            open(folder / "stderr.txt", "w") as ferr,
        ):
            start = time.perf_counter()
            proc = subprocess.Popen(
                args,
                stdin=fin,
                stdout=fout,
                stderr=ferr,
                cwd=tmp,
                start_new_session=True,
                env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
            )
            timed_out = False
            try:
                proc.wait(timeout=limits.wall_time_s)
            except subprocess.TimeoutExpired:
                timed_out = True
                _kill_group(proc)
            wall = time.perf_counter() - start
        stdout = _read_capped(folder / "stdout.txt", limits.output_bytes)
        stderr = _read_capped(folder / "stderr.txt", limits.output_bytes)
    isolation = "socket_guard"
    marker = re.match(r"__sandbox_network__=(\w+)\n", stderr)
    if marker:
        isolation, stderr = marker.group(1), stderr[marker.end() :]
    rc = proc.returncode
    if timed_out or rc == -signal.SIGXCPU:
        status = "timeout"
    elif rc == -signal.SIGXFSZ:
        status = "output_limit"
    elif "MemoryError" in stderr:
        status = "memory"
    elif rc is not None and rc < 0:
        status = "crashed"
    else:
        status = "ok" if rc == 0 else "error"
    return SandboxResult(status, None if timed_out else rc, stdout, stderr, wall, isolation)


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _read_capped(path: Path, limit: int) -> str:
    with open(path, "rb") as f:
        return f.read(limit).decode("utf-8", errors="replace")


def code_reward(
    code: str, tests: list[tuple[str, str]], *, limits: SandboxLimits | None = None
) -> RewardResult:
    """Fraction of ``(stdin, expected stdout)`` tests the program passes, each run sandboxed.

    A test passes when the run exits 0 and its stdout, stripped, equals the expected one. The
    status is ``correct`` (all pass), ``wrong``, or the first failing run's sandbox status.
    """
    if not tests:
        raise ValueError("tests must hold at least one (stdin, expected_stdout) pair")
    passed, first_failure = 0, None
    for stdin, expected in tests:
        result = run_sandboxed(code, stdin=stdin, limits=limits)
        if result.status == "ok" and result.stdout.strip() == expected.strip():
            passed += 1
        elif first_failure is None:
            first_failure = result
    if first_failure is None:
        return RewardResult(1.0, "correct")
    status = "wrong" if first_failure.status == "ok" else first_failure.status
    return RewardResult(passed / len(tests), status, first_failure.stderr[-200:])
