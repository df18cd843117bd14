"""Specification of the distributed test harness itself."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from titan_testing import DistributedTestError, DistributedTimeoutError, run_distributed


def _all_reduce_rank_plus_one() -> tuple[int, int, list[float]]:
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), t.tolist()


def _raise_on_rank_one(message: str) -> int:
    if dist.get_rank() == 1:
        raise RuntimeError(message)
    # The healthy rank blocks in a collective its failed peer never joins: the harness must
    # still end the test quickly.
    dist.barrier()
    return dist.get_rank()


def _hang_after_spawning_grandchild(pid_file: str) -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with open(f"{pid_file}.{dist.get_rank()}", "w") as f:
        f.write(f"{os.getpid()} {child.pid}")
    time.sleep(600)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers signal 0; it is dead for our purposes.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_two_rank_all_reduce_returns_every_ranks_value():
    results = run_distributed(_all_reduce_rank_plus_one, 2)
    assert results == [(0, 2, [3.0]), (1, 2, [3.0])]


def test_four_ranks_on_two_cores():
    results = run_distributed(_all_reduce_rank_plus_one, 4)
    assert [r[0] for r in results] == [0, 1, 2, 3]
    assert all(r[2] == [10.0] for r in results)


def test_raising_rank_fails_with_its_message_and_leaves_no_process():
    start = time.monotonic()
    with pytest.raises(DistributedTestError, match="boom from rank one") as info:
        run_distributed(_raise_on_rank_one, 2, "boom from rank one", timeout=60)
    assert time.monotonic() - start < 30
    assert 1 in info.value.failures and "RuntimeError" in info.value.failures[1]
    assert not any(_pid_alive(p) for p in info.value.pids)


def test_hanging_rank_is_killed_at_timeout_with_grandchildren(tmp_path):
    pid_file = str(tmp_path / "pids")
    start = time.monotonic()
    with pytest.raises(DistributedTimeoutError, match="still running") as info:
        run_distributed(_hang_after_spawning_grandchild, 2, pid_file, timeout=15)
    elapsed = time.monotonic() - start
    assert elapsed < 30, elapsed
    assert "_hang_after_spawning_grandchild" in str(info.value)  # stacks at timeout
    pids = [int(p) for r in range(2) for p in Path(f"{pid_file}.{r}").read_text().split()]
    time.sleep(0.2)
    assert not any(_pid_alive(p) for p in pids)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_bad_world_size_is_rejected_before_spawning(bad):
    with pytest.raises(ValueError, match="world_size"):
        run_distributed(_all_reduce_rank_plus_one, bad)


def test_local_function_is_rejected_before_spawning():
    def local_fn() -> None:
        pass

    with pytest.raises(TypeError, match="local function"):
        run_distributed(local_fn, 2)
    with pytest.raises(TypeError, match="lambda"):
        run_distributed(lambda: None, 2)


def test_unpicklable_argument_is_rejected_before_spawning():
    with pytest.raises(TypeError, match="positional argument 0"):
        run_distributed(_raise_on_rank_one, 2, lambda: None)


_SCRIPT = """
import torch, torch.distributed as dist
from titan_testing import run_distributed

def rank_sum():
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()

if __name__ == "__main__":
    print(run_distributed(rank_sum, 2, timeout=60))
"""


def test_script_calling_the_harness_from_main_does_not_respawn_itself(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(_SCRIPT)
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[2.0, 2.0]"


_KILLED_PARENT_SCRIPT = """
import os, sys, time
import torch.distributed as dist
from titan_testing import run_distributed

def hang(pid_file):
    with open(f"{pid_file}.{dist.get_rank()}", "w") as f:
        f.write(str(os.getpid()))
    time.sleep(600)

if __name__ == "__main__":
    run_distributed(hang, 2, sys.argv[1], timeout=600)
"""


def test_ranks_exit_when_the_harness_process_is_killed_without_cleanup(tmp_path):
    # `timeout pytest ...` (SIGTERM) or SIGKILL ends the harness without its `finally`; the
    # ranks live in their own sessions, so they must notice on their own.
    script, pid_file = tmp_path / "script.py", str(tmp_path / "pids")
    script.write_text(_KILLED_PARENT_SCRIPT)
    parent = subprocess.Popen([sys.executable, str(script), pid_file], cwd=tmp_path)
    deadline = time.monotonic() + 90
    while not all(Path(f"{pid_file}.{r}").exists() for r in range(2)):
        assert time.monotonic() < deadline and parent.poll() is None
        time.sleep(0.2)
    ranks = [int(Path(f"{pid_file}.{r}").read_text()) for r in range(2)]
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 10
    while any(_pid_alive(p) for p in ranks) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_pid_alive(p) for p in ranks)


_UNGUARDED_SCRIPT = """
import torch.distributed as dist
from titan_testing import run_distributed

def rank():
    return dist.get_rank()

print(run_distributed(rank, 2, timeout=60))
"""


def test_a_script_calling_the_harness_at_import_fails_instead_of_spawning_recursively(tmp_path):
    # Each rank imports the function's module again: without a main guard, every rank would
    # call the harness and spawn ranks of its own, without end.
    script = tmp_path / "script.py"
    script.write_text(_UNGUARDED_SCRIPT)
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert out.returncode != 0
    assert "run_distributed called inside rank" in out.stderr
    assert '__name__ == "__main__"' in out.stderr
