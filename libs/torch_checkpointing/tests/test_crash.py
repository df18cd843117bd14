"""Kill -9 of a training process (and its writer) at random points during 20 saves."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from torch_checkpointing import CheckpointManager

WRITER = textwrap.dedent(
    """
    import sys
    import time
    import torch
    from torch_checkpointing import CheckpointManager

    def state_for(step):
        g = torch.Generator().manual_seed(step)
        return {
            "model": {"w": torch.randn(1024, 768, generator=g), "b": torch.full((999,), step * 1.0)},
            "optim": {"m": torch.randn(512, 768, generator=g).bfloat16(), "n": step},
            "meta": {"step": step},
        }

    root, mode, last = sys.argv[1], sys.argv[2], int(sys.argv[3])
    mgr = CheckpointManager(root, async_mode=mode, keep_last=3)
    start = mgr.latest_step()
    if start is not None:  # resume: continues the killed run's lineage (and its retention)
        want = state_for(start)
        got = {
            "model": {k: torch.empty_like(v) for k, v in want["model"].items()},
            "optim": {"m": torch.empty_like(want["optim"]["m"]), "n": -1},
            "meta": {},
        }
        assert mgr.load(got) == start and torch.equal(got["model"]["w"], want["model"]["w"])
    for step in range((start or 0) + 1, last + 1):
        mgr.save(step, state_for(step))
        print("saved", step, flush=True)
        time.sleep(0.05)  # the training step between two saves: background writes overlap it
    mgr.close()
    print("done", flush=True)
    """
)


def state_for(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {
        "model": {"w": torch.randn(1024, 768, generator=g), "b": torch.full((999,), step * 1.0)},
        "optim": {"m": torch.randn(512, 768, generator=g).bfloat16(), "n": step},
        "meta": {"step": step},
    }


def empty_like_state(step_state: dict) -> dict:
    return {
        "model": {k: torch.empty_like(v) for k, v in step_state["model"].items()},
        "optim": {"m": torch.empty_like(step_state["optim"]["m"]), "n": -1},
        "meta": {},
    }


def check_every_complete_step_loads_exactly(root) -> int | None:
    mgr = CheckpointManager(root, read_only=True)
    latest = mgr.latest_step()
    for step in mgr.steps():
        want = state_for(step)
        got = empty_like_state(want)
        assert mgr.load(got, step) == step
        for item in ("model", "optim"):
            for k, v in want[item].items():
                if isinstance(v, torch.Tensor):
                    assert torch.equal(got[item][k], v), (step, item, k)
                else:
                    assert got[item][k] == v
        assert got["meta"] == {"step": step}
    return latest


@pytest.mark.slow
def test_kill_minus_nine_at_random_points_never_leaves_a_bad_latest(tmp_path):
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    root = tmp_path / "ckpt"
    rng = random.Random(8)
    kills = 0
    incomplete_seen = 0
    latest = None
    for round_ in range(12):
        mode = ("process", "thread")[round_ % 2]
        proc = subprocess.Popen(
            [sys.executable, str(script), str(root), mode, "20"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # its own process group: the writer process dies with it
        )
        lines: list[str] = []
        reader = threading.Thread(
            target=lambda p=proc, out=lines: out.extend(p.stdout), daemon=True
        )
        reader.start()
        last_round = round_ >= 5
        if not last_round:
            deadline = time.monotonic() + 120
            while not any(line.startswith("saved") for line in lines) and proc.poll() is None:
                assert time.monotonic() < deadline, "writer never saved"
                time.sleep(0.01)
            # At most ~3 saves per killed round, so 5 killed rounds never reach step 20.
            time.sleep(rng.uniform(0.0, 0.15))
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                kills += 1
        proc.wait(timeout=300)
        reader.join(timeout=10)
        if last_round or proc.returncode == 0:
            assert proc.returncode == 0, proc.stderr.read()
        names = [p.name for p in root.glob("step-*")]
        before = latest
        latest = check_every_complete_step_loads_exactly(root)
        complete = CheckpointManager(root, read_only=True).steps()
        incomplete_seen += len(names) - len(complete)
        assert latest is None or before is None or latest >= before
        if "done" in "".join(lines):
            break
    assert latest == 20 and kills >= 4
    # Retention kept the 3 newest and removed every leftover of the killed runs.
    assert sorted(p.name[:17] for p in root.iterdir() if p.name.startswith("step-")) == [
        "step-000000000018",
        "step-000000000019",
        "step-000000000020",
    ]
    print(f"kills={kills} incomplete folders seen after kills={incomplete_seen}")
