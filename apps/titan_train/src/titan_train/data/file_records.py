"""Records of local data files (json / jsonl / parquet / txt) streamed by HF ``datasets``.

Every record keeps a stable name, ``(file, row)``: its file's position in ``data.paths`` and
its row in that file, whatever order an epoch reads it in. The train / validation split is
decided on that name (``in_validation(file + row)``: every k-th record of each file,
staggered across files so that many small files do not all give their first record), so
a validation record stays out of every shuffled epoch.

Two ways to deal records to the ``world_size`` data-parallel ranks:

- by record (the default): every rank reads every file and keeps every ``world_size``-th
  record of its split; the first epoch keeps the files' order, later ones are shuffled.
- by file (``streaming=True``): ``datasets.distributed.split_dataset_by_node`` gives each
  rank whole files (file ``i`` of the epoch's order goes to rank ``i % world_size``), so a
  rank opens only its own files; every epoch, the first one included, shuffles the file
  order and the records (through a buffer) with a generator seeded by ``(seed, epoch)``.
  Fewer files than ranks is an error: a rank would get nothing. A rank's epoch is as long as
  its files (each rank starts its next epoch on its own; packing keeps the steps in
  lockstep): files of similar sizes, a multiple of the ranks, keep the ranks even. At start
  every rank checks every file's first and last 4 bytes, and reads the first file's schema
  and first record to check the fields; the records it trains on come from its own files.

Either way an epoch's order is a pure function of ``(seed, epoch, rank, world_size)``, so a
position is a count of records consumed in an epoch and resuming re-reads (without
tokenizing) this rank's records of the epoch up to it. HF's own
``IterableDataset.state_dict`` is not used: it drops the shuffle buffer's content on resume
(``datasets`` documents this), which would change the stream.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".txt": "text"}
"""File suffix -> HF ``datasets`` builder."""

Split = Literal["train", "validation"]

_FILE, _ROW = "__titan_file__", "__titan_row__"
"""Fields the stream adds to a record: its file's position in ``paths`` and its row there."""


def in_validation(index: int, fraction: float) -> bool:
    """Whether the record with split index ``index`` is held out for validation."""
    # Every k-th record is held out, k = 1 / fraction: deterministic and cheap to test.
    return fraction > 0 and index % max(1, round(1 / fraction)) == 0


def check_files(paths: tuple[str, ...]) -> str:
    """The one HF builder (``json``, ``parquet``, ``text``) that reads every file of ``paths``
    (``ValueError`` naming a missing file, an unknown suffix, a file whose content is not what
    its suffix says (parquet or not: 8 bytes read), or mixed formats)."""
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
        _check_magic(path)
    if len(formats) != 1:
        raise ValueError(f"data.paths mixes formats {sorted(formats)}; use one format per run")
    return formats.pop()


_PARQUET_MAGIC = b"PAR1"
"""The first and last bytes of every parquet file."""


def _check_magic(path: Path) -> None:
    """A parquet file named otherwise, or another file named ``.parquet``, is an error naming
    it (``datasets`` would fail later, naming no file)."""
    with path.open("rb") as f:
        head = f.read(4)
        f.seek(max(0, path.stat().st_size - 4))
        tail = f.read(4)
    is_parquet = head == tail == _PARQUET_MAGIC
    if (path.suffix == ".parquet") != is_parquet:
        what = "is not a parquet file" if path.suffix == ".parquet" else "is a parquet file"
        raise ValueError(
            f"data.paths: {str(path)!r} {what}, but its suffix says {FORMATS[path.suffix]}; "
            f"name each file for its format: {sorted(FORMATS)}"
        )


class FileRecords:
    """The records of local data files for one data-parallel rank, epoch by epoch."""

    def __init__(
        self,
        paths: tuple[str, ...],
        *,
        seed: int = 0,
        shuffle_buffer: int = 10_000,
        rank: int = 0,
        world_size: int = 1,
        streaming: bool = False,
    ) -> None:
        """``shuffle_buffer``: records in the shuffle buffer (0: the files' order in every
        epoch). ``streaming``: deal whole files to ranks (see the module docstring).
        Checks the files (suffixes, that they read as their format) before anything else."""
        if shuffle_buffer < 0:
            raise ValueError(f"data.shuffle_buffer={shuffle_buffer} must be >= 0 (0: no shuffle)")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
        self.format = check_files(paths)
        if streaming and len(paths) < world_size:
            raise ValueError(
                f"data.streaming: data.paths has {len(paths)} file(s) for {world_size} "
                "data-parallel ranks, and each rank streams whole files; split the data into "
                f"at least {world_size} files, or drop --data.streaming (every rank then reads "
                "every file and keeps every dp-th record)"
            )
        self.paths, self.seed, self.shuffle_buffer = paths, seed, shuffle_buffer
        self.rank, self.world_size, self.streaming = rank, world_size, streaming
        self._named = self._load()

    def split(self, split: Split, fraction: float, *, epoch: int = 0) -> Iterator[dict[str, Any]]:
        """This rank's records of ``split`` (``validation_fraction`` ``fraction``) in epoch
        ``epoch``'s order, each with ``__titan_file__`` / ``__titan_row__`` naming it."""
        held_out = split == "validation"
        in_split = (
            rec
            for rec in self._epoch(epoch)
            if in_validation(rec[_FILE] + rec[_ROW], fraction) == held_out
        )
        if self.streaming:  # the files are this rank's already
            return in_split
        return (rec for i, rec in enumerate(in_split) if i % self.world_size == self.rank)

    def count(self, fraction: float, *, limit: int = 100_000) -> tuple[int, int]:
        """This rank's records of epoch 0 and how many of them validation holds out (at most
        ``limit`` read: for an error message about a split that came out empty)."""
        total = held_out = 0
        for rec in self._epoch(0):
            total += 1
            held_out += in_validation(rec[_FILE] + rec[_ROW], fraction)
            if total == limit:
                break
        return total, held_out

    def first(self) -> dict[str, Any] | None:
        """The first record of the first file (None: the files hold no records)."""
        return next(self._read(self._named), None)

    def name(self, record: dict[str, Any]) -> str:
        """Where ``record`` (from ``split``) comes from, for an error message."""
        return f"record {record[_ROW]} of {self.paths[record[_FILE]]}"

    @staticmethod
    def fields(record: Mapping[str, Any]) -> list[str]:
        """The record's own fields (without the two the stream adds)."""
        return sorted(k for k in record if k not in (_FILE, _ROW))

    def _load(self) -> Any:
        """One ``datasets`` stream of every file, each record named ``(file, row)``."""
        import datasets

        try:
            whole = datasets.load_dataset(
                self.format, data_files=list(self.paths), split="train", streaming=True
            )
        except (ValueError, OSError) as e:  # a file that does not parse as its suffix says
            raise ValueError(f"data.paths={list(self.paths)} as {self.format}: {e}") from None
        assert whole.num_shards == len(self.paths), (whole.num_shards, self.paths)
        # Declared features, or concatenating would read the head of every file to infer
        # them (for json, datasets infers them from the first file's head, as it would).
        features = (whole.features or self._read_features(whole)).copy()
        features[_FILE] = features[_ROW] = datasets.Value("int64")
        # One single-file stream per file: its row count restarts at 0 and follows the file
        # wherever a shuffle of the file order puts it.
        files = [
            whole.shard(num_shards=len(self.paths), index=f).map(
                _name_rows, with_indices=True, fn_kwargs={"file": f}, features=features
            )
            for f in range(len(self.paths))
        ]
        return datasets.concatenate_datasets(files)

    def _read_features(self, whole: Any) -> Any:
        try:
            return whole._resolve_features().features
        except (ValueError, OSError) as e:
            raise ValueError(f"data.paths={list(self.paths)} as {self.format}: {e}") from None

    def _epoch(self, epoch: int) -> Iterator[dict[str, Any]]:
        import numpy as np
        from datasets.distributed import split_dataset_by_node

        ds = self._named
        if self.streaming and self.world_size > 1:
            ds = split_dataset_by_node(
                ds, rank=self.rank, world_size=self.world_size, strategy="shards"
            )
        if self.shuffle_buffer and (self.streaming or epoch > 0):
            # One file at a time feeds the buffer (max_buffer_input_shards=1): interleaving
            # several reads them on threads that ``datasets`` waits seconds for at every
            # iterator's end, and each resume or epoch ends one.
            ds = ds.shuffle(
                generator=np.random.default_rng((self.seed, epoch)),
                buffer_size=self.shuffle_buffer,
                max_buffer_input_shards=1,
            )
        return self._read(ds)

    def _read(self, ds: Any) -> Iterator[dict[str, Any]]:
        try:
            yield from ds
        except (ValueError, OSError) as e:  # a file that does not parse as its suffix says,
            # or whose columns differ from the first file's
            raise ValueError(f"data.paths={list(self.paths)} as {self.format}: {e}") from None


def _name_rows(_: dict[str, Any], row: int, *, file: int) -> dict[str, int]:
    return {_FILE: file, _ROW: row}
