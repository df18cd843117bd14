"""Long-context training without padding: episodes packed into rows of concatenated documents.

``sequence_logprobs`` right-pads every ``prompt + response`` row to the longest one; with
multi-turn episodes of very different lengths most of that batch is padding. ``pack_rows``
instead concatenates the sequences (each cut after its last model token, as
``pack_sequences`` does) into as few rows as fit ``max_row_tokens`` (longest first onto the
least-filled row; one row by default) and gives every sequence its own document id, so titan_models'
attention keeps each sequence to itself and RoPE positions restart at 0 in each: a token's
logits are those of the padded path. ``packed_sequence_logprobs`` is the drop-in: same
arguments, same ``(B, T)`` result.

In batch-invariant mode the packed log-probs equal the padded ones (and so the generator's)
bit for bit when each sequence's keys are reduced in the blocks of a row of its own. The
``varlen`` attention backend (titan_models' default off CUDA) attends every document as a
piece of its own: nothing to do. The ``sdpa`` backend attends a row under a dense document
mask: give ``align=key_block`` (32 by default) so each sequence starts at a multiple of it
(the gap is padding owned by the sequence before, which never attends forward to it).
Otherwise the paths agree to float rounding.

Shapes: N sequences, T response tokens, R packed rows of L tokens, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from titan_models import Transformer

from .causal_lm import causal_lm_logits
from .logprobs import token_logprobs


@dataclass(frozen=True, slots=True)
class PackedRows:
    """Sequences concatenated into rows, each a document of its own."""

    input_ids: torch.Tensor
    """``(R, L)`` token ids (``pad_id`` in the gaps and at the ends of rows)."""
    document_ids: torch.Tensor
    """``(R, L)`` the document of every position: the ordinal of its sequence in the row (a
    gap belongs to the sequence before)."""
    rows: torch.Tensor
    """``(N,)`` the row of each sequence."""
    offsets: torch.Tensor
    """``(N,)`` where each sequence starts in its row."""
    lengths: torch.Tensor
    """``(N,)`` each sequence's tokens: its prompt and its response up to the last model token."""
    prompt_lengths: torch.Tensor
    """``(N,)`` each sequence's prompt tokens."""

    @property
    def num_padding(self) -> int:
        """Positions that hold no sequence's token."""
        return self.input_ids.numel() - int(self.lengths.sum())

    @property
    def padding_fraction(self) -> float:
        """``num_padding`` over all positions."""
        return self.num_padding / max(1, self.input_ids.numel())


def pack_rows(
    prompts: list[list[int]],
    responses: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    max_row_tokens: int | None = None,
    align: int = 1,
    pad_id: int = 0,
) -> PackedRows:
    """Pack ``prompt + response`` of every row (cut after its last masked-in token) into rows
    of at most ``max_row_tokens`` (``None``: one row), each start a multiple of ``align``."""
    N, T = responses.shape
    if len(prompts) != N or tuple(response_mask.shape) != (N, T):
        raise ValueError(
            f"{len(prompts)} prompts, responses {tuple(responses.shape)} and mask "
            f"{tuple(response_mask.shape)} must agree on the batch size and length"
        )
    if isinstance(align, bool) or not isinstance(align, int) or align < 1:
        raise ValueError(f"align={align!r} must be an int >= 1")
    prompt_lengths = torch.tensor([len(p) for p in prompts], dtype=torch.long)
    last = (response_mask.bool().cpu() * torch.arange(1, T + 1)).amax(1)
    lengths = prompt_lengths + last
    spans = [-(-int(n) // align) * align for n in lengths]  # aligned room of each sequence
    capacity = sum(spans) if max_row_tokens is None else max_row_tokens
    if max_row_tokens is not None and (
        isinstance(max_row_tokens, bool)
        or not isinstance(max_row_tokens, int)
        or max(spans) > max_row_tokens
    ):
        raise ValueError(
            f"max_row_tokens={max_row_tokens!r} must be an int >= the longest aligned sequence "
            f"({max(spans)} tokens)"
        )
    rows, offsets, num_rows = _balance(spans, capacity)
    width = max(int((offsets + lengths).max()), 1)
    input_ids = torch.full((num_rows, width), pad_id, dtype=torch.long)
    document_ids = torch.zeros(num_rows, width, dtype=torch.long)
    for r in range(num_rows):
        members = sorted((int(offsets[i]), i) for i in range(N) if int(rows[i]) == r)
        for k, (start, i) in enumerate(members):
            end = members[k + 1][0] if k + 1 < len(members) else width
            document_ids[r, start:end] = k  # the gap after a sequence is its own padding
            n, p = int(lengths[i]), len(prompts[i])
            input_ids[r, start : start + p] = torch.tensor(prompts[i], dtype=torch.long)
            input_ids[r, start + p : start + n] = responses[i, : n - p]
    return PackedRows(input_ids, document_ids, rows, offsets, lengths, prompt_lengths)


def _balance(spans: list[int], capacity: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Row and offset of each sequence: the fewest rows of ``capacity`` that longest-first
    onto the least-filled row fits (rows of nearly equal fill: little padding at their ends)."""
    N = len(spans)
    order = sorted(range(N), key=lambda i: (-spans[i], i))
    num_rows = max(1, -(-sum(spans) // capacity))
    while True:
        fill = [0] * num_rows
        rows = torch.zeros(N, dtype=torch.long)
        offsets = torch.zeros(N, dtype=torch.long)
        for i in order:
            r = min(range(num_rows), key=lambda r: (fill[r], r))
            rows[i], offsets[i] = r, fill[r]
            fill[r] += spans[i]
        if max(fill) <= capacity:
            return rows, offsets, num_rows
        num_rows += 1  # ends: num_rows = N always fits (every span <= capacity)


def packed_sequence_logprobs(
    model: Transformer,
    prompts: list[list[int]],
    responses: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    temperature: float = 1.0,
    max_row_tokens: int | None = None,
    align: int = 1,
) -> torch.Tensor:
    """``sequence_logprobs`` through packed rows: the trainer's log-prob ``(N, T)`` of every
    masked-in response token (0 elsewhere), one forward over ``pack_rows(...)`` with document
    ids. Differentiable. A titan_models ``Transformer`` (its attention takes document ids)."""
    if not isinstance(model, Transformer):
        raise TypeError(
            f"packed_sequence_logprobs needs a titan_models Transformer (document ids in its "
            f"attention), got {type(model).__name__}; use titan_rl.sequence_logprobs"
        )
    packed = pack_rows(
        prompts, responses, response_mask, max_row_tokens=max_row_tokens, align=align
    )
    device = next(model.parameters()).device
    logits_RLV = causal_lm_logits(
        model, packed.input_ids.to(device), document_ids=packed.document_ids.to(device)
    )
    T = responses.shape[1]
    # Response token t of sequence i sits at offset + prompt + t; the logits before it predict it.
    index_NT = packed.offsets[:, None] + packed.prompt_lengths[:, None] - 1 + torch.arange(T)
    index_NT = index_NT.clamp(max=packed.input_ids.shape[1] - 1)
    logits_NTV = logits_RLV[packed.rows[:, None].to(device), index_NT.to(device)]
    lp_NT = token_logprobs(logits_NTV, responses.to(device).clamp(min=0), temperature)
    return lp_NT.masked_fill(~response_mask.to(device).bool(), 0.0)
