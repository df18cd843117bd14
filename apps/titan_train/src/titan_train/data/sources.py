"""Document sources: the built-in arithmetic corpus and local files through HF ``datasets``.

A source yields the documents of one split (train / validation) for one data-parallel rank,
in a fixed order, starting anywhere: that is all exact resume needs.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Literal

from titan_train.data.arithmetic import arithmetic_problem
from titan_train.data.file_records import FileRecords, Split, in_validation


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
        streaming: bool = False,
        shuffle_buffer: int = 10_000,
    ) -> None:
        """``slip_rate``, ``reverse_answer``: the arithmetic corpus's options (see
        ``arithmetic.arithmetic_problem``); the defaults give the clean corpus.
        ``streaming``, ``shuffle_buffer``: how files are dealt to ranks and shuffled (see
        ``file_records``)."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
        if not 0.0 <= slip_rate <= 1.0:
            raise ValueError(f"data.arithmetic_slip_rate={slip_rate} must be in [0, 1]")
        if streaming and kind != "files":
            raise ValueError(
                f"data.streaming needs files to stream: data.source={kind!r} is generated; use "
                "data.source='files' or 'chat' with data.paths"
            )
        self.kind, self.split, self.rank, self.world_size = kind, split, rank, world_size
        self.seed, self.validation_fraction = seed, validation_fraction
        self.paths, self.text_field = paths, text_field
        self.slip_rate, self.reverse_answer = slip_rate, reverse_answer
        self.files: FileRecords | None = None
        """The files' records (``kind="files"``)."""
        if kind == "files":
            self.files = FileRecords(
                paths,
                seed=seed,
                shuffle_buffer=shuffle_buffer,
                rank=rank,
                world_size=world_size,
                streaming=streaming,
            )
            self._check_field()

    def documents(self, *, start: int = 0, epoch: int = 0) -> Iterator[str]:
        """This rank's documents of ``epoch`` from its ``start``-th one on, then end."""
        if self.files is not None:
            records = self.files.split(self.split, self.validation_fraction, epoch=epoch)
            return (self._text(rec) for rec in itertools.islice(records, start, None))
        # Arithmetic: endless, so the epoch never changes; the index decides the split.
        in_split = (
            arithmetic_problem(
                self.seed, i, slip_rate=self.slip_rate, reverse_answer=self.reverse_answer
            ).text
            for i in itertools.count()
            if in_validation(i, self.validation_fraction) == (self.split == "validation")
        )
        mine = itertools.islice(in_split, self.rank, None, self.world_size)
        return itertools.islice(mine, start, None)

    def check_not_empty(self) -> None:
        """A ``ValueError`` saying why, when this rank's split of the files holds no document
        (a job would otherwise fail at its first step, naming no cause)."""
        if self.files is None or next(self.documents(), None) is not None:
            return
        total, held_out = self.files.count(self.validation_fraction)
        lines = " (a .txt file's record is one line)" if self.files.format == "text" else ""
        every = max(1, round(1 / self.validation_fraction)) if self.validation_fraction else 0
        held = (
            f"data.validation_fraction={self.validation_fraction} holds out one record in "
            f"{every} for validation, the first one included: {held_out} of them"
            if every
            else "none is held out for validation"
        )
        ranks, fewer = "", ""
        if self.world_size > 1:
            dealt = "whole files" if self.files.streaming else f"one record in {self.world_size}"
            ranks = f"; each of the {self.world_size} data-parallel ranks gets {dealt}"
            fewer = " or use fewer data-parallel ranks"
        raise ValueError(
            f"data.paths={list(self.paths)}: the {self.split} split of data-parallel rank "
            f"{self.rank} holds no documents: {'its' if self.files.streaming else 'the'} files "
            f"hold {total} record(s){lines} and {held}{ranks}; add data (more records or "
            f"files), lower data.validation_fraction (0 keeps every record for training){fewer}"
        )

    def _text(self, record: dict) -> str:
        value = record.get(self.text_field)
        if not isinstance(value, str):
            assert self.files is not None
            raise ValueError(
                f"data.text_field={self.text_field!r}: {self.files.name(record)} has no text "
                f"there (fields: {self.files.fields(record)})"
            )
        return value

    def _check_field(self) -> None:
        assert self.files is not None
        first = self.files.first()
        if first is None:
            raise ValueError(f"data.paths={list(self.paths)}: the files hold no records")
        self._text(first)
