"""Hugging Face checkpoints in and out, streamed one tensor at a time.

``from_hf`` validates every key, shape and dtype against the model built on the meta device
before it allocates anything, then materialises the model once and copies each checkpoint
tensor into place as it is read (peak memory: the model plus one tensor). ``to_hf`` writes
``config.json`` and size-capped safetensors shards (plus the index when there is more than one)
into a temporary folder that is renamed into place only when complete.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import uuid
from collections import defaultdict
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from .components import Transformer, TransformerConfig, local_chunks
from .hf_adapter import HFAdapter, HFTensor
from .registry import family_for_hf, family_of

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
}
_DTYPE_NAMES = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
_MAX_LISTED = 20


def hf_model_config(
    path: str | os.PathLike,
) -> tuple[type[Transformer], TransformerConfig]:
    """The model class and config of the HF checkpoint folder ``path`` (nothing is read but
    ``config.json`` and the tensor names). ``ValueError`` naming an unsupported HF field."""
    _, hf_config, adapter, _ = _open_checkpoint(path)
    return family_for_hf(hf_config.get("model_type")).model_cls, adapter.config_from_hf(hf_config)


def from_hf(
    path: str | os.PathLike,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
) -> Transformer:
    """Our model with the weights of the HF checkpoint folder ``path``.

    Args:
        path: folder with ``config.json`` and ``model.safetensors`` or sharded
            ``*.safetensors`` (with ``model.safetensors.index.json``).
        dtype: dtype of the returned model; floating tensors are converted to it. By default
            the checkpoint's own (``config.json``'s ``dtype``/``torch_dtype``, else that of its
            tensors), and every tensor must already have it.
        device: where the weights are materialised.

    Raises:
        ValueError: an HF config feature we do not model (naming the field); missing,
            unexpected, mis-shaped or wrongly typed tensors (naming each key). Nothing is
            allocated before these checks pass.
    """
    root, hf_config, adapter, files = _open_checkpoint(path)
    family = family_for_hf(hf_config.get("model_type"))
    config = adapter.config_from_hf(hf_config)
    with torch.device("meta"):
        model = family.model_cls(config)
    declared = _declared_dtype(hf_config)
    target = dtype or declared or _first_tensor_dtype(files)
    model.to(dtype=target)  # on meta: free
    _validate(model, adapter, files, hf_config, target, convert=dtype is not None)

    model.to_empty(device=device)
    model._tie()
    with torch.no_grad():
        for buffer in model.buffers():
            buffer.zero_()  # those the checkpoint holds are overwritten next; the rest start at 0
    load_hf_state(model.state_dict(keep_vars=True), root)
    return model


@torch.no_grad()
def load_hf_state(state: Mapping[str, Any], path: str | os.PathLike) -> None:
    """Fill ``state`` in place from the HF checkpoint folder ``path``, reading only what it
    holds.

    ``state`` maps our FQNs to plain tensors (whole) or objects of the sharded-tensor protocol
    (``global_shape``, ``local_chunks()``: a rank's pieces, e.g. flexshard shards, tensor- or
    expert-parallel slices, one pipeline stage's layers). Each piece is read from the
    checkpoint as a slice (safetensors reads just those bytes; each file is mapped only while
    one tensor is read), so a rank's memory holds its pieces and one slice in flight, never
    the full model. Keys and shapes are validated first against the model the checkpoint's
    ``config.json`` describes; dtypes convert on copy. Entries the checkpoint does not hold
    (a router's selection bias) are left as they are.
    """
    _, hf_config, adapter, files = _open_checkpoint(path)
    family = family_for_hf(hf_config.get("model_type"))
    with torch.device("meta"):
        model = family.model_cls(adapter.config_from_hf(hf_config))
    _validate(model, adapter, files, hf_config, torch.float32, convert=True)
    whole = dict(named_state(model))
    aliases = set(model.state_dict()) - set(whole)  # a tied head: filled with the embedding
    for key, value in state.items():
        if key in aliases:
            continue
        if key not in whole:
            raise ValueError(f"load_hf_state: {key!r} is not a tensor of {type(model).__name__}")
        global_shape, chunks = local_chunks(value)
        if tuple(global_shape) != tuple(whole[key].shape):
            raise ValueError(
                f"load_hf_state: {key!r} has global shape {tuple(global_shape)}, the "
                f"checkpoint's model {tuple(whole[key].shape)}"
            )
        for ht in adapter.hf_tensors(key, whole[key], hf_config):
            _copy_pieces(ht, whole[key], chunks, files[ht.key])


def _copy_pieces(
    ht: HFTensor,
    whole: torch.Tensor,
    chunks: list[tuple[tuple[int, ...], torch.Tensor]],
    file: Path,
) -> None:
    """Copy the parts of HF tensor ``ht`` that fall into our ``chunks`` (global offsets in
    ``whole``, our parameter on meta): ``ht.ours`` is ``whole[lead...]``, so a chunk holding
    that leading index receives the slice of the HF tensor its trailing ranges cover."""
    lead = _leading_index(ht.ours, whole)
    if lead is None:
        raise ValueError(f"{ht.key}: not a whole-trailing-dims view of our tensor")
    k = len(lead)
    transformed = None  # an HF layout that needs a transform is read whole, once
    for offset, chunk in chunks:
        inside = all(o <= i < o + n for i, o, n in zip(lead, offset, chunk.shape, strict=False))
        if chunk.numel() == 0 or not inside:
            continue
        rest = tuple(slice(o, o + n) for o, n in zip(offset[k:], chunk.shape[k:], strict=True))
        target = chunk[tuple(i - o for i, o in zip(lead, offset, strict=False))]
        if ht.from_hf is not None:
            if transformed is None:
                with safe_open(file, framework="pt") as f:
                    transformed = ht.from_hf(f.get_tensor(ht.key))
            target.copy_(transformed[rest])
            continue
        with safe_open(file, framework="pt") as f:  # mapped only while this slice is read
            piece = f.get_slice(ht.key)[rest] if rest else f.get_tensor(ht.key)
        target.copy_(piece.reshape(target.shape))


def _leading_index(view: torch.Tensor, whole: torch.Tensor) -> tuple[int, ...] | None:
    """``view`` is ``whole[i, j, ...]`` (whole trailing dims): those leading indices; None
    when it is some other view (then the HF tensor is read whole)."""
    k = whole.dim() - view.dim()
    if k < 0 or tuple(view.shape) != tuple(whole.shape[k:]):
        return None
    if k == 0:
        return ()
    inner = math.prod(whole.shape[k:])
    flat, rem = divmod(view.storage_offset(), inner)
    if rem:
        return None
    index = []
    for size in reversed(whole.shape[:k]):
        flat, i = divmod(flat, size)
        index.append(i)
    return tuple(reversed(index))


def _open_checkpoint(path: str | os.PathLike) -> tuple[Path, dict, HFAdapter, dict[str, Path]]:
    """(folder, HF config as it applies to the tensors present, adapter, key → file)."""
    root = Path(path)
    config_file = root / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{config_file} does not exist: not an HF checkpoint folder")
    hf_config = json.loads(config_file.read_text())
    adapter = family_for_hf(hf_config.get("model_type")).hf_adapter
    files = checkpoint_files(root)
    return root, adapter.adapt_to_checkpoint(hf_config, files.keys()), adapter, files


def to_hf(
    model: Transformer,
    path: str | os.PathLike,
    *,
    max_shard_size: int | str = "5GB",
    dtype: torch.dtype | None = None,
) -> Path:
    """Write ``model`` as an HF checkpoint folder that ``AutoModelForCausalLM`` loads.

    Args:
        path: a folder that does not exist yet (or is empty).
        max_shard_size: bytes per safetensors shard, an int or a string such as ``"5GB"``
            (decimal units) or ``"512MiB"``; a tensor larger than this gets a shard of its own.
        dtype: dtype of the written tensors; the parameters' own by default.
    """
    family = family_of(model)
    adapter = family.hf_adapter
    limit = parse_size(max_shard_size)
    root = Path(path)
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        raise ValueError(f"{root} exists and is not an empty folder; to_hf writes a new one")
    hf_config = adapter.config_to_hf(model.config)
    tensors, buffers = _hf_tensors_for_saving(model, adapter, hf_config)
    out_dtype = dtype or tensors[0].ours.dtype
    # The views of one checkpoint tensor, in order (several for a fused tensor).
    by_key: dict[str, list[HFTensor]] = {}
    for ht in tensors:
        by_key.setdefault(ht.key, []).append(ht)

    shards: list[list[list[HFTensor]]] = [[]]
    shard_bytes = 0
    for parts in by_key.values():
        size = math.prod(parts[0].hf_shape()) * out_dtype.itemsize
        if shards[-1] and shard_bytes + size > limit:
            shards.append([])
            shard_bytes = 0
        shards[-1].append(parts)
        shard_bytes += size
    names = (
        [SINGLE_FILE]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )

    partial = root.parent / f".{root.name}.partial-{uuid.uuid4().hex[:8]}"
    partial.mkdir(parents=True)
    try:
        weight_map, total = {}, 0
        for name, shard in zip(names, shards, strict=True):
            # Buffers (a router's fp32 selection bias) keep their dtype, as transformers does.
            state, storages = {}, set()
            for parts in shard:
                key = parts[0].key
                tensor = _standalone(parts, None if key in buffers else dtype)
                if tensor.untyped_storage().data_ptr() in storages:
                    tensor = tensor.clone()  # one parameter under two keys (MTP's head copy)
                storages.add(tensor.untyped_storage().data_ptr())
                state[key] = tensor
            save_file(state, partial / name, metadata={"format": "pt"})
            total += sum(t.numel() * t.element_size() for t in state.values())
            weight_map.update(dict.fromkeys(state, name))
            del state
        if len(shards) > 1:
            index = {
                "metadata": {"total_size": total},
                "weight_map": dict(sorted(weight_map.items())),
            }
            (partial / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        hf_config["torch_dtype"] = str(out_dtype).removeprefix("torch.")
        (partial / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
        if root.exists():
            root.rmdir()
        os.replace(partial, root)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return root


def checkpoint_files(root: Path) -> dict[str, Path]:
    """Every tensor key of the checkpoint in ``root`` and the file holding it."""
    index = root / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = {key: root / name for key, name in weight_map.items()}
        for file in sorted(set(files.values())):
            if not file.is_file():
                raise FileNotFoundError(f"{file}, named in {index}, does not exist")
        return files
    paths = (
        [root / SINGLE_FILE]
        if (root / SINGLE_FILE).is_file()
        else sorted(root.glob("*.safetensors"))
    )
    if not paths:
        raise FileNotFoundError(f"{root} holds no *.safetensors file")
    files: dict[str, Path] = {}
    for file in paths:
        with safe_open(file, framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if key in files:
                    raise ValueError(f"tensor {key!r} is in both {files[key].name} and {file.name}")
                files[key] = file
    return files


def parse_size(size: int | str) -> int:
    """Bytes in ``size``: an int, or a number with B/KB/MB/GB/TB (powers of 1000) or
    KiB/MiB/GiB/TiB (powers of 1024)."""
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


def _declared_dtype(hf_config: dict) -> torch.dtype | None:
    name = hf_config.get("dtype") or hf_config.get("torch_dtype")
    return _DTYPE_NAMES.get(name) if isinstance(name, str) else None


def _first_tensor_dtype(files: dict[str, Path]) -> torch.dtype:
    key, file = next(iter(files.items()))
    with safe_open(file, framework="pt") as f:
        found = f.get_slice(key).get_dtype()
    if found not in _DTYPES:
        raise ValueError(f"tensor {key!r} has dtype {found}; pass dtype= to from_hf")
    return _DTYPES[found]


def named_state(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """What a checkpoint holds of ``model``: its parameters (a tied one once) and its
    persistent buffers (a router's selection bias), in registration order."""
    yield from model.named_parameters()
    for prefix, module in model.named_modules():
        for name, buffer in module.named_buffers(recurse=False):
            if name not in module._non_persistent_buffers_set:
                yield (f"{prefix}.{name}" if prefix else name), buffer


def _validate(
    model: Transformer,
    adapter: HFAdapter,
    files: dict[str, Path],
    hf_config: dict,
    target: torch.dtype,
    *,
    convert: bool,
) -> None:
    """Every key, shape and dtype, checked on the meta model; one error listing all problems."""
    params = {id(p) for p in model.parameters()}
    expected, is_param = {}, {}
    for fqn, tensor in named_state(model):
        for ht in adapter.hf_tensors(fqn, tensor, hf_config):
            expected[ht.key] = ht.hf_shape()
            is_param[ht.key] = id(tensor) in params
    missing = sorted(set(expected) - set(files))
    unexpected = sorted(
        k for k in files if k not in expected and not adapter.is_ignored(k, model.config)
    )
    wrong: list[str] = []
    by_file: dict[Path, list[str]] = defaultdict(list)
    for key in expected:
        if key in files:
            by_file[files[key]].append(key)
    for file, keys in by_file.items():
        with safe_open(file, framework="pt") as f:
            for key in keys:
                piece = f.get_slice(key)
                shape, found = tuple(piece.get_shape()), piece.get_dtype()
                if shape != expected[key]:
                    wrong.append(f"{key}: checkpoint shape {shape}, model shape {expected[key]}")
                if found not in _DTYPES:
                    wrong.append(f"{key}: dtype {found} is not a floating dtype we can load")
                elif not convert and is_param[key] and _DTYPES[found] != target:
                    # Buffers (a router's fp32 bias in a bf16 checkpoint) convert on copy.
                    wrong.append(
                        f"{key}: dtype {_DTYPES[found]}, checkpoint dtype {target} "
                        "(pass dtype= to convert)"
                    )
    problems = [
        _listing("missing keys", missing),
        _listing("unexpected keys", unexpected),
        _listing("mismatched tensors", wrong),
    ]
    problems = [p for p in problems if p]
    if problems:
        raise ValueError(f"checkpoint does not fit {type(model).__name__}: " + "; ".join(problems))


def _listing(what: str, items: list[str]) -> str:
    if not items:
        return ""
    more = f" and {len(items) - _MAX_LISTED} more" if len(items) > _MAX_LISTED else ""
    return f"{len(items)} {what}: {', '.join(items[:_MAX_LISTED])}{more}"


def _hf_tensors_for_saving(
    model: Transformer, adapter: HFAdapter, hf_config: dict
) -> tuple[list[HFTensor], set[str]]:
    """Every HF tensor to write, and the keys of those that are buffers."""
    with torch.device("meta"):
        reference = type(model)(model.config)
    shapes = {name: tuple(t.shape) for name, t in named_state(reference)}
    wanted = list(shapes)
    params = dict(named_state(model))
    missing = [name for name in wanted if name not in params]
    if missing:
        raise ValueError(
            f"to_hf needs the whole model; {_listing('parameters are absent', missing)}"
        )
    buffer_names = {name for name, _ in reference.named_buffers()}
    tensors, buffers = [], set()
    for name in wanted:
        param = params[name]
        if param.is_meta or type(param.data) is not torch.Tensor:
            raise ValueError(
                f"parameter {name} is a {type(param.data).__name__} on {param.device}: "
                "to_hf writes a materialised, unsharded model (gather it first)"
            )
        if tuple(param.shape) != shapes[name]:
            raise ValueError(
                f"parameter {name} has shape {tuple(param.shape)}, the config gives "
                f"{shapes[name]}: to_hf writes an unsharded model (gather expert-parallel or "
                "other shards first)"
            )
        described = adapter.hf_tensors(name, param, hf_config)
        tensors += described
        if name in buffer_names:
            buffers.update(ht.key for ht in described)
    return tensors, buffers


def _standalone(parts: list[HFTensor], dtype: torch.dtype | None) -> torch.Tensor:
    """A CPU tensor owning exactly its own bytes (safetensors refuses shared storage); a fused
    checkpoint tensor is assembled from its views."""
    ht = parts[0]
    if ht.shape is not None:
        if any(p.index is None for p in parts):
            raise ValueError(f"{ht.key} is read from a fused tensor that to_hf cannot write")
        out = torch.empty(ht.shape, dtype=dtype or ht.ours.dtype)
        for part in parts:
            out[part.index] = part.ours.detach().to(device="cpu", dtype=out.dtype)
        if sum(p.ours.numel() for p in parts) != out.numel():
            raise ValueError(f"the views of {ht.key} do not cover its shape {ht.shape}")
        return out
    tensor = (ht.to_hf(ht.ours) if ht.to_hf else ht.ours).detach()
    tensor = tensor.to(device="cpu", dtype=dtype or tensor.dtype).contiguous()
    if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
        tensor = tensor.clone()
    return tensor
