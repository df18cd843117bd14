"""Vision features into the language model's residual stream, at the image placeholders.

The token embedding of each placeholder is *replaced* by its image token (``scatter``); with
DeepStack (Meng et al., 2024; Qwen3-VL) features taken from intermediate layers of the vision
encoder are *added* at the same places after each of the first few decoder layers
(``add_at``). Both address the placeholders by their flat index in the ``(B·S)`` tokens: the
data pipeline knows them without reading the device (``placeholder_index`` finds them in the
token ids otherwise, one host read).

Shapes: B batch, S sequence, D width, T placeholder tokens (all images of the batch).
"""

from __future__ import annotations

import torch


def placeholder_index(tokens_BS: torch.Tensor, token_id: int) -> torch.Tensor:
    """``(T,)`` flat indices of the tokens equal to ``token_id``, in row-major order (one
    host read of the count)."""
    return (tokens_BS.flatten() == token_id).nonzero().flatten()


def check_placeholders(index_T: torch.Tensor, num_features: int, what: str = "image") -> None:
    """``ValueError`` unless there is exactly one placeholder per feature row."""
    if index_T.dim() != 1 or index_T.shape[0] != num_features:
        raise ValueError(
            f"{what} placeholders and {what} features disagree: {index_T.numel()} placeholder "
            f"token(s) in the batch, the {what}s give {num_features} feature token(s)"
        )


def scatter(h_BSD: torch.Tensor, index_T: torch.Tensor, features_TD: torch.Tensor) -> torch.Tensor:
    """``h`` with the rows at the flat placeholder indices replaced by ``features`` (gradients
    flow to both: into ``features`` there, into ``h`` elsewhere)."""
    B, S, D = h_BSD.shape
    flat = h_BSD.reshape(B * S, D).index_copy(0, index_T, features_TD.to(h_BSD.dtype))
    return flat.view(B, S, D)


def add_at(h_BSD: torch.Tensor, index_T: torch.Tensor, features_TD: torch.Tensor) -> torch.Tensor:
    """``h`` plus ``features`` at the flat placeholder indices (DeepStack injection)."""
    B, S, D = h_BSD.shape
    flat = h_BSD.reshape(B * S, D).index_add(0, index_T, features_TD.to(h_BSD.dtype))
    return flat.view(B, S, D)
