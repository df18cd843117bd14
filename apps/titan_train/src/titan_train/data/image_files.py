"""Image-text samples from local files through HF ``datasets`` (its ``Image`` feature decodes).

``data.paths`` is either one folder, read as a ``datasets`` ``imagefolder`` (the images plus a
``metadata.jsonl`` / ``metadata.csv`` whose ``file_name`` column names each image and whose
other columns hold the question and the answer), or json / jsonl / parquet files whose image
column holds a path (relative to the data files' folder, or absolute) or encoded bytes.
Records are dealt to the validation split by index (every ``1 / validation_fraction``-th), the
rest to training, then to data-parallel ranks in turn; epochs repeat the same order.

Images stay encoded until a sample is used, so skipping to a resume point decodes nothing, and
an image that cannot be decoded is an error naming its record and file (or a counted skip).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from titan_train.data.file_records import FORMATS, in_validation


@dataclass(frozen=True, slots=True)
class ImageRecord:
    """One record: its image, still encoded, and its question and answer."""

    encoded: dict[str, Any]
    """``{"path": ..., "bytes": ...}`` as ``datasets.Image(decode=False)`` gives it."""
    question: str
    """The question text."""
    answer: str
    """Its answer."""

    @property
    def image(self) -> Any:
        """The decoded ``PIL.Image.Image`` (``datasets.Image`` decoding; raises if corrupt)."""
        import datasets

        return datasets.Image().decode_example(self.encoded)


class ImageFilesSource:
    """Records of a local image-text dataset, of one split, for one data-parallel rank."""

    kind = "image_files"

    def __init__(
        self,
        *,
        paths: tuple[str, ...],
        split: Literal["train", "validation"],
        image_field: str = "image",
        question_field: str = "question",
        answer_field: str = "answer",
        validation_fraction: float = 0.01,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        """Checks the paths, the fields of the first record and that this rank's split holds a
        record (``ValueError`` naming the field and value), before any sample is made."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
        self.paths, self.split = paths, split
        self.fields = (image_field, question_field, answer_field)
        self.validation_fraction, self.rank, self.world_size = validation_fraction, rank, world_size
        self._format, self._root = _check_paths(paths)
        first = next(self._records(), None)
        if first is None:
            raise ValueError(f"data.paths={list(paths)}: the dataset holds no records")
        self._record(first, 0)
        if next(self._mine(), None) is None:
            raise ValueError(
                f"data.paths={list(paths)}: no {split} record for data-parallel rank {rank} of "
                f"{world_size} (data.validation_fraction={validation_fraction}); add records"
            )

    def samples(self, start: int = 0) -> Iterator[tuple[str, ImageRecord]]:
        """``(name, record)`` of this rank's split from its ``start``-th sample on (endless:
        epochs repeat the same order)."""
        seen = 0
        for _ in itertools.count():
            for name, record in self._mine():
                if seen >= start:
                    yield name, record
                seen += 1

    def _mine(self) -> Iterator[tuple[str, ImageRecord]]:
        in_split = (
            (i, rec)
            for i, rec in enumerate(self._records())
            if in_validation(i, self.validation_fraction) == (self.split == "validation")
        )
        for i, rec in itertools.islice(in_split, self.rank, None, self.world_size):
            record = self._record(rec, i)
            yield f"record {i} ({record.encoded.get('path') or 'inline image'})", record

    def _records(self) -> Iterator[dict[str, Any]]:
        import datasets

        if self._format == "imagefolder":
            ds = datasets.load_dataset(
                "imagefolder", data_dir=self.paths[0], split="train", streaming=True
            )
        else:
            ds = datasets.load_dataset(
                self._format, data_files=list(self.paths), split="train", streaming=True
            )
        image_field = self.fields[0]
        if image_field not in (ds.column_names or [image_field]):
            raise ValueError(
                f"data.image_field={image_field!r} is not a column of data.paths="
                f"{list(self.paths)} (columns: {ds.column_names})"
            )
        return iter(ds.cast_column(image_field, datasets.Image(decode=False)))

    def _record(self, rec: dict[str, Any], index: int) -> ImageRecord:
        image_field, question_field, answer_field = self.fields
        for field, name in ((question_field, "question_field"), (answer_field, "answer_field")):
            if not isinstance(rec.get(field), str):
                raise ValueError(
                    f"data.{name}={field!r}: record {index} has no text there (fields: "
                    f"{sorted(rec)})"
                )
        encoded = dict(rec.get(image_field) or {})
        path = encoded.get("path")
        if encoded.get("bytes") is None:
            if path is None:
                raise ValueError(f"data.image_field={image_field!r}: record {index} has no image")
            if not Path(path).is_absolute():
                encoded["path"] = str(self._root / path)
        return ImageRecord(encoded, rec[question_field], rec[answer_field])


def _check_paths(paths: tuple[str, ...]) -> tuple[str, Path]:
    """The ``datasets`` builder for ``paths`` and the folder relative image paths start in."""
    if len(paths) == 1 and Path(paths[0]).is_dir():
        return "imagefolder", Path(paths[0])
    formats, folders = set(), set()
    for p in paths:
        path = Path(p)
        if not path.is_file():
            raise ValueError(
                f"data.paths: {p!r} does not exist or is not a file (image_files takes one "
                "folder or json/jsonl/parquet files)"
            )
        if FORMATS.get(path.suffix) not in ("json", "parquet"):
            raise ValueError(
                f"data.paths: {p!r} has suffix {path.suffix!r}; allowed for image_files: a "
                "folder, or ['.json', '.jsonl', '.parquet']"
            )
        formats.add(FORMATS[path.suffix])
        folders.add(path.resolve().parent)
    if len(formats) != 1:
        raise ValueError(f"data.paths mixes formats {sorted(formats)}; use one format per run")
    if len(folders) != 1:
        raise ValueError(
            f"data.paths: image_files data files must share one folder (relative image paths "
            f"start there), got {sorted(map(str, folders))}"
        )
    return formats.pop(), folders.pop()
