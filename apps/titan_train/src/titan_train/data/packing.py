"""Pack documents into fixed-length rows with document ids, with a resumable state.

Row layout (``B`` rows of ``S`` tokens): ``input_ids`` [B, S], ``labels`` [B, S] (the next
token, or ``IGNORE_INDEX`` where the next token starts another document), ``document_ids``
[B, S] (attention must not cross documents) and ``positions`` [B, S] (position inside the
document, continuing across rows when a document is split).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from titan_train.data.sources import DocumentSource
from titan_train.data.tokenizers import Tokenizer

IGNORE_INDEX = -100


@dataclass(frozen=True, slots=True)
class Batch:
    """One packed batch (see the module docstring for the layout)."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    document_ids: torch.Tensor
    positions: torch.Tensor

    def split(self, n: int) -> list[Batch]:
        """``n`` equal micro-batches along the batch dimension."""
        fields = (self.input_ids, self.labels, self.document_ids, self.positions)
        return [Batch(*parts) for parts in zip(*(t.chunk(n) for t in fields), strict=True)]

    def to(self, device: torch.device) -> Batch:
        """The same batch on ``device`` (asynchronous copies from the host)."""
        fields = (self.input_ids, self.labels, self.document_ids, self.positions)
        return Batch(*(t.to(device, non_blocking=True) for t in fields))

    @property
    def num_target_tokens(self) -> int:
        """Tokens that carry a loss (read on the host: call it on a CPU batch)."""
        return int((self.labels != IGNORE_INDEX).sum())


class PackedLoader:
    """An endless stream of packed batches from a ``DocumentSource``; exactly resumable."""

    def __init__(
        self, source: DocumentSource, tokenizer: Tokenizer, *, seq_len: int, batch_size: int
    ) -> None:
        if seq_len < 2:
            raise ValueError(f"training.seq_len={seq_len} must be >= 2")
        self.source, self.tokenizer = source, tokenizer
        self.seq_len, self.batch_size = seq_len, batch_size
        self._consumed = 0  # documents of the current epoch taken from the source
        self._epoch = 0
        self._next_doc_id = 0
        self._tokens: list[int] = []
        self._doc_ids: list[int] = []
        self._positions: list[int] = []
        self._docs: Iterator[str] | None = None

    def __iter__(self) -> PackedLoader:
        return self

    def __next__(self) -> Batch:
        b, s = self.batch_size, self.seq_len
        need = b * s + 1
        while len(self._tokens) < need:
            self._append_document()

        # Row r holds tokens [r*S, r*S + S] (S+1 tokens): consecutive rows overlap by one token,
        # so every token is a target exactly once. The last token stays for the next batch.
        def rows(values: list[int]) -> torch.Tensor:
            return torch.tensor(values[:need]).unfold(0, s + 1, s)

        ids, docs, pos = rows(self._tokens), rows(self._doc_ids), rows(self._positions)
        del self._tokens[: b * s], self._doc_ids[: b * s], self._positions[: b * s]
        labels = ids[:, 1:].clone()
        labels[docs[:, 1:] != docs[:, :-1]] = IGNORE_INDEX
        return Batch(
            ids[:, :-1].contiguous(), labels, docs[:, :-1].contiguous(), pos[:, :-1].contiguous()
        )

    def _append_document(self) -> None:
        if self._docs is None:
            self._docs = self.source.documents(start=self._consumed, epoch=self._epoch)
        text = next(self._docs, None)
        if text is None:  # end of a finite source: next epoch
            self._epoch, self._consumed, self._docs = self._epoch + 1, 0, None
            if self.source.kind == "files" and self._next_doc_id == 0:
                raise ValueError("data: this rank's split holds no documents")
            return
        self._consumed += 1
        ids = [self.tokenizer.bos_id, *self.tokenizer.encode(text), self.tokenizer.eos_id]
        self._tokens += ids
        self._doc_ids += [self._next_doc_id] * len(ids)
        self._positions += range(len(ids))
        self._next_doc_id += 1

    def state_dict(self) -> dict[str, Any]:
        """Plain ints and lists (no pickle needed) that restore the stream exactly."""
        return {
            "consumed": self._consumed,
            "epoch": self._epoch,
            "next_doc_id": self._next_doc_id,
            "tokens": list(self._tokens),
            "doc_ids": list(self._doc_ids),
            "positions": list(self._positions),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly where the stream that produced ``state`` stopped."""
        self._consumed, self._epoch = int(state["consumed"]), int(state["epoch"])
        self._next_doc_id = int(state["next_doc_id"])
        self._tokens = [int(x) for x in state["tokens"]]
        self._doc_ids = [int(x) for x in state["doc_ids"]]
        self._positions = [int(x) for x in state["positions"]]
        self._docs = None
