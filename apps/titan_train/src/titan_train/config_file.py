"""``--config FILE``: fields of a ``JobConfig`` from a TOML or JSON file.

The file holds the config's sections as tables (``[training]`` / ``"training": {...}``) and
top-level fields as keys; any subset of fields may be given. A run's ``config.json`` is such
a file (its ``history`` is the record of past resumes and is skipped), so
``titan-train --config runs/x/config.json`` runs that job again. Values are checked against
the field types (a wrong key or type is one error naming the field); the command line
overrides the file.
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, Literal

from titan_train.config import JobConfig

if typing.TYPE_CHECKING:
    import titan_models

SKIPPED_KEYS = ("history",)
"""Top-level keys of a run's ``config.json`` that are records, not fields."""


def apply_config_file(cfg: JobConfig, path: str | Path) -> JobConfig:
    """``cfg`` with the fields of the TOML or JSON file ``path`` set (a new object); a
    ``ValueError`` naming the file and the field when it cannot be read or does not fit."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ValueError(f"--config {path}: cannot be read ({e.strerror or e})") from None
    try:
        data = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    except (ValueError, tomllib.TOMLDecodeError) as e:
        kind = "JSON" if path.suffix == ".json" else "TOML"
        raise ValueError(f"--config {path}: not valid {kind} ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: must hold a table of fields, got {type(data).__name__}")
    data = {k: v for k, v in data.items() if k not in SKIPPED_KEYS}
    return _merge(cfg, data, prefix="", path=path)


def _merge(obj: Any, data: dict[str, Any], *, prefix: str, path: Path) -> Any:
    hints = typing.get_type_hints(type(obj))
    fields = {f.name for f in dataclasses.fields(obj)}
    changes = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if key not in fields:
            raise ValueError(
                f"--config {path}: {name} is not a field; fields here: {', '.join(sorted(fields))}"
            )
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise ValueError(
                    f"--config {path}: {name} must be a table of fields, got {value!r}"
                )
            changes[key] = _merge(current, value, prefix=f"{name}.", path=path)
        else:
            try:
                changes[key] = coerce(value, hints[key], name)
            except ValueError as e:
                raise ValueError(f"--config {path}: {e}") from None
    return dataclasses.replace(obj, **changes)


def model_config_changes(
    config: titan_models.TransformerConfig, entries: tuple[str, ...]
) -> dict[str, Any]:
    """``model.config`` entries (``"max_seq_len=16384"``, ``"rope.theta=1e6"``) as typed
    values for ``titan_models.replace_config``. A value is read as JSON when it parses
    (``16384``, ``1e6``, ``true``, ``null``, ``[1, 2]``), else as a string; each is checked
    against the field's type. ``ValueError`` naming the entry."""
    import titan_models

    fields = titan_models.config_field_types(config)
    changes: dict[str, Any] = {}
    for entry in entries:
        key, sep, text = entry.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"model.config entry {entry!r} must read 'field=value'")
        if key not in fields:
            raise ValueError(
                f"model.config {key!r} is not a field of {type(config).__name__}; fields: "
                f"{', '.join(sorted(fields))}"
            )
        try:
            value = json.loads(text)
        except ValueError:
            value = text
        changes[key] = coerce(value, fields[key], f"model.config {key}")
    return changes


def coerce(value: Any, hint: Any, name: str) -> Any:
    """``value`` as the field type ``hint`` (lists become tuples; ints are floats where a
    float is wanted), or a ``ValueError`` naming the field."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        for option in args:
            try:
                return coerce(value, option, name)
            except ValueError:
                continue
    elif origin is Literal:
        if value in args:
            return value
    elif origin is tuple:
        if isinstance(value, (list, tuple)):
            if len(args) == 2 and args[1] is Ellipsis:
                return tuple(coerce(v, args[0], name) for v in value)
            if len(value) == len(args):
                return tuple(coerce(v, t, name) for v, t in zip(value, args, strict=True))
    elif hint is type(None):
        if value is None:
            return None
    elif hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif hint is str and isinstance(value, str):
        return value
    raise ValueError(f"{name}={value!r} must be {_describe(hint)}")


def _describe(hint: Any) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in args)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return f"a list of {_describe(args[0])}"
        return f"a list of {len(args)}: " + ", ".join(_describe(a) for a in args)
    names = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
    return names.get(hint, "null" if hint is type(None) else str(hint))
