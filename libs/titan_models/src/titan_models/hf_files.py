"""The files of a Hugging Face safetensors checkpoint: which file holds each tensor (the
index, one file or several, never a path outside the folder), opened with errors that name
the file; and the shard-size strings of exports."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from safetensors import safe_open

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def checkpoint_files(root: Path) -> dict[str, Path]:
    """Every tensor key of the checkpoint in ``root`` and the file holding it."""
    index = root / INDEX_FILE
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index} has no weight_map object")
        inside = root.resolve()
        files = {}
        for key, name in weight_map.items():
            file = root / str(name)
            if Path(str(name)).is_absolute() or not file.resolve().is_relative_to(inside):
                raise ValueError(
                    f"{index}: weight_map[{key!r}] = {name!r} is outside the checkpoint folder"
                )
            files[key] = file
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
        with open_safetensors(file) as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if key in files:
                    raise ValueError(f"tensor {key!r} is in both {files[key].name} and {file.name}")
                files[key] = file
    return files


def read_json(file: Path) -> dict:
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{file} is not a readable JSON file ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{file} must hold a JSON object, got {type(data).__name__}")
    return data


def open_safetensors(file: Path) -> Any:
    """``safe_open`` whose failure (a truncated or corrupt file) names the file."""
    try:
        return safe_open(file, framework="pt")
    except Exception as e:  # safetensors raises its own SafetensorError
        raise ValueError(f"{file} is not a readable safetensors file ({e})") from None
