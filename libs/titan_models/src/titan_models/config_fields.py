"""Set any field of a model config by its dotted name (``max_seq_len``, ``rope.theta``).

A config is a tree of frozen dataclasses (``Llama3Config`` holds a ``RopeConfig``);
``replace_config`` rebuilds the branches a change touches, so each dataclass's own
``__post_init__`` validates the new values. ``config_field_types`` lists the settable leaves
with their annotated types, for callers that parse values from text (a CLI).
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from typing import Any

__all__ = ["config_field_types", "replace_config"]


def config_field_types(config: Any) -> dict[str, Any]:
    """Every settable field of ``config`` by dotted name, with its type annotation; the
    fields of a nested config (set or not) appear as ``outer.inner``, and an optional nested
    config also under its own name (``rope.scaling``: set it to ``None`` to turn it off)."""
    hints = typing.get_type_hints(type(config))
    out: dict[str, Any] = {}
    for f in dataclasses.fields(config):
        if not f.init:
            continue
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            out.update({f"{f.name}.{k}": t for k, t in config_field_types(value).items()})
            if type(None) in typing.get_args(hints[f.name]):
                out[f.name] = hints[f.name]
        else:
            out[f.name] = hints[f.name]
    return out


def replace_config(config: Any, changes: Mapping[str, Any]) -> Any:
    """``config`` with the dotted fields of ``changes`` set, validated by the config classes.

    ``ValueError`` naming the field for an unknown name (listing the known ones) or a value
    the config class rejects; ``config`` itself is never modified.
    """
    known = config_field_types(config)
    unknown = sorted(k for k in changes if k not in known)
    if unknown:
        raise ValueError(
            f"unknown {type(config).__name__} field(s) {unknown}; known: {sorted(known)}"
        )
    clash = sorted(k for k in changes if any(o.startswith(f"{k}.") for o in changes))
    if clash:
        raise ValueError(f"{clash} set together with fields inside them: set one or the other")
    return _replace(config, dict(changes))


def _replace(config: Any, changes: dict[str, Any]) -> Any:
    direct: dict[str, Any] = {}
    nested: dict[str, dict[str, Any]] = {}
    for key, value in changes.items():
        head, _, rest = key.partition(".")
        if rest:
            nested.setdefault(head, {})[rest] = value
        else:
            direct[key] = value
    for head, sub in nested.items():
        direct[head] = _replace(getattr(config, head), sub)
    try:
        return dataclasses.replace(config, **direct)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{type(config).__name__}: {e}") from None
