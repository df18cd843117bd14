"""Hugging Face-style sharded safetensors: ``save_hf`` and ``load_hf``.

``save_hf`` writes ``model-00001-of-0000N.safetensors`` files plus
``model.safetensors.index.json`` (a single file is ``model.safetensors`` with no index, as
Hugging Face does) from whatever each rank holds: whole tensors, DTensor shards or
sharded-protocol pieces, each rank writing its own pieces' bytes in place (``_hf_write``).
Given a ``config`` (and a ``generation_config``), it also writes ``config.json`` (and
``generation_config.json``), so ``from_pretrained`` loads the folder; ``config.json`` is
written last and a stale one is removed first, so a folder with one is complete.
Key renaming between model code and Hugging Face names is the caller's job (titan_models
gives its models' mapping).

``load_hf`` reads such a folder (or one written by ``transformers``) either into a new dict of
full tensors, or in place into a state dict of tensors / DTensors / sharded-protocol objects,
reading only the byte ranges each rank needs.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Mapping
from typing import Any

import torch

from . import _format as fmt
from . import _hf_write as hw
from . import _reshard as rs
from . import _tree as tr
from ._errors import CheckpointError, CorruptCheckpointError, StateMismatchError
from .storage import FileSystemStorage, PrefixedStorage, Storage

__all__ = ["load_hf", "parse_size", "save_hf"]

INDEX = hw.INDEX
SINGLE = hw.SINGLE


def _storage(path: Any, storage: Storage | None, create: bool) -> Storage:
    if storage is None:
        if path is None:
            raise ValueError("pass path=... (a folder) or storage=...")
        return FileSystemStorage(path, fsync=True, create=create)
    if path not in (None, ""):
        return PrefixedStorage(storage, os.fspath(path))
    return storage


def _resolve_group(pg: Any) -> Any:
    if pg == "self":  # this process alone, whatever torch.distributed holds
        return None
    if pg is not None:
        if not (callable(getattr(pg, "rank", None)) and callable(getattr(pg, "size", None))):
            raise TypeError(f"save_hf: process_group must be a ProcessGroup, got {pg!r}")
        return pg
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.distributed_c10d._get_default_group()
    return None


def parse_size(size: int | str) -> int:
    """Bytes in ``size``: a positive int, or a number with B/KB/MB/GB/TB (powers of 1000) or
    KiB/MiB/GiB/TiB (powers of 1024), e.g. ``"5GB"``, ``"512MiB"``, ``"1.5KB"``."""
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", str(size), re.IGNORECASE)
        if not match:
            raise ValueError(f"max_shard_size={size!r} is not a size like 5GB, 512MiB or 1000000")
        unit = (match.group(2) or "B").upper()
        power = "BKMGT".index(unit[0])
        value = int(float(match.group(1)) * (1024 if "I" in unit else 1000) ** power)
    if value < 1:
        raise ValueError(f"max_shard_size must be at least one byte, got {size!r}")
    return value


def _config_json(config: Any, field: str) -> bytes | None:
    """``config`` (a ``transformers`` config object, or a dict) as the bytes of its JSON file,
    as ``save_pretrained`` writes it; ``None`` stays ``None``."""
    if config is None:
        return None
    if isinstance(config, Mapping):
        try:
            text = json.dumps(dict(config), indent=2, sort_keys=True, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise TypeError(f"save_hf: {field} must hold only JSON values: {e}") from e
        return (text + "\n").encode()
    to_json = getattr(config, "to_json_string", None)
    if not callable(to_json):
        raise TypeError(
            f"save_hf: {field} must be a transformers config (PretrainedConfig / "
            f"GenerationConfig, anything with to_json_string()) or a dict, got "
            f"{type(config).__name__}"
        )
    text = to_json(use_diff=True)  # what save_pretrained writes: the non-default fields
    if not isinstance(text, str):
        raise TypeError(f"save_hf: {field}.to_json_string() returned {type(text).__name__}")
    return text.encode()


def save_hf(
    state_dict: Mapping[str, Any],
    path: str | os.PathLike[str] | None = None,
    *,
    storage: Storage | None = None,
    process_group: Any = None,
    max_shard_size: int | str = "5GB",
    metadata: dict[str, str] | None = None,
    transforms: Mapping[str, Callable[[torch.Tensor], torch.Tensor]] | None = None,
    config: Any = None,
    generation_config: Any = None,
) -> dict[str, Any]:
    """Write HF-style safetensors (shard files + index) from the pieces each rank holds.

    Every rank of ``process_group`` (default: the default group when torch.distributed is
    initialised, else this process alone; ``"self"``: this process alone) passes what it holds: plain tensors (whole; a
    replicated one may come from several ranks), DTensors (their local shards) or sharded
    tensors (``global_shape``, ``dtype``, ``local_chunks()``). Ranks may pass different keys
    (pipeline stages); together their pieces must cover every tensor (replicas count once).
    After one exchange of names, shapes and boxes, each rank writes its own pieces' bytes
    into the files in place: no tensor is gathered anywhere. Files appear under their final
    names only when complete; rank 0 writes the index last.

    ``transforms``: key -> a layout change of the whole tensor (same dtype and element count,
    e.g. a row permutation), applied by one rank holding it after the pieces are written.
    ``config``: the model's ``transformers`` config (``model.config``) or a dict, written as
    ``config.json``; ``generation_config`` likewise as ``generation_config.json`` (needs
    ``config``). Then ``AutoModelForCausalLM.from_pretrained(path)`` loads the folder.
    ``config.json`` is the folder's commit: a stale one (and a stale index or
    ``generation_config.json``) is removed before any weight is written, and the new one is
    written last, so a folder that has a ``config.json`` is complete and an interrupted export
    never looks loadable.

    Returns the index (``{"metadata": {"total_size": ...}, "weight_map": {name: file}}``).
    Pieces spread over ranks need a storage with ``write_at`` (``FileSystemStorage``).
    """
    if not isinstance(state_dict, Mapping):
        raise TypeError(
            f"save_hf: state_dict must be a dict of name -> tensor, got {type(state_dict).__name__}"
        )
    limit = parse_size(max_shard_size)
    meta = {"format": "pt", **(metadata or {})}
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise TypeError("save_hf: metadata must map str to str")
    transforms = dict(transforms or {})
    pg = _resolve_group(process_group)
    rank = pg.rank() if pg is not None else 0
    configs: dict[str, bytes] = {}
    try:
        rows, error = hw.describe(state_dict, transforms), None
        if generation_config is not None and config is None:
            raise ValueError("save_hf: generation_config needs config (config.json) as well")
        for name, value, field in (
            (hw.GENERATION_CONFIG, generation_config, "generation_config"),
            (hw.CONFIG, config, "config"),  # last: the folder's commit
        ):
            data = _config_json(value, field)
            if data is not None:
                configs[name] = data
    except (TypeError, ValueError) as e:  # every rank learns of it in the exchange
        rows, error = [], e
    all_rows, tag = hw.exchange(pg, rows, error)
    plan = hw.plan(all_rows, limit, tag, meta)
    store = _storage(path, storage, create=True)
    return hw.write(store, pg, rank, state_dict, transforms, plan, configs)


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
        leaf = tr.as_leaf(target, name, "hf", False)
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
