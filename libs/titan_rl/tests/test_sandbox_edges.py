"""The sandbox's API edges (issue 39): input that is not text, limits that are not numbers, a
caller killed with kill -9, a memory bomb on a loaded host. Each test is an adversary's
reproduction; every one of them failed before the fix.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
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
# files on the host


def _files_holding(temp: Path, token: str) -> list[Path]:
    """The run files under ``temp`` whose text holds ``token`` (the code, its output)."""
    found = []
    for path in temp.rglob("*"):
        try:
            if path.is_file() and token in path.read_text(errors="replace"):
                found.append(path)
        except OSError:  # removed while we looked
            continue
    return found


def test_files_of_a_caller_killed_with_kill_9_are_removed_by_the_next_call(tmp_path):
    token = f"titan-rl-{secrets.token_hex(8)}"
    code = f"print({token!r}, flush=True)\nimport time\ntime.sleep(30)\n"
    script = f"sb.run_sandboxed({code!r}, limits=sb.SandboxLimits(wall_time_s=30))"
    caller = subprocess.Popen(_caller(script), env=_caller_env(tmp_path))
    try:
        deadline = time.monotonic() + 10
        while len(_files_holding(tmp_path, token)) < 2:  # the code and its output
            assert caller.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        caller.send_signal(signal.SIGKILL)
        caller.wait()
    assert _files_holding(tmp_path, token)  # a killed caller cleans nothing up itself
    next_call = subprocess.run(
        _caller("print(sb.run_sandboxed('print(1)').stdout, end='')"),
        env=_caller_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert (next_call.returncode, next_call.stdout) == (0, "1\n"), next_call.stderr
    assert _files_holding(tmp_path, token) == []
    assert list(tmp_path.iterdir()) == []  # and the next caller's own folder went at its exit


def test_the_sweep_removes_only_our_folders_of_processes_that_are_gone(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    namespace = sandbox._pid_namespace()
    live = subprocess.Popen(["sleep", "30"])
    gone = subprocess.Popen(["true"])
    gone.wait()
    try:
        start = sandbox._start_time(live.pid)
        name = "titan_rl_sandbox_{}_{}_{}_abcd_123"
        folders = {
            "live": name.format(namespace, live.pid, start),
            "gone": name.format(namespace, gone.pid, 1),
            "pid_reused": name.format(namespace, live.pid, start + 1),
            "other_pid_namespace": name.format(namespace + 1, gone.pid, 1),
            "other_pattern": name.format(namespace, gone.pid, 1) + ".bak",
            "old_pattern": "titan_rl_sandbox_x1y2z3w4",
            "other_owner": name.format(namespace, gone.pid, 2),
        }
        for folder in folders.values():
            (tmp_path / folder).mkdir()
            (tmp_path / folder / "main.py").write_text("secret")
        if os.geteuid() == 0:
            os.chown(tmp_path / folders["other_owner"], 65534, 65534)
        else:
            folders.pop("other_owner")  # only root can make another user's folder
        (tmp_path / "target").mkdir()
        (tmp_path / "target" / "keep.txt").write_text("keep")
        link = name.format(namespace, gone.pid, 3)
        (tmp_path / link).symlink_to(tmp_path / "target")
        assert run_sandboxed("print(3)", limits=LIMITS).stdout == "3\n"
        left = {p.name for p in tmp_path.iterdir()}
        removed = {"gone", "pid_reused"}
        assert {k for k, v in folders.items() if v not in left} == removed
        assert link in left and (tmp_path / "target" / "keep.txt").read_text() == "keep"
        (own,) = left - set(folders.values()) - {link, "target"}  # this process's: alive
        assert own.startswith(f"titan_rl_sandbox_{namespace}_{os.getpid()}_")
    finally:
        live.kill()
        live.wait()


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
