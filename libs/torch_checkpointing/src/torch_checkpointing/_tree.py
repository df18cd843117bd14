"""Flattening a state into tensor entries plus a safe (JSON, never pickle) skeleton.

A top-level item (``state["model"]``) becomes a *tree*: a JSON value in which every tensor
is replaced by a reference ``{"$tensor": key}`` and every other value is encoded with a tag
that keeps its Python type::

    None, bool, int, str, finite float   as JSON
    non-finite float                      {"$float": "nan" | "inf" | "-inf"}
    dict (any hashable supported keys)    {"$dict": [[key, value], ...]}   (order kept)
    list / tuple / set / frozenset        {"$list": [...]} / {"$tuple": [...]} / {"$set": ...}
    bytes                                 {"$bytes": base64}
    complex                               {"$complex": [re, im]}
    torch.dtype / torch.device / Size     {"$dtype": "float32"} / {"$device": "cpu"} / {"$size"}
    object with state_dict()              {"$stateful": <its state_dict's tree>}

Decoding builds only these types; nothing in a checkpoint can name a class or run code.
Tensor keys are the dotted path inside the item (``"layers.0.weight"``, ``"state.0.exp_avg"``).
"""

from __future__ import annotations

import base64
import math
import sys
from dataclasses import dataclass, field
from typing import Any

import torch

from . import _format as fmt

_SUPPORTED = (
    "torch.Tensor, DTensor, sharded tensors (global_shape, dtype, local_chunks()), objects "
    "with state_dict()/load_state_dict(), dict, list, tuple, set, frozenset, str, int, float, "
    "bool, None, bytes, complex, torch.dtype, torch.device, torch.Size"
)


def is_dtensor(obj: Any) -> bool:
    # A DTensor cannot exist before torch.distributed.tensor is imported, and importing it
    # costs seconds: a process that never made one does not pay for asking.
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(obj, module.DTensor)


def is_sharded(obj: Any) -> bool:
    """The sharded-tensor protocol of docs/design.md (anything but a torch.Tensor)."""
    return (
        not isinstance(obj, torch.Tensor)
        and not isinstance(obj, type)
        and callable(getattr(obj, "local_chunks", None))
        and hasattr(obj, "global_shape")
        and hasattr(obj, "dtype")
    )


def is_tensor_like(obj: Any) -> bool:
    return isinstance(obj, torch.Tensor) or is_sharded(obj)


def is_stateful(obj: Any) -> bool:
    return (
        not isinstance(obj, dict | type | torch.Tensor)
        and callable(getattr(obj, "state_dict", None))
        and callable(getattr(obj, "load_state_dict", None))
    )


class PerRank:
    """Marks a top-level item whose value differs per rank (RNG states, data-loader position).

    ``state = {"model": model, "rng": PerRank(rng_holder)}``. Every rank writes its own copy
    into its own file and loads its own copy back; loading needs the same world size. Without
    this marker, plain tensors and values count as replicated: one rank writes them.
    """

    def __init__(self, value: Any) -> None:
        if isinstance(value, PerRank):
            value = value.value
        self.value = value

    def __repr__(self) -> str:
        return f"PerRank({self.value!r})"


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in fmt.DTYPES:
        raise TypeError(f"dtype {dtype} is not supported; supported: {sorted(fmt.DTYPES)}")
    return name


def torch_dtype(name: str) -> torch.dtype:
    if name not in fmt.DTYPES:
        raise ValueError(f"unknown dtype {name!r} in checkpoint")
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"dtype {name!r} is not available in this torch")
    return dt


@dataclass(slots=True)
class Leaf:
    """One tensor-like entry of an item."""

    key: str
    obj: Any
    kind: str  # "tensor" | "dtensor" | "sharded"
    dtype: str
    shape: tuple[int, ...]

    def describe(self) -> str:
        return f"{self.kind}[{self.dtype}, {list(self.shape)}]"


@dataclass(slots=True)
class Flat:
    """An item flattened: its tree, its tensor entries by key, and (for load) the state dicts
    obtained from stateful objects, by ``id``."""

    item: str
    per_rank: bool
    tree: Any
    leaves: dict[str, Leaf] = field(default_factory=dict)
    sds: dict[int, Any] = field(default_factory=dict)


def display(item: str, key: str) -> str:
    return f"{item}.{key}" if key else item


def as_leaf(obj: Any, key: str, item: str, per_rank: bool) -> Leaf:
    where = display(item, key)
    if is_dtensor(obj):
        if per_rank:
            raise TypeError(f"{where}: a PerRank item holds plain tensors only, not DTensor")
        return Leaf(key, obj, "dtensor", dtype_name(obj.dtype), tuple(obj.shape))
    if isinstance(obj, torch.Tensor):
        if obj.device.type == "meta":
            raise ValueError(f"{where}: tensor is on the meta device and has no data to save")
        if obj.is_sparse or obj.layout != torch.strided:
            raise TypeError(f"{where}: only strided (dense) tensors are supported")
        return Leaf(key, obj, "tensor", dtype_name(obj.dtype), tuple(obj.shape))
    if per_rank:
        raise TypeError(f"{where}: a PerRank item holds plain tensors only, not sharded tensors")
    shape = tuple(int(s) for s in obj.global_shape)
    if not isinstance(obj.dtype, torch.dtype):
        raise TypeError(f"{where}: sharded tensor dtype must be a torch.dtype, got {obj.dtype!r}")
    return Leaf(key, obj, "sharded", dtype_name(obj.dtype), shape)


def flatten(item: str, value: Any, *, record_sds: bool = False) -> Flat:
    per_rank = isinstance(value, PerRank)
    if per_rank:
        value = value.value
    flat = Flat(item, per_rank, None)

    def key_part(k: Any) -> str:
        return k if isinstance(k, str) else repr(k) if isinstance(k, tuple) else str(k)

    def enc(x: Any, parts: list[str]) -> Any:
        if is_tensor_like(x):
            key = ".".join(parts)
            if key in flat.leaves:
                raise ValueError(
                    f"{display(item, key)}: two entries of item {item!r} flatten to the same "
                    "key; rename one of them"
                )
            flat.leaves[key] = as_leaf(x, key, item, per_rank)
            return {"$tensor": key}
        if x is None or isinstance(x, bool | int | str):
            return x
        if isinstance(x, float):
            return x if math.isfinite(x) else {"$float": repr(x)}
        if isinstance(x, dict):
            return {
                "$dict": [[enc_key(k, parts), enc(v, [*parts, key_part(k)])] for k, v in x.items()]
            }
        if isinstance(x, list):
            return {"$list": [enc(v, [*parts, str(i)]) for i, v in enumerate(x)]}
        if isinstance(x, tuple):
            return {"$tuple": [enc(v, [*parts, str(i)]) for i, v in enumerate(x)]}
        if isinstance(x, set | frozenset):
            tag = "$set" if isinstance(x, set) else "$frozenset"
            return {tag: [enc_key(v, parts) for v in x]}
        if isinstance(x, bytes | bytearray):
            return {"$bytes": base64.b64encode(bytes(x)).decode()}
        if isinstance(x, complex):
            return {"$complex": [enc(x.real, parts), enc(x.imag, parts)]}
        if isinstance(x, torch.dtype):
            return {"$dtype": str(x).removeprefix("torch.")}
        if isinstance(x, torch.device):
            return {"$device": str(x)}
        if is_stateful(x):
            sd = x.state_dict()
            if record_sds:
                flat.sds[id(x)] = sd
            return {"$stateful": enc(sd, parts)}
        raise TypeError(
            f"cannot save {display(item, '.'.join(parts))}: unsupported type "
            f"{type(x).__module__}.{type(x).__qualname__}; supported: {_SUPPORTED}"
        )

    def enc_key(k: Any, parts: list[str]) -> Any:
        if is_tensor_like(k) or isinstance(k, dict | list | set):
            raise TypeError(
                f"cannot save {display(item, '.'.join(parts))}: dict key / set element "
                f"{type(k).__name__} is not supported"
            )
        return enc(k, parts)

    if isinstance(value, torch.Size):
        flat.tree = {"$size": list(value)}
    else:
        flat.tree = enc(value, [])
    return flat


def decode(node: Any) -> Any:
    """The Python value of an encoded non-tensor tree (tensor references are an error)."""
    if node is None or isinstance(node, bool | int | float | str):
        return node
    if not isinstance(node, dict) or len(node) != 1:
        raise ValueError(f"malformed checkpoint tree node {node!r:.80}")
    ((tag, v),) = node.items()
    if tag == "$dict":
        return {decode(k): decode(x) for k, x in v}
    if tag == "$list":
        return [decode(x) for x in v]
    if tag == "$tuple":
        return tuple(decode(x) for x in v)
    if tag == "$set":
        return {decode(x) for x in v}
    if tag == "$frozenset":
        return frozenset(decode(x) for x in v)
    if tag == "$float":
        return float(v)
    if tag == "$bytes":
        return base64.b64decode(v)
    if tag == "$complex":
        return complex(decode(v[0]), decode(v[1]))
    if tag == "$dtype":
        return torch_dtype(v)
    if tag == "$device":
        return torch.device(v)
    if tag == "$size":
        return torch.Size(v)
    if tag == "$stateful":
        return decode(v)
    if tag == "$tensor":
        raise ValueError(f"tensor {v!r} has no target to load into")
    raise ValueError(f"unknown tag {tag!r} in checkpoint tree")


def tree_tensor_keys(node: Any, out: set[str] | None = None) -> set[str]:
    out = set() if out is None else out
    if isinstance(node, dict):
        for tag, v in node.items():
            if tag == "$tensor":
                out.add(v)
            elif tag == "$dict":
                for _, x in v:
                    tree_tensor_keys(x, out)
            elif tag in ("$list", "$tuple"):
                for x in v:
                    tree_tensor_keys(x, out)
            elif tag == "$stateful":
                tree_tensor_keys(v, out)
    return out


def fill(target: Any, node: Any, flat: Flat) -> Any:
    """Apply a checkpoint tree to ``target`` in place where possible; returns the new value.

    Tensors were already filled in place; here non-tensor values are restored, containers are
    updated in place, and stateful objects get ``load_state_dict`` with their filled state.
    """
    if isinstance(node, dict) and len(node) == 1:
        ((tag, v),) = node.items()
        if tag == "$tensor" and is_tensor_like(target):
            return target
        if tag == "$stateful" and is_stateful(target) and id(target) in flat.sds:
            sd = fill(flat.sds[id(target)], v, flat)
            target.load_state_dict(sd)
            return target
        if tag == "$dict" and isinstance(target, dict):
            for k_node, x in v:
                k = decode(k_node)
                if k in target:
                    target[k] = fill(target[k], x, flat)
                elif not tree_tensor_keys(x):  # tensors absent from the target are skipped
                    target[k] = decode(x)
            return target
        if tag == "$list" and isinstance(target, list) and len(target) == len(v):
            for i, x in enumerate(v):
                target[i] = fill(target[i], x, flat)
            return target
        if tag == "$tuple" and isinstance(target, tuple) and len(target) == len(v):
            values = [fill(t, x, flat) for t, x in zip(target, v, strict=True)]
            if hasattr(target, "_fields"):  # namedtuple
                return type(target)(*values)
            return type(target)(values) if type(target) is not tuple else tuple(values)
        if tag == "$stateful":
            return decode(v)
    if tree_tensor_keys(node):  # (strict=False) a saved tensor where the target has none
        return target
    return decode(node)
