"""The multi-token-prediction loss (DeepSeek-V3 §2.2), independent of any model's internals."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F


def mtp_loss(
    mtp_logits: Sequence[torch.Tensor],
    labels: torch.Tensor,
    *,
    document_ids: torch.Tensor | None = None,
    weight: float,
    ignore_index: int = -100,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """``weight · mean_k loss_k``: the extra loss of ``model(..., return_mtp=True)``.

    Args:
        mtp_logits: one ``(B, S, V)`` tensor per MTP module; the k-th (k = 1, 2, ...) predicts
            at position i what the main head predicts at position i + k.
        labels: the main head's targets ``(B, S)`` (``labels[:, i]`` = token i + 1); module k's
            target at i is ``labels[:, i + k]``. Positions whose target falls past the row end,
            or (with ``document_ids``) in another document than position i, are ignored, as
            are targets equal to ``ignore_index``.
        weight: λ, e.g. ``config.mtp_loss_weight``.
        loss_fn: ``(logits (N, V), targets (N,)) -> mean loss`` over the targets that are not
            ``ignore_index``; default cross-entropy (a module with no target contributes 0).
    """
    if labels.dim() != 2:
        raise ValueError(f"labels must have shape (B, S), got {tuple(labels.shape)}")
    B, S = labels.shape
    if document_ids is not None and tuple(document_ids.shape) != (B, S):
        raise ValueError(
            f"document_ids must have shape {(B, S)} like labels, got {tuple(document_ids.shape)}"
        )
    if not mtp_logits:
        raise ValueError("mtp_logits is empty: the model has no MTP modules (num_mtp_modules=0)")
    losses = []
    for k, logits in enumerate(mtp_logits, start=1):
        if logits.dim() != 3 or tuple(logits.shape[:2]) != (B, S):
            raise ValueError(
                f"mtp_logits[{k - 1}] must have shape ({B}, {S}, V), got {tuple(logits.shape)}"
            )
        targets_BS = F.pad(labels[:, k:], (0, k), value=ignore_index)
        if document_ids is not None:
            same_BS = F.pad(document_ids[:, k:] == document_ids[:, :-k], (0, k), value=False)
            targets_BS = targets_BS.masked_fill(~same_BS, ignore_index)
        logits_NV, targets_N = logits.flatten(0, 1), targets_BS.flatten()
        if loss_fn is not None:
            losses.append(loss_fn(logits_NV, targets_N))
        else:
            total = F.cross_entropy(
                logits_NV.float(), targets_N, ignore_index=ignore_index, reduction="sum"
            )
            losses.append(total / (targets_N != ignore_index).sum().clamp(min=1))
    return weight * torch.stack(losses).mean()
