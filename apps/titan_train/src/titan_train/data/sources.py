"""Document sources: the built-in arithmetic corpus and local files through HF ``datasets``.

A source yields the documents of one split (train / validation) for one data-parallel rank,
in a fixed order, starting anywhere: that is all exact resume needs.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

from titan_train.data.arithmetic import arithmetic_problem

Split = Literal["train", "validation"]

FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".txt": "text"}


INDEX = "__titan_record_index__"
"""The field a record's position in the files carries through an epoch's shuffle."""


def in_validation(index: int, fraction: float) -> bool:
    # Every k-th document is held out, k = 1 / fraction: deterministic and cheap to test.
    return fraction > 0 and index % max(1, round(1 / fraction)) == 0


class DocumentSource:
    """Documents of one split for one rank of ``world_size`` data-parallel ranks."""

    def __init__(
        self,
        *,
        kind: Literal["arithmetic", "files"],
        split: Split,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        validation_fraction: float = 0.01,
        paths: tuple[str, ...] = (),
        text_field: str = "text",
        slip_rate: float = 0.0,
        reverse_answer: bool = False,
    ) -> None:
        """``slip_rate``, ``reverse_answer``: the arithmetic corpus's options (see
        ``arithmetic.arithmetic_problem``); the defaults give the clean corpus."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
        if not 0.0 <= slip_rate <= 1.0:
            raise ValueError(f"data.arithmetic_slip_rate={slip_rate} must be in [0, 1]")
        self.kind, self.split, self.rank, self.world_size = kind, split, rank, world_size
        self.seed, self.validation_fraction = seed, validation_fraction
        self.paths, self.text_field = paths, text_field
        self.slip_rate, self.reverse_answer = slip_rate, reverse_answer
        if kind == "files":
            self._format = check_files(paths)
            self._check_field()

    def documents(self, *, start: int = 0, epoch: int = 0) -> Iterator[str]:
        """This rank's documents of ``epoch`` from its ``start``-th one on, then end."""
        in_split = (
            text
            for i, text in self._all_documents(epoch)
            if in_validation(i, self.validation_fraction) == (self.split == "validation")
        )
        mine = itertools.islice(in_split, self.rank, None, self.world_size)
        return itertools.islice(mine, start, None)

    def _all_documents(self, epoch: int) -> Iterator[tuple[int, str]]:
        """``(index in the corpus, text)``: the index, not the position in an epoch's
        shuffled order, decides the split, so validation documents stay out of every epoch."""
        if self.kind == "arithmetic":
            # Infinite: epochs never end, so the epoch only reseeds nothing.
            return (
                (
                    i,
                    arithmetic_problem(
                        self.seed, i, slip_rate=self.slip_rate, reverse_answer=self.reverse_answer
                    ).text,
                )
                for i in itertools.count()
            )
        return ((rec.pop(INDEX), self._text(rec)) for rec in self._records(epoch))

    def _records(self, epoch: int) -> Iterator[dict]:
        return stream_records(self._format, self.paths, seed=self.seed, epoch=epoch)

    def _text(self, record: dict) -> str:
        value = record.get(self.text_field)
        if not isinstance(value, str):
            raise ValueError(
                f"data.text_field={self.text_field!r}: record has no text there "
                f"(fields: {sorted(record)})"
            )
        return value

    def _check_field(self) -> None:
        first = next(self._records(0), None)
        if first is None:
            raise ValueError(f"data.paths={list(self.paths)}: the files hold no records")
        self._text(first)


def stream_records(fmt: str, paths: tuple[str, ...], *, seed: int, epoch: int) -> Iterator[dict]:
    """The records of local data files, streamed by HF ``datasets`` (nothing loaded whole),
    each with its index in the files under ``INDEX`` (taken before epoch ``epoch``'s shuffle,
    seeded by ``seed + epoch``; epoch 0 keeps the files' order)."""
    import datasets

    ds = datasets.load_dataset(fmt, data_files=list(paths), split="train", streaming=True)
    ds = ds.map(lambda _, i: {INDEX: i}, with_indices=True)  # before any shuffle
    if epoch:
        ds = ds.shuffle(seed=seed + epoch, buffer_size=10_000)
    return iter(ds)


def check_files(paths: tuple[str, ...]) -> str:
    formats = set()
    for p in paths:
        path = Path(p)
        if not path.is_file():
            raise ValueError(f"data.paths: {p!r} does not exist or is not a file")
        if path.suffix not in FORMATS:
            raise ValueError(
                f"data.paths: {p!r} has suffix {path.suffix!r}; allowed: {sorted(FORMATS)}"
            )
        formats.add(FORMATS[path.suffix])
    if len(formats) != 1:
        raise ValueError(f"data.paths mixes formats {sorted(formats)}; use one format per run")
    return formats.pop()
