"""Hypothesis strategies and oracles for fuzzing torch_checkpointing's metadata readers (shared
by the fast slice in ``test_fuzz.py`` and the long run in ``tests/chaos``).

The only outcomes a reader may have on any input: it returns what a real save wrote (and a load
fills the state bitwise), or it raises the library's damaged-checkpoint error. Inputs: random
bytes, random JSON, real files with random fields, and forgeries (fields of a real manifest or
done-marker mutated, then sealed with a valid checksum again).
"""

from __future__ import annotations

import json
import os
import random
import warnings
import zlib
from pathlib import Path
from typing import Any

import torch
from hypothesis import strategies as st

from torch_checkpointing import (
    CheckpointManager,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    FileSystemStorage,
)
from torch_checkpointing import _format as fmt
from torch_checkpointing import _load as ld
from torch_checkpointing import _retention as ret

DAMAGE = (CorruptCheckpointError, CheckpointNotFoundError)


def state_of(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {
        "m": {"w": torch.randn(6, 5, generator=g), "b": torch.arange(5) * step},
        "o": {"lr": 0.1 * step, "count": step},
    }


def empty_state() -> dict:
    return {"m": {"w": torch.zeros(6, 5), "b": torch.zeros(5, dtype=torch.int64)}, "o": {}}


class Fixture:
    """A root with intact checkpoints of steps 1 and 2; ``reset()`` puts step 2's manifest and
    marker back after a case changed them."""

    def __init__(self, root: Path) -> None:
        self.root = root
        with CheckpointManager(root, async_mode="off") as mgr:
            for s in (1, 2):
                mgr.save(s, state_of(s))
        (self.folder,) = [p for p in root.iterdir() if p.name.startswith("step-000000000002.")]
        self.name = self.folder.name
        self.manifest_bytes = (self.folder / fmt.MANIFEST).read_bytes()
        self.marker_bytes = (self.folder / fmt.marker_file(0)).read_bytes()
        self.manifest = fmt.load_checked(self.manifest_bytes, "manifest")
        self.marker = fmt.load_checked(self.marker_bytes, "marker")
        self.storage = WatchedStorage(root)

    def reset(self) -> None:
        self.write("manifest", self.manifest_bytes)
        self.write("marker", self.marker_bytes)

    def write(self, which: str, data: bytes) -> None:
        name = fmt.MANIFEST if which == "manifest" else fmt.marker_file(0)
        (self.folder / name).write_bytes(data)


class WatchedStorage(FileSystemStorage):
    """Fails the case on any access that resolves outside the root."""

    def __init__(self, root: Path) -> None:
        super().__init__(root, fsync=False)
        self.real_root = os.path.realpath(self.root)

    def full_path(self, path: str) -> str:
        full = super().full_path(path)
        real = os.path.realpath(full)
        assert real == self.real_root or real.startswith(self.real_root + os.sep), (path, real)
        return full


# ---------------------------------------------------------------------------- strategies

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)

# Values a forger would try: the edges of every range the readers check.
edge_values = st.sampled_from(
    [0, -1, 1, 7, 8, 4095, 4096, 2**31, 2**63, 2**64, 10**12, -(2**63), 1e12, 0.5, float("inf"),
     "", "x", "../x", "/etc/passwd", "float32", "bfloat16", "nope", [], {}, [0], [-1], [2**40],
     [[]], None, True, False]
)  # fmt: skip


def sealed(body: Any) -> bytes:
    """``body`` with a valid checksum, whatever it is (a forgery's last step)."""
    text = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return b'{"crc32":%d,"body":%s}' % (zlib.crc32(text), text)


def sealed_raw(text: bytes) -> bytes:
    """``text`` (any bytes) as a body with a valid checksum: damage a parser must survive."""
    return b'{"crc32":%d,"body":%s}' % (zlib.crc32(text), text)


def deep(n: int) -> bytes:
    return b'{"a":' * n + b"1" + b"}" * n


def _paths(obj: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += _paths(v, (*prefix, i))
    return out


def forge(body: dict, seed: int, value: Any, how: int) -> dict:
    """A copy of ``body`` with one field (chosen by ``seed``) replaced by ``value``, deleted, or
    given an extra sibling, by ``how``."""
    body = json.loads(json.dumps(body))
    paths = [p for p in _paths(body) if p]
    path = random.Random(seed).choice(paths)
    parent = body
    for k in path[:-1]:
        parent = parent[k]
    key = path[-1]
    if how == 0 or isinstance(parent, list):
        parent[key] = value
    elif how == 1:
        del parent[key]
    else:
        parent[f"{key}_extra"] = value
    return body


forgeries = st.tuples(st.integers(0, 2**32), st.one_of(edge_values, json_values), st.integers(0, 2))

hostile_bytes = st.one_of(
    st.binary(max_size=256),
    json_values.map(lambda v: json.dumps(v).encode()),
    json_values.map(sealed),
    st.integers(1, 3000).map(lambda n: b"[" * n),
    st.integers(1, 3000).map(lambda n: sealed_raw(deep(n))),
    st.binary(max_size=64).map(lambda b: sealed_raw(b"{" + b + b"}")),
)


# ------------------------------------------------------------------------------ oracles


def check_bytes_reader(data: bytes) -> None:
    try:
        body = fmt.load_checked(data, "x")
    except CorruptCheckpointError:
        return
    assert isinstance(body, dict)


def check_manifest_reader(fx: Fixture, data: bytes) -> None:
    """``classify`` never raises; a folder it calls complete has a manifest that checks."""
    fx.reset()
    fx.write("manifest", data)
    a = ret.classify(fx.storage, fx.name, *fmt.parse_step_dir(fx.name))
    assert a.status in (ret.COMPLETE, ret.DAMAGED, ret.INCOMPLETE)
    if a.status == ret.COMPLETE:
        assert a.manifest["world_size"] == 1 and a.manifest["step"] == 2


def check_marker_reader(fx: Fixture, data: bytes) -> None:
    fx.reset()
    fx.write("marker", data)
    try:
        files = ld._read_marker(fx.storage, fx.name, fx.manifest, 0)
    except CorruptCheckpointError:
        return
    assert isinstance(files, dict)


def check_load_fallback(fx: Fixture, which: str, data: bytes) -> None:
    """``load(fallback=True)`` loads step 2 or 1 bitwise, or raises a damage error."""
    fx.reset()
    fx.write(which, data)
    mgr = CheckpointManager(None, storage=fx.storage, read_only=True)
    got = empty_state()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            step = mgr.load(got, fallback=True)
    except DAMAGE:
        return
    finally:
        mgr.close()
    want = state_of(step)
    assert step in (1, 2)
    assert torch.equal(got["m"]["w"], want["m"]["w"]) and torch.equal(got["m"]["b"], want["m"]["b"])
    assert got["o"] == want["o"]
