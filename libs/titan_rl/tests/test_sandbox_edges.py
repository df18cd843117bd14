"""The sandbox's API edges (issue 39): input that is not text, limits that are not numbers, a
caller killed with kill -9, a memory bomb on a loaded host. Each test is an adversary's
reproduction; every one of them failed before the fix.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from titan_rl import CodeToolEnv, Message, SandboxLimits, code_reward, run_sandboxed, sandbox

LIMITS = SandboxLimits(wall_time_s=3.0)
_LOADER = (  # the sandbox module alone (no torch) as ``sb``: a caller that starts in ~50 ms
    "import importlib.util, sys\n"
    f"spec = importlib.util.spec_from_file_location('sb', {sandbox.__file__!r})\n"
    "sb = importlib.util.module_from_spec(spec)\n"
    "sys.modules['sb'] = sb\n"
    "spec.loader.exec_module(sb)\n"
)


def _caller(script: str) -> list[str]:
    """Command line of a fresh interpreter that runs ``script`` with ``sb``."""
    return [os.path.realpath(sys.executable), "-c", _LOADER + script]


def _caller_env(temp: Path) -> dict[str, str]:
    return {"PATH": os.environ["PATH"], "TMPDIR": str(temp)}


# ---------------------------------------------------------------------------------------------
# text that UTF-8 cannot hold


def test_code_or_stdin_with_a_lone_surrogate_is_an_error_result_not_an_exception():
    cases = {"code": ("print('\ud800')", ""), "stdin": ("print(input())", "x\udcff\n")}
    for field, (code, stdin) in cases.items():
        result = run_sandboxed(code, stdin=stdin, limits=LIMITS)
        assert (result.status, result.returncode, result.stdout) == ("error", None, "")
        assert f"{field} is not valid UTF-8 text" in result.stderr
        assert "nothing ran" in result.stderr
    reward = code_reward("print('\ud800')", [("", "")], limits=LIMITS)
    assert (reward.score, reward.status) == (0.0, "error")


def test_code_tool_env_replies_with_the_error_to_a_lone_surrogate():
    env = CodeToolEnv([("What is 6*7?", "42")], limits=LIMITS)
    env.reset(0)
    step = env.step(Message("assistant", "```python\nprint('\ud800')\n```"))
    assert (step.done, step.info) == (False, {"tool": "error"})
    (reply,) = step.messages
    assert reply.role == "tool" and "not valid UTF-8 text" in reply.content
    reply.content.encode()  # the reply itself is text the tokenizer can take


# ---------------------------------------------------------------------------------------------
# limits


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("wall_time_s", float("inf")),
        ("wall_time_s", float("nan")),
        ("wall_time_s", 1e300),
        ("wall_time_s", "5"),
        ("memory_bytes", float("inf")),
        ("memory_bytes", 2**64),
        ("memory_bytes", 512.5 * 2**20),
        ("output_bytes", 1 << 62),
        ("output_bytes", True),
        ("max_processes", 10**9),
        ("disk_bytes", float("nan")),
    ],
)
def test_limits_outside_their_range_are_one_value_error_at_construction(field, value):
    with pytest.raises(ValueError) as error:
        SandboxLimits(**{field: value})
    message = str(error.value)
    assert message.startswith(f"SandboxLimits.{field}={value!r} must be ")
    assert ("finite number in (" if field == "wall_time_s" else "an int in [") in message


def test_limits_at_the_ends_of_their_ranges_run():
    SandboxLimits(wall_time_s=sandbox._MAX_WALL_TIME_S, memory_bytes=sandbox._MAX_BYTES)
    SandboxLimits(max_processes=sandbox._MAX_PROCESSES, output_bytes=1024, disk_bytes=1 << 20)
    result = run_sandboxed("print(2)", limits=SandboxLimits(wall_time_s=1, memory_bytes=2**40))
    assert (result.status, result.stdout) == ("ok", "2\n")


# ---------------------------------------------------------------------------------------------
# the memory status on a loaded host


def test_memory_status_comes_from_the_oom_kill_count_even_under_load():
    """Two busy loops load the host; the OOM kill still decides the status, also when the run
    then runs out of time (a bomb's child is killed, the parent sleeps on)."""
    limits = SandboxLimits(wall_time_s=2.0, memory_bytes=64 * 2**20)
    bomb = "chunks = []\nwhile True:\n    chunks.append(bytearray(16 * 2**20))\n"
    child_bomb = (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    chunks = []\n"
        "    while True:\n"
        "        chunks.append(bytearray(16 * 2**20))\n"
        "time.sleep(60)\n"
    )
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        results = [run_sandboxed(code, limits=limits) for code in (bomb, child_bomb)]
    finally:
        for process in busy:
            process.kill()
            process.wait()
    if results[0].memory_limit == "rlimit":
        pytest.skip("no writable cgroup on this machine: no OOM kill count to read")
    assert [r.status for r in results] == ["memory", "memory"]
    assert results[1].wall_s >= limits.wall_time_s  # it did run into the wall limit
