"""Hugging Face-style sharded safetensors: ``save_hf`` and ``load_hf``.

``save_hf`` writes a *full* state dict (plain tensors, or DTensors, which it gathers with
``full_tensor()``, a collective) as ``model-00001-of-0000N.safetensors`` files plus
``model.safetensors.index.json`` (a single file is ``model.safetensors`` with no index, as
Hugging Face does). The shard files are dealt round-robin to the ranks, which write them in
parallel; rank 0 writes the index last, once every shard file is in place. Key renaming
between model code and Hugging Face names is the caller's job.

``load_hf`` reads such a folder (or one written by ``transformers``) either into a new dict of
full tensors, or in place into a state dict of tensors / DTensors / sharded-protocol objects,
reading only the byte ranges each rank needs.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import time
from typing import Any

import torch

from . import _format as fmt
from . import _reshard as rs
from . import _tree as tr
from ._errors import CheckpointError, CorruptCheckpointError, StateMismatchError
from .storage import FileSystemStorage, PrefixedStorage, Storage

__all__ = ["load_hf", "save_hf"]

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def _storage(path: Any, storage: Storage | None, create: bool) -> Storage:
    if storage is None:
        if path is None:
            raise ValueError("pass path=... (a folder) or storage=...")
        return FileSystemStorage(path, fsync=True, create=create)
    if path not in (None, ""):
        return PrefixedStorage(storage, os.fspath(path))
    return storage


def _group(pg: Any) -> tuple[int, int]:
    if pg is not None:
        return pg.rank(), pg.size()
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _parse_size(size: int | str) -> int:
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    if isinstance(size, str):
        units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
        s = size.strip().upper()
        for u in sorted(units, key=len, reverse=True):
            if s.endswith(u) and s[: -len(u)].strip().isdigit():
                return int(s[: -len(u)]) * units[u]
        if s.isdigit():
            return int(s)
    raise ValueError(f"max_shard_size must be a positive int or a string like '5GB', got {size!r}")


def save_hf(
    state_dict: dict[str, Any],
    path: str | os.PathLike[str] | None = None,
    *,
    storage: Storage | None = None,
    process_group: Any = None,
    max_shard_size: int | str = "5GB",
    metadata: dict[str, str] | None = None,
    index_timeout: float = 600.0,
) -> dict[str, Any]:
    """Write ``state_dict`` (name -> full tensor or DTensor) as HF sharded safetensors.

    Every rank must call it with the same keys, shapes and dtypes. Returns the index
    (``{"metadata": {"total_size": ...}, "weight_map": {name: file}}``).
    """
    if not isinstance(state_dict, dict) or not state_dict:
        raise TypeError("save_hf: state_dict must be a non-empty dict of name -> tensor")
    limit = _parse_size(max_shard_size)
    meta = {"format": "pt", **(metadata or {})}
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise TypeError("save_hf: metadata must map str to str")
    store = _storage(path, storage, create=True)
    rank, world = _group(process_group)
    tensors: dict[str, torch.Tensor] = {}
    for name, value in state_dict.items():
        if not isinstance(name, str):
            raise TypeError(f"save_hf: keys must be str, got {name!r}")
        if tr.is_dtensor(value):
            value = value.full_tensor()
        elif tr.is_sharded(value):
            raise TypeError(
                f"save_hf: {name} is a sharded tensor; HF files hold full tensors, gather it "
                "first (or save it with CheckpointManager)"
            )
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"save_hf: {name} must be a tensor, got {type(value).__name__}")
        code = fmt.DTYPES.get(str(value.dtype).removeprefix("torch."), (0, None))[1]
        if code is None:
            raise TypeError(f"save_hf: {name} has dtype {value.dtype}, which safetensors lacks")
        tensors[name] = value
    shards: list[list[str]] = [[]]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    n = len(shards)
    names = [SINGLE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    weight_map = {k: names[i] for i, keys in enumerate(shards) for k in keys}
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    tag = secrets.token_hex(4)
    for i in range(rank, n, world):
        _write_shard(store, names[i], [(k, tensors[k]) for k in shards[i]], meta, tag)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    if n > 1 and rank == 0:
        deadline = time.monotonic() + index_timeout
        while not all(store.exists(f) for f in names):
            if time.monotonic() > deadline:
                missing = [f for f in names if not store.exists(f)]
                raise CheckpointError(
                    f"save_hf: shard files {missing} did not appear within {index_timeout} s; "
                    "the index was not written"
                )
            time.sleep(0.01)
        data = json.dumps(index, indent=2).encode()
        tmp = fmt.tmp_name(INDEX, tag)
        store.write(tmp, [data])
        store.rename(tmp, INDEX)
    return index


def _write_shard(
    store: Any, name: str, items: list[tuple[str, torch.Tensor]], meta: dict[str, str], tag: str
) -> None:
    entries = []
    views = []
    offset = 0
    keep = []
    for key, t in items:
        t = t.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous()
        keep.append(t)
        nbytes = t.numel() * t.element_size()
        code = fmt.DTYPES[str(t.dtype).removeprefix("torch.")][1]
        entries.append((key, code, list(t.shape), offset, offset + nbytes))
        views.append(rs.bytes_view(t))
        offset += nbytes
    header = fmt.safetensors_header(entries, meta)
    tmp = fmt.tmp_name(name, tag)
    try:
        store.write(tmp, [header, *views])
        store.rename(tmp, name)
    except BaseException:
        with contextlib.suppress(Exception):
            store.delete(tmp)
        raise


def _files(store: Any) -> dict[str, str]:
    """name -> file of a HF folder (index, single file, or every safetensors file)."""
    listing = store.list("")
    if INDEX in listing:
        index = json.loads(store.read(INDEX))
        return dict(index["weight_map"])
    files = (
        [SINGLE] if SINGLE in listing else sorted(f for f in listing if f.endswith(".safetensors"))
    )
    if not files:
        raise FileNotFoundError(f"load_hf: no {INDEX} or .safetensors files in {store!r}")
    out: dict[str, str] = {}
    for f in files:
        head, _ = fmt.parse_safetensors_header(lambda o, n, f=f: store.read(f, o, n), f)
        for k in head:
            if k != "__metadata__":
                out[k] = f
    return out


def load_hf(
    path: str | os.PathLike[str] | None = None,
    state_dict: dict[str, Any] | None = None,
    *,
    storage: Storage | None = None,
    strict: bool = True,
) -> dict[str, Any]:
    """Read HF safetensors: into new full CPU tensors (``state_dict=None``), or in place.

    In place, each target (tensor, DTensor, sharded-protocol object) reads only its own byte
    ranges; keys, dtypes and shapes must match (``strict=False`` skips missing/extra keys).
    """
    store = _storage(path, storage, create=False)
    weight_map = _files(store)
    headers: dict[str, tuple[dict, int]] = {}
    for f in sorted(set(weight_map.values())):
        headers[f] = fmt.parse_safetensors_header(lambda o, n, f=f: store.read(f, o, n), f)

    def info(name: str) -> tuple[str, str, tuple[int, ...], int]:
        f = weight_map[name]
        head, start = headers[f]
        if name not in head:
            raise CorruptCheckpointError(f"{f}: the index lists {name!r} but the file lacks it", f)
        e = head[name]
        code = e["dtype"]
        if code not in fmt.ST_TO_DTYPE:
            raise CheckpointError(f"{f}: {name} has safetensors dtype {code}, not supported")
        return f, fmt.ST_TO_DTYPE[code], tuple(e["shape"]), start + e["data_offsets"][0]

    if state_dict is None:
        state_dict = {}
        for name in weight_map:
            _, dtype, shape, _ = info(name)
            state_dict[name] = torch.empty(shape, dtype=tr.torch_dtype(dtype))
    elif not isinstance(state_dict, dict):
        raise TypeError("load_hf: state_dict must be a dict of name -> tensor, or None")
    missing = [k for k in state_dict if k not in weight_map]
    unexpected = [k for k in weight_map if k not in state_dict]
    mismatched = []
    leaves = {}
    for name, target in state_dict.items():
        if name not in weight_map:
            continue
        if not tr.is_tensor_like(target):
            raise TypeError(f"load_hf: {name} must be a tensor to load into, got {type(target)}")
        leaf = tr._leaf(target, name, "hf", False)
        _, dtype, shape, _ = info(name)
        if leaf.dtype != dtype or leaf.shape != shape:
            mismatched.append((name, f"{leaf.dtype}{list(leaf.shape)}", f"{dtype}{list(shape)}"))
        leaves[name] = leaf
    if mismatched or (strict and (missing or unexpected)):
        raise StateMismatchError.listing(repr(store), missing, unexpected, mismatched)
    plan = rs.ReadPlan()
    files: dict[str, rs.FileInfo] = {}
    with torch.no_grad():
        for name, leaf in leaves.items():
            f, dtype, shape, start = info(name)
            if f not in files:
                files[f] = rs.FileInfo(f, store.size(f), None, None)
            chunk = rs.StoredChunk(f, (0,) * len(shape), shape, dtype, start)
            rs.plan_leaf(plan, "hf", leaf, [chunk], rs.local_chunks(leaf))
        rs.execute(store, plan, files)
    return state_dict
