"""Pack documents into fixed-length rows with document ids, with a resumable state.

Row layout (``B`` rows of ``S`` tokens): ``input_ids`` [B, S], ``labels`` [B, S] (the next
token, or ``IGNORE_INDEX`` where the next token starts another document), ``document_ids``
[B, S] (attention must not cross documents) and ``positions`` [B, S] (position inside the
document, continuing across rows when a document is split). An image-text batch
(``image_text.ImageTextLoader``) adds its images (``ImageInputs``), ``(3, B, S)`` multimodal
positions and, for validation accuracy, which targets belong to which sample's answer.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from titan_train.data.chat import ChatSource, Document
from titan_train.data.sources import DocumentSource
from titan_train.data.tokenizers import Tokenizer

IGNORE_INDEX = -100


@dataclass(frozen=True, slots=True)
class ImageInputs:
    """The images of a batch, in the order of their placeholder tokens (row-major)."""

    pixel_values: torch.Tensor
    """``(patches, C·T·P·P)`` flattened patches of every image (the HF processor's layout)."""
    grids: tuple[tuple[int, int, int], ...]
    """Patch grid ``(t, h, w)`` of each image (host ints: the model never reads the device)."""
    index: torch.Tensor
    """``(T,)`` flat indices in ``B·S`` of the placeholder tokens."""
    row_images: tuple[int, ...]
    """Images per row."""
    merge: int
    """Patches per side merged into one placeholder token."""

    def rows(self, lo: int, hi: int, seq_len: int) -> ImageInputs:
        """The images of rows ``lo .. hi - 1`` (indices rebased to those rows)."""
        first, last = sum(self.row_images[:lo]), sum(self.row_images[:hi])
        sizes = [t * h * w for t, h, w in self.grids]
        p0, p1 = sum(sizes[:first]), sum(sizes[:last])
        m2 = self.merge**2
        t0, t1 = sum(sizes[:first]) // m2, sum(sizes[:last]) // m2
        return ImageInputs(
            self.pixel_values[p0:p1],
            self.grids[first:last],
            self.index[t0:t1] - lo * seq_len,
            self.row_images[lo:hi],
            self.merge,
        )

    def to(self, device: torch.device) -> ImageInputs:
        """The same images on ``device`` (grids stay on the host)."""
        move = dict(device=device, non_blocking=True)
        return ImageInputs(
            self.pixel_values.to(**move),
            self.grids,
            self.index.to(**move),
            self.row_images,
            self.merge,
        )

    def model_inputs(self) -> dict[str, Any]:
        """Keyword arguments of a vision-language model's forward."""
        return dict(
            pixel_values=self.pixel_values, image_grid_thw=list(self.grids), image_index=self.index
        )


@dataclass(frozen=True, slots=True)
class Batch:
    """One packed batch (see the module docstring for the layout)."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    document_ids: torch.Tensor
    positions: torch.Tensor
    """``(B, S)``, or ``(3, B, S)`` multimodal (time / height / width) positions."""
    images: ImageInputs | None = None
    """The images at the placeholder tokens of ``input_ids`` (image-text batches)."""
    answers: torch.Tensor | None = None
    """``(B, S)`` number of the sample whose answer a target token belongs to, -1 elsewhere
    (validation accuracy: a sample is right when every answer token is predicted)."""

    def split(self, n: int) -> list[Batch]:
        """``n`` equal micro-batches along the batch dimension."""
        B, S = self.input_ids.shape
        if B % n:
            raise ValueError(f"cannot split {B} rows into {n} equal micro-batches")
        k = B // n
        return [
            Batch(
                self.input_ids[i : i + k],
                self.labels[i : i + k],
                self.document_ids[i : i + k],
                self.positions[..., i : i + k, :],
                None if self.images is None else self.images.rows(i, i + k, S),
                None if self.answers is None else self.answers[i : i + k],
            )
            for i in range(0, B, k)
        ]

    def to(self, device: torch.device) -> Batch:
        """The same batch on ``device`` (asynchronous copies from the host)."""
        return Batch(
            self.input_ids.to(device, non_blocking=True),
            self.labels.to(device, non_blocking=True),
            self.document_ids.to(device, non_blocking=True),
            self.positions.to(device, non_blocking=True),
            None if self.images is None else self.images.to(device),
            None if self.answers is None else self.answers.to(device, non_blocking=True),
        )

    def model_inputs(self) -> dict[str, Any]:
        """Keyword arguments of the model's forward besides the token ids."""
        inputs = dict(positions=self.positions, document_ids=self.document_ids)
        if self.images is not None:
            inputs |= self.images.model_inputs()
        return inputs

    @property
    def num_target_tokens(self) -> int:
        """Tokens that carry a loss (read on the host: call it on a CPU batch)."""
        return int((self.labels != IGNORE_INDEX).sum())


class PackedLoader:
    """An endless stream of packed batches from a ``DocumentSource`` (text documents, each
    ``BOS + text + EOS``) or a ``chat.ChatSource`` (rendered ``(ids, loss_mask)`` samples: a
    target token off the mask carries no loss); exactly resumable."""

    def __init__(
        self,
        source: DocumentSource | ChatSource,
        tokenizer: Tokenizer,
        *,
        seq_len: int,
        batch_size: int,
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
        self._loss_mask: list[bool] = []
        self._docs: Iterator[str | Document] | None = None

    def __iter__(self) -> PackedLoader:
        return self

    def __next__(self) -> Batch:
        b, s = self.batch_size, self.seq_len
        need = b * s + 1
        while len(self._tokens) < need:
            self._append_document()

        # Row r holds tokens [r*S, r*S + S] (S+1 tokens): consecutive rows overlap by one token,
        # so every token is a target exactly once. The last token stays for the next batch.
        def rows(values: Sequence[int]) -> torch.Tensor:
            return torch.tensor(values[:need]).unfold(0, s + 1, s)

        ids, docs, pos = rows(self._tokens), rows(self._doc_ids), rows(self._positions)
        trained = rows(self._loss_mask)
        del self._tokens[: b * s], self._doc_ids[: b * s], self._positions[: b * s]
        del self._loss_mask[: b * s]
        labels = ids[:, 1:].clone()
        labels[(docs[:, 1:] != docs[:, :-1]) | ~trained[:, 1:]] = IGNORE_INDEX
        return Batch(
            ids[:, :-1].contiguous(), labels, docs[:, :-1].contiguous(), pos[:, :-1].contiguous()
        )

    def _append_document(self) -> None:
        if self._docs is None:
            self._docs = self.source.documents(start=self._consumed, epoch=self._epoch)
        doc = next(self._docs, None)
        if doc is None:  # end of a finite source: next epoch
            self._epoch, self._consumed, self._docs = self._epoch + 1, 0, None
            if self.source.kind in ("files", "chat") and self._next_doc_id == 0:
                raise ValueError("data: this rank's split holds no documents")
            return
        self._consumed += 1
        if isinstance(doc, str):
            ids = [self.tokenizer.bos_id, *self.tokenizer.encode(doc), self.tokenizer.eos_id]
            mask = [True] * len(ids)
        else:  # rendered (ids, loss mask); empty: a sample the source dropped
            ids, mask = doc
            if not ids:
                return
            self._start_in_one_row(len(ids))
        self._tokens += ids
        self._loss_mask += mask
        self._doc_ids += [self._next_doc_id] * len(ids)
        self._positions += range(len(ids))
        self._next_doc_id += 1

    def _start_in_one_row(self, n: int) -> None:
        """Pad to the next row when a sample of ``n`` tokens would straddle two rows: a chat
        sample split across rows would be trained, in its second row, to answer without the
        question and the tool output it was written from. (Text documents do continue across
        rows, as pre-training corpora are read.) The padding is a document of its own with no
        loss."""
        s = self.seq_len
        offset = len(self._tokens) % s  # the buffer starts at a row boundary
        if offset == 0 or offset + n - 1 <= s or n - 1 > s:
            return
        pad = s - offset
        self._tokens += [self.tokenizer.pad_id] * pad
        self._loss_mask += [False] * pad
        self._doc_ids += [self._next_doc_id] * pad
        self._positions += range(pad)
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
            "loss_mask": list(self._loss_mask),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly where the stream that produced ``state`` stopped."""
        self._consumed, self._epoch = int(state["consumed"]), int(state["epoch"])
        self._next_doc_id = int(state["next_doc_id"])
        self._tokens = [int(x) for x in state["tokens"]]
        self._doc_ids = [int(x) for x in state["doc_ids"]]
        self._positions = [int(x) for x in state["positions"]]
        # Checkpoints from before loss masks: every buffered token was a target.
        self._loss_mask = [bool(x) for x in state.get("loss_mask", [True] * len(self._tokens))]
        self._docs = None
