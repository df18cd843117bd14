"""Hostile folders never escape "damaged -> fall back": whatever a checkpoint folder holds
(nested-JSON garbage, a FIFO, a symlink to a device or out of the root, a huge file, fields
forged under a valid checksum), listing, ``latest_step``, ``load(fallback=True)`` and retention
go on with the rest, name the folder once, and delete nothing a user may want."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import tracemalloc
import warnings
from pathlib import Path

import pytest
import torch

from torch_checkpointing import CheckpointManager, CheckpointWarning
from torch_checkpointing import _format as fmt

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _checkpointing_cases import tree_bytes

STRAY = "step-000000000000.0123456789ab-0"  # another run's folder, sorting first


def state_of(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"m": {"w": torch.randn(300, generator=g), "b": torch.arange(5) * step}}


def load_checked_state(mgr: CheckpointManager, **kw) -> int:
    got = {"m": {"w": torch.zeros(300), "b": torch.zeros(5, dtype=torch.int64)}}
    step = mgr.load(got, **kw)
    want = state_of(step)
    assert torch.equal(got["m"]["w"], want["m"]["w"]) and torch.equal(got["m"]["b"], want["m"]["b"])
    return step


def save_steps(root: Path, steps, **kw) -> None:
    with CheckpointManager(root, async_mode="off", **kw) as mgr:
        for s in steps:
            mgr.save(s, state_of(s))


def dir_of(root: Path, step: int) -> Path:
    (d,) = [p for p in root.iterdir() if p.name.startswith(f"step-{step:012d}.")]
    return d


def finishes(fn, timeout: float = 20.0):
    """``fn()``'s result, failing (not hanging) when it has not returned within ``timeout``."""
    out: dict = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as e:
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"still running after {timeout} s"
    if "error" in out:
        raise out["error"]
    return out["value"]


def reseal(path: Path, mutate) -> None:
    """Change fields of a manifest or done-marker and give it a valid checksum again."""
    body = fmt.load_checked(path.read_bytes(), str(path))
    mutate(body)
    path.write_bytes(fmt.dump_checked(body))


def only_file(marker: dict) -> dict:
    (info,) = [i for i in marker["files"].values() if i["item"] == "m"]
    return info


def damaged_warnings(caught, name: str) -> list[str]:
    return [
        str(w.message)
        for w in caught
        if issubclass(w.category, CheckpointWarning) and name in str(w.message)
    ]


# ------------------------------------------------------------------- nested-JSON garbage


@pytest.mark.parametrize("where", ["manifest.json", "done-00000.json"])
def test_nested_json_garbage_is_one_damaged_folder_and_the_rest_loads(tmp_path, where):
    save_steps(tmp_path, [1, 2])
    bad = dir_of(tmp_path, 2)
    (bad / where).write_bytes(b"[" * 100_000)
    mgr = CheckpointManager(tmp_path, read_only=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        want = [1] if where == "manifest.json" else [1, 2]  # a marker is read only by load
        for _ in range(3):
            assert mgr.steps() == want
        assert mgr.latest_step() == want[-1]
    if where == "manifest.json":
        assert len(damaged_warnings(caught, bad.name)) == 1  # named once, not per call
    with pytest.warns(CheckpointWarning, match="loaded step 1"):
        assert load_checked_state(mgr, fallback=True) == 1


def test_a_stray_garbage_folder_of_another_run_stops_neither_saves_nor_retention(tmp_path):
    stray = tmp_path / STRAY
    stray.mkdir()
    (stray / "manifest.json").write_bytes(b"[" * 100_000)
    (stray / "notes.txt").write_text("a user's file")
    before = tree_bytes(stray)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        save_steps(tmp_path, [1, 2, 3, 4], keep_last=2)
        mgr = CheckpointManager(tmp_path, read_only=True)
        assert mgr.steps() == [3, 4] and mgr.latest_step() == 4
    assert not [w for w in caught if "retention failed" in str(w.message)]
    assert tree_bytes(stray) == before  # never deleted
    assert sorted(p.name[:17] for p in tmp_path.iterdir() if p.name.startswith("step-")) == [
        "step-000000000000",
        "step-000000000003",
        "step-000000000004",
    ]


def test_retention_leaves_a_folder_without_manifest_that_holds_a_users_files(tmp_path):
    save_steps(tmp_path, [5])
    foreign = tmp_path / "step-000000000001.0123456789ab-0"  # no manifest: looks unfinished
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    save_steps(tmp_path, [6, 7], keep_last=1)
    assert (foreign / "notes.txt").read_text() == "keep me"


# ----------------------------------------------------------------- unbounded reads


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_fifo_as_manifest_is_damage_not_a_read_that_blocks(tmp_path):
    save_steps(tmp_path, [1, 2])
    bad = dir_of(tmp_path, 2)
    (bad / "manifest.json").unlink()
    os.mkfifo(bad / "manifest.json")
    mgr = CheckpointManager(tmp_path, read_only=True)
    try:
        with pytest.warns(CheckpointWarning, match="not a regular file"):
            assert finishes(mgr.steps) == [1]
        assert finishes(lambda: load_checked_state(mgr, fallback=True)) == 1
    finally:  # release a reader stuck in open() (the old behaviour)
        with contextlib.suppress(OSError):
            os.close(os.open(bad / "manifest.json", os.O_WRONLY | os.O_NONBLOCK))


@pytest.mark.parametrize("target", ["/dev/zero", "outside"])
def test_a_marker_symlinked_to_a_device_or_out_of_the_root_is_never_read(tmp_path, target):
    root = tmp_path / "root"
    save_steps(root, [1, 2])
    marker = dir_of(root, 2) / "done-00000.json"
    if target == "outside":  # a valid marker, but not inside the root: not read either
        target = str(tmp_path / "elsewhere.json")
        Path(target).write_bytes(marker.read_bytes())
    marker.unlink()
    marker.symlink_to(target)
    mgr = CheckpointManager(root, read_only=True)
    with pytest.warns(CheckpointWarning, match="done-00000.json"):
        assert finishes(lambda: load_checked_state(mgr, fallback=True)) == 1


def test_an_oversized_manifest_is_rejected_before_it_is_read(tmp_path):
    save_steps(tmp_path, [1, 2])
    manifest = dir_of(tmp_path, 2) / "manifest.json"
    with open(manifest, "r+b") as f:  # sparse: costs no disk
        f.truncate(300 << 20)  # above the cap (MANIFEST_MAX_BYTES)
    mgr = CheckpointManager(tmp_path, read_only=True)
    tracemalloc.start()
    try:
        with pytest.warns(CheckpointWarning, match="more than any real metadata file"):
            assert mgr.steps() == [1]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, peak


# --------------------------------------------------------- forged fields, valid checksum


def _forge_manifest_world_size(folder: Path) -> None:
    reseal(folder / "manifest.json", lambda m: m.update(world_size=10**12))


def _forge_block_size_zero(folder: Path) -> None:
    reseal(folder / "done-00000.json", lambda m: only_file(m).update(block_size=0))


def _forge_negative_data_start(folder: Path) -> None:
    reseal(folder / "done-00000.json", lambda m: only_file(m).update(data_start=-5))


def _forge_shifted_chunk(folder: Path) -> None:
    def shift(m: dict) -> None:
        w = next(c for c in only_file(m)["chunks"] if c[0] == "w")
        w[4], w[5] = w[4] + 4, w[5] + 4

    reseal(folder / "done-00000.json", shift)


@pytest.mark.parametrize(
    "forge",
    [
        _forge_manifest_world_size,
        _forge_block_size_zero,
        _forge_negative_data_start,
        _forge_shifted_chunk,
    ],
    ids=lambda f: f.__name__[len("_forge_") :],
)
def test_a_forged_field_with_a_valid_checksum_falls_back(tmp_path, forge):
    save_steps(tmp_path, [1, 2])
    forge(dir_of(tmp_path, 2))
    mgr = CheckpointManager(tmp_path, read_only=True)
    with pytest.warns(CheckpointWarning, match=dir_of(tmp_path, 2).name):
        assert finishes(lambda: load_checked_state(mgr, fallback=True)) == 1


def test_a_garbage_lock_file_does_not_keep_the_root_from_opening(tmp_path):
    save_steps(tmp_path, [1])
    (tmp_path / ".lock-00000.json").write_bytes(b"[" * 100_000)
    with CheckpointManager(tmp_path, async_mode="off") as mgr:
        assert mgr.latest_step() == 1
        mgr.save(2, state_of(2))
