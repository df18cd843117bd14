"""Hugging Face checkpoints in and out, streamed one tensor at a time.

``from_hf`` validates every key, shape and dtype against the model built on the meta device
before it allocates anything, then materialises the model once and copies each checkpoint
tensor into place as it is read (peak memory: the model plus one tensor).

``hf_export`` is the key mapping for writing: our state (whole tensors, or the pieces one rank
holds) as HF keys, each rank's pieces of every HF tensor and the layout transforms of permuted
tensors, ready for ``torch_checkpointing.save_hf``, where every rank writes its own pieces into
the files in place (the app's export; this library does not import torch_checkpointing).
``to_hf`` writes a whole model from one process through the same mapping, into a temporary
folder that is renamed into place only when complete.
"""

from __future__ import annotations

import functools
import math
import os
import shutil
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from .components import Transformer, TransformerConfig, local_chunks
from .config_fields import replace_config
from .family import ModelClass
from .hf_adapter import HFAdapter, HFTensor
from .hf_files import (
    checkpoint_files,
    open_safetensors,
    read_json,
)
from .registry import family_for_hf, family_of

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
}
_INT_DTYPES = {
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
}
"""Integer tensors load into integer buffers only (a hash-routing table)."""
_DTYPE_NAMES = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
_MAX_LISTED = 20


def hf_model_config(
    path: str | os.PathLike,
) -> tuple[ModelClass, TransformerConfig]:
    """The model class and config of the HF checkpoint folder ``path`` (nothing is read but
    ``config.json`` and the tensor names). ``ValueError`` naming an unsupported HF field."""
    _, hf_config, adapter, _ = _open_checkpoint(path)
    return family_for_hf(hf_config.get("model_type")).model_cls, adapter.config_from_hf(hf_config)


def from_hf(
    path: str | os.PathLike,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    config_changes: Mapping[str, Any] | None = None,
) -> Transformer:
    """Our model with the weights of the HF checkpoint folder ``path``.

    Args:
        path: folder with ``config.json`` and ``model.safetensors`` or sharded
            ``*.safetensors`` (with ``model.safetensors.index.json``).
        dtype: dtype of the returned model; floating tensors are converted to it. By default
            the checkpoint's own (``config.json``'s ``dtype``/``torch_dtype``, else that of its
            tensors), and every tensor must already have it.
        device: where the weights are materialised.
        config_changes: fields of the model config to set (``titan_models.replace_config``:
            dotted names, e.g. ``{"max_seq_len": 16384}``); a change of a weight's shape
            fails the checkpoint's validation, naming the tensor.

    Raises:
        ValueError: an HF config feature we do not model (naming the field); missing,
            unexpected, mis-shaped or wrongly typed tensors (naming each key). Nothing is
            allocated before these checks pass.
    """
    root, hf_config, adapter, files = _open_checkpoint(path)
    family = family_for_hf(hf_config.get("model_type"))
    config = adapter.config_from_hf(hf_config)
    if config_changes:
        config = replace_config(config, config_changes)
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
    (a router's selection bias, non-persistent buffers) are left as they are.
    """
    _, hf_config, adapter, files = _open_checkpoint(path)
    family = family_for_hf(hf_config.get("model_type"))
    with torch.device("meta"):
        model = family.model_cls(adapter.config_from_hf(hf_config))
    _validate(model, adapter, files, hf_config, torch.float32, convert=True)
    whole = dict(named_state(model))
    aliases = set(model.state_dict()) - set(whole)  # a tied head: filled with the embedding
    # Buffers no checkpoint holds (a router's token counts): left as they are.
    unsaved = {name for name, _ in model.named_buffers()} - set(model.state_dict())
    for key, value in state.items():
        if key in aliases or key in unsaved:
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
                with open_safetensors(file) as f:
                    transformed = ht.from_hf(f.get_tensor(ht.key))
            target.copy_(transformed[rest])
            continue
        with open_safetensors(file) as f:  # mapped only while this slice is read
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
    flat, rem = divmod(int(view.storage_offset()), inner)
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
    hf_config = read_json(config_file)
    adapter = family_for_hf(hf_config.get("model_type")).hf_adapter
    files = checkpoint_files(root)
    return root, adapter.adapt_to_checkpoint(hf_config, files), adapter, files


@dataclass(frozen=True, slots=True)
class HFExport:
    """A model's state as Hugging Face tensors, for ``torch_checkpointing.save_hf``."""

    tensors: dict[str, Any]
    """HF key -> this process's pieces of that tensor (sharded-tensor protocol: ``global_shape``,
    ``dtype``, ``local_chunks()``; the chunks are views of the state's tensors)."""
    transforms: dict[str, Callable[[torch.Tensor], torch.Tensor]]
    """HF key -> the layout change from our layout to HF's, applied to the whole tensor."""
    config: dict[str, Any]
    """The ``config.json`` to write beside the tensors."""


class _Pieces:
    """One HF tensor's pieces held here, as the sharded-tensor protocol (converted to
    ``dtype`` as they are asked for, so a converted copy lives only while it is written)."""

    __slots__ = ("_chunks", "dtype", "global_shape")

    def __init__(
        self,
        global_shape: tuple[int, ...],
        dtype: torch.dtype,
        chunks: list[tuple[tuple[int, ...], torch.Tensor]],
    ) -> None:
        self.global_shape, self.dtype, self._chunks = global_shape, dtype, chunks

    def local_chunks(self) -> list[tuple[tuple[int, ...], torch.Tensor]]:
        return [(o, c.detach().to(self.dtype)) for o, c in self._chunks]


def hf_export(
    state: Mapping[str, Any], config: TransformerConfig, *, dtype: torch.dtype | None = None
) -> HFExport:
    """Our state as HF tensors: ``state`` maps FQNs to whole tensors or this rank's pieces
    (objects with ``global_shape`` / ``local_chunks()``: flexshard shards, tensor- or
    expert-parallel slices, one pipeline stage's layers); an FQN missing here is another
    rank's. Every rank passes the result to ``torch_checkpointing.save_hf`` and one writes
    ``config`` as ``config.json``::

        export = titan_models.hf_export(state, model.config)
        torch_checkpointing.save_hf(export.tensors, path, transforms=export.transforms)

    ``dtype``: of the written parameters (buffers keep theirs); the parameters' own by default.
    """
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"hf_export: dtype must be a floating torch.dtype, got {dtype!r}")
    family = family_of(config)
    adapter = family.hf_adapter
    hf_config = adapter.config_to_hf(config)
    with torch.device("meta"):
        reference = family.model_cls(config)
    whole = dict(named_state(reference))
    buffers = {name for name, _ in reference.named_buffers()}
    unknown = sorted(set(state) - set(reference.state_dict()) - buffers)
    if unknown:
        raise ValueError(
            f"hf_export: {_listing('keys are not in ' + type(reference).__name__, unknown)}"
        )
    tensors: dict[str, Any] = {}
    transforms: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}
    fused = _fused_tensors(whole, adapter, hf_config)
    stacked: dict[str, list[tuple[tuple[int, ...], torch.Tensor]]] = defaultdict(list)
    param_dtype = None
    for fqn, ours in whole.items():
        if fqn not in state:
            continue
        global_shape, chunks = local_chunks(state[fqn])
        if tuple(global_shape) != tuple(ours.shape):
            raise ValueError(
                f"hf_export: {fqn!r} has global shape {tuple(global_shape)}, the config gives "
                f"{tuple(ours.shape)}"
            )
        own = state[fqn].dtype
        if fqn not in buffers:
            param_dtype = param_dtype or own
        target = own if dtype is None or fqn in buffers else dtype
        for ht in adapter.hf_tensors(fqn, ours, hf_config):
            if ht.shape is not None:  # part i of a fused HF tensor: rows of the stack
                parts = fused[ht.key]
                i = [f for f, _ in parts].index(fqn)
                row = sum(h.ours.shape[0] for _, h in parts[:i])
                stacked[ht.key] += [((row + o[0], *o[1:]), c) for o, c in chunks]
                rows = sum(h.ours.shape[0] for _, h in parts)
                tensors[ht.key] = _Pieces((rows, *ours.shape[1:]), target, stacked[ht.key])
                transforms[ht.key] = functools.partial(_assemble_fused, parts=parts)
                continue
            lead = _leading_index(ht.ours, ours)
            if lead is None:
                raise ValueError(f"{ht.key}: not a whole-trailing-dims view of {fqn!r}")
            k = len(lead)
            pieces = [
                (offset[k:], chunk[tuple(i - o for i, o in zip(lead, offset, strict=False))])
                for offset, chunk in chunks
                if all(o <= i < o + n for i, o, n in zip(lead, offset, chunk.shape, strict=False))
            ]
            tensors[ht.key] = _Pieces(tuple(ht.ours.shape), target, pieces)
            if ht.to_hf is not None:
                transforms[ht.key] = ht.to_hf
    hf_config["torch_dtype"] = str(dtype or param_dtype or torch.float32).removeprefix("torch.")
    return HFExport(tensors=tensors, transforms=transforms, config=hf_config)


def _fused_tensors(
    whole: Mapping[str, torch.Tensor], adapter: HFAdapter, hf_config: dict
) -> dict[str, list[tuple[str, HFTensor]]]:
    """Every fused HF tensor (one that holds several of our tensors, as gpt-oss's
    ``gate_up_proj`` holds ``w_gate`` and ``w_up``) and its parts, in the model's FQN order.

    A fused tensor is exported in a stacked layout: the parts concatenated along their first
    dim (they share the others; parts of one shape make an ``(n * rows, ...)`` stack), so
    each rank's pieces of a part are plain boxes of it, whatever the sharding (experts split
    over ranks, rows over flexshard shards); the transform assembles the HF tensor from the
    whole stack (``_assemble_fused``), on the one rank that rewrites it.
    """
    fused: dict[str, list[tuple[str, HFTensor]]] = defaultdict(list)
    for fqn, ours in whole.items():
        for ht in adapter.hf_tensors(fqn, ours, hf_config):
            if ht.shape is not None:
                fused[ht.key].append((fqn, ht))
    for key, parts in fused.items():
        trailing = {tuple(ht.ours.shape[1:]) for _, ht in parts}
        if any(ht.put is None or ht.ours.dim() == 0 for _, ht in parts) or len(trailing) != 1:
            raise ValueError(
                f"hf_export: {key} is a fused HF tensor this adapter cannot write (every part "
                f"needs a put and the same trailing dims; got "
                f"{sorted(tuple(ht.ours.shape) for _, ht in parts)})"
            )
        assert all(ht.ours.shape == whole[f].shape for f, ht in parts), key  # whole parts
    return dict(fused)


def _assemble_fused(stacked: torch.Tensor, *, parts: list[tuple[str, HFTensor]]) -> torch.Tensor:
    """The fused HF tensor from its parts stacked along dim 0 (see ``_fused_tensors``)."""
    shape = parts[0][1].shape
    assert shape is not None  # a fused tensor's shape (see _fused_tensors)
    full = stacked.new_empty(shape)
    for (_, ht), rows in zip(
        parts, stacked.split([h.ours.shape[0] for _, h in parts]), strict=True
    ):
        assert ht.put is not None  # checked by _fused_tensors
        ht.put(full, rows)
    return full


def to_hf(
    model: Transformer,
    path: str | os.PathLike,
    *,
    max_shard_size: int | str = "5GB",
    dtype: torch.dtype | None = None,
) -> Path:
    """Write ``model`` as an HF checkpoint folder that ``AutoModelForCausalLM`` loads, from
    this process alone: ``hf_export``'s mapping written by ``torch_checkpointing.save_hf`` (the
    writer a sharded model uses from every rank at once), so both name and shard files alike.

    Args:
        path: a folder that does not exist yet (or is empty).
        max_shard_size: bytes per safetensors shard, an int or a string such as ``"5GB"``
            (decimal units) or ``"512MiB"``; a tensor larger than this gets a shard of its own.
        dtype: dtype of the written tensors; the parameters' own by default.

    ``config.json`` is written last: a folder that has one is complete. A failed write removes
    what it wrote (the folder was new or empty), so the same call can simply be run again.
    """
    from torch_checkpointing import parse_size, save_hf

    parse_size(max_shard_size)  # a bad size is refused before anything is written
    root = Path(path)
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        raise ValueError(f"{root} exists and is not an empty folder; to_hf writes a new one")
    _check_whole(model)
    export = hf_export(dict(named_state(model)), model.config, dtype=dtype)
    created = not root.exists()
    try:
        save_hf(
            export.tensors,
            root,
            process_group="self",
            max_shard_size=max_shard_size,
            transforms=export.transforms,
            config=export.config,
        )
    except BaseException:  # the folder was new or empty: whatever is in it now is ours
        if created:
            shutil.rmtree(root, ignore_errors=True)
        elif root.is_dir():
            for child in root.iterdir():
                shutil.rmtree(child) if child.is_dir() else child.unlink()
        raise
    return root


def _declared_dtype(hf_config: dict) -> torch.dtype | None:
    name = hf_config.get("dtype") or hf_config.get("torch_dtype")
    return _DTYPE_NAMES.get(name) if isinstance(name, str) else None


def _first_tensor_dtype(files: dict[str, Path]) -> torch.dtype:
    key, file = next(iter(files.items()))
    with open_safetensors(file) as f:
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
    expected, is_param, is_int = {}, {}, {}
    for fqn, tensor in named_state(model):
        for ht in adapter.hf_tensors(fqn, tensor, hf_config):
            expected[ht.key] = ht.hf_shape()
            is_param[ht.key] = id(tensor) in params
            is_int[ht.key] = not tensor.is_floating_point()
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
        with open_safetensors(file) as f:
            for key in keys:
                piece = f.get_slice(key)
                shape, found = tuple(piece.get_shape()), piece.get_dtype()
                if shape != expected[key]:
                    wrong.append(
                        f"{file.name}: {key}: checkpoint shape {shape}, model shape {expected[key]}"
                    )
                if is_int[key]:
                    if found not in _INT_DTYPES:
                        wrong.append(f"{key}: dtype {found} is not an integer dtype we can load")
                elif found not in _DTYPES:
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


def _check_whole(model: Transformer) -> None:
    """``to_hf`` takes a materialised model holding every tensor whole."""
    with torch.device("meta"):
        reference = cast(ModelClass, type(model))(model.config)  # a family's class
    shapes = {name: tuple(t.shape) for name, t in named_state(reference)}
    params = dict(named_state(model))
    missing = [name for name in shapes if name not in params]
    if missing:
        raise ValueError(
            f"to_hf needs the whole model; {_listing('parameters are absent', missing)}"
        )
    for name, shape in shapes.items():
        param = params[name]
        if param.is_meta or type(param.data) is not torch.Tensor:
            raise ValueError(
                f"parameter {name} is a {type(param.data).__name__} on {param.device}: "
                "to_hf writes a materialised, unsharded model (gather it first)"
            )
        if tuple(param.shape) != shape:
            raise ValueError(
                f"parameter {name} has shape {tuple(param.shape)}, the config gives "
                f"{shape}: to_hf writes an unsharded model (gather expert-parallel or "
                "other shards first)"
            )
