"""The Storage protocol: one conformance suite for every backend, and managers on fsspec."""

from __future__ import annotations

import uuid

import fsspec
import pytest
import torch

from torch_checkpointing import CheckpointManager, FileSystemStorage, FsspecStorage, Storage
from torch_checkpointing.storage import PrefixedStorage


def _backends(tmp_path):
    mem_root = f"/tcp-test-{uuid.uuid4().hex}"
    return {
        "filesystem": FileSystemStorage(tmp_path / "fs"),
        "fsspec-memory": FsspecStorage(f"memory://{mem_root}"),
        "fsspec-local": FsspecStorage(fs=fsspec.filesystem("file"), root=str(tmp_path / "ff")),
        "prefixed": PrefixedStorage(FileSystemStorage(tmp_path / "pp"), "sub/dir"),
    }


@pytest.mark.parametrize("name", ["filesystem", "fsspec-memory", "fsspec-local", "prefixed"])
def test_storage_conformance(tmp_path, name):
    s = _backends(tmp_path)[name]
    assert isinstance(s, Storage)
    assert s.list("") == [] and not s.exists("a")
    s.write("a/b/file.bin", [b"hello ", memoryview(b"world"), bytearray(b"!")])
    assert s.exists("a/b/file.bin") and s.exists("a")
    assert s.size("a/b/file.bin") == 12
    assert s.read("a/b/file.bin") == b"hello world!"
    assert s.read("a/b/file.bin", 6, 5) == b"world"
    buf = bytearray(4)
    s.read_into("a/b/file.bin", 2, memoryview(buf))
    assert bytes(buf) == b"llo "
    with pytest.raises(EOFError):
        s.read("a/b/file.bin", 10, 5)
    with pytest.raises(FileNotFoundError):
        s.size("a/nope")
    s.write("a/b/other.bin", [b"x"])
    s.rename("a/b/other.bin", "a/b/file.bin")  # replaces
    assert s.read("a/b/file.bin") == b"x"
    assert s.list("a/b") == ["file.bin"] and s.list("a") == ["b"] and s.list("zzz") == []
    s.delete("a")
    assert not s.exists("a") and s.list("") == []
    s.delete("a")  # deleting what is gone is fine
    with pytest.raises(ValueError, match="inside the storage root"):
        s.read("../escape")


def test_process_safety_flags(tmp_path):
    assert FileSystemStorage(tmp_path).process_safe
    assert not FsspecStorage("memory://x").process_safe
    assert FsspecStorage(fs=fsspec.filesystem("file"), root=str(tmp_path)).process_safe
    with pytest.raises(ValueError, match="use async_mode='thread' or 'off'"):
        CheckpointManager(None, storage=FsspecStorage("memory://y"), async_mode="process")
    with pytest.raises(ValueError, match="exactly one of url"):
        FsspecStorage()


@pytest.mark.parametrize(
    ("backend", "mode"),
    [("memory", "thread"), ("memory", "off"), ("local", "process"), ("local", "thread")],
)
def test_manager_on_fsspec_backends(tmp_path, backend, mode):
    if backend == "memory":
        storage = FsspecStorage(f"memory://tcp-{uuid.uuid4().hex}")
    else:
        storage = FsspecStorage(fs=fsspec.filesystem("file"), root=str(tmp_path / "ck"))
    model = torch.nn.Linear(20, 30)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(3, 20)).sum().backward()
    opt.step()
    with CheckpointManager("run1", storage=storage, async_mode=mode, keep_last=1) as mgr:
        for step in (1, 2):
            mgr.save(step, {"model": model, "optim": opt, "meta": {"step": step}})
        mgr.wait()
        assert mgr.steps() == [2]
    fresh = torch.nn.Linear(20, 30)
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    meta: dict = {}
    loader = CheckpointManager("run1", storage=storage, async_mode="off")
    assert loader.load({"model": fresh, "optim": fresh_opt, "meta": meta}) == 2
    assert torch.equal(fresh.weight, model.weight) and meta == {"step": 2}
    assert torch.equal(
        fresh_opt.state[fresh.weight]["momentum_buffer"], opt.state[model.weight]["momentum_buffer"]
    )
    assert storage.list("") == ["run1"]
