"""Log-probabilities of sampled tokens: one function for the generator and the trainer.

The generator takes the log-prob of each token from the logits row that sampled it; the trainer
recomputes them with one causal forward over ``prompt + response``. Both go through
``token_logprobs`` on the same ``(V,)`` logits row, so in batch-invariant mode they are equal.

Shapes: B sequences, P prompt tokens, T response tokens, V vocabulary.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .causal_lm import CausalLM, causal_lm_logits


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """``log softmax(logits / temperature)[token]`` per row, in fp32 (``temperature`` 0 → 1)."""
    scaled = logits.float()
    if temperature not in (0.0, 1.0):
        scaled = scaled / temperature
    return scaled.log_softmax(-1).gather(-1, tokens[..., None]).squeeze(-1)


def pack_sequences(
    prompts: list[list[int]], responses: torch.Tensor, response_mask: torch.Tensor, pad_id: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ``prompt + response`` rows ``(B, P + T)`` and each response's start index.

    A row's response is cut after its last masked-in token (0 on the mask: left as context).
    """
    B, T = responses.shape
    if len(prompts) != B or tuple(response_mask.shape) != (B, T):
        raise ValueError(
            f"{len(prompts)} prompts, responses {tuple(responses.shape)} and mask "
            f"{tuple(response_mask.shape)} must agree on the batch size and length"
        )
    starts = torch.tensor([len(p) for p in prompts])
    # A response runs to its last masked-in token: multi-turn episodes have masked-out
    # environment tokens in between, which stay in the sequence as context.
    position_T = torch.arange(1, T + 1)
    lengths = starts + (response_mask.bool().cpu() * position_T).amax(1)
    seq_BS = torch.full((B, int(lengths.max())), pad_id, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        n = int(lengths[row]) - len(prompt)
        seq_BS[row, : len(prompt)] = torch.tensor(prompt)
        seq_BS[row, len(prompt) : len(prompt) + n] = responses[row, :n]
    return seq_BS, starts


def sequence_logprobs(
    model: CausalLM,
    prompts: list[list[int]],
    responses: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    temperature: float = 1.0,
    images: dict[str, Any] | None = None,
) -> torch.Tensor:
    """The trainer's log-prob ``(B, T)`` of every masked-in response token (0 elsewhere).

    One forward of ``model`` (any ``titan_rl.CausalLM``: a titan_models model, a transformers
    model) over the right-padded ``prompt + response`` rows; response token ``t`` of row ``b``
    is predicted by the logits at ``starts[b] + t - 1``. Differentiable. ``images``: the
    vision-language model's image keyword arguments for the rows' prompts (as the generator
    got them, ``RolloutBatch.model_images``).
    """
    seq_BS, starts = pack_sequences(prompts, responses, response_mask)
    weight = next(iter(model.parameters()), None) if isinstance(model, nn.Module) else None
    device = weight.device if weight is not None else responses.device
    extra = {}
    if images is not None:
        extra = {k: v.to(device) if torch.is_tensor(v) else v for k, v in images.items()}
        extra |= _prompt_image_inputs(model, seq_BS, starts, extra)
    logits_BSV = causal_lm_logits(model, seq_BS.to(device), **extra)
    B, T = responses.shape
    index_BT = (starts[:, None] - 1 + torch.arange(T)).clamp(max=seq_BS.shape[1] - 1)
    logits_BTV = logits_BSV[torch.arange(B, device=device)[:, None], index_BT.to(device)]
    lp_BT = token_logprobs(logits_BTV, responses.to(device).clamp(min=0), temperature)
    return lp_BT.masked_fill(~response_mask.to(device).bool(), 0.0)


def _prompt_image_inputs(
    model: CausalLM, seq_BS: torch.Tensor, starts: torch.Tensor, images: dict[str, Any]
) -> dict[str, torch.Tensor]:
    """For a titan_models vision-language model: the placeholders and M-RoPE positions as the
    generator saw them. Images sit in the prompts only; a response token that happens to be
    the image placeholder id is text (the generator decoded it as such), and response
    positions continue each prompt's multimodal positions (plain position + the row's shift).
    """
    from titan_models.components.vision import batch_multimodal_positions

    token_id = getattr(model, "image_token_id", None)
    merge = getattr(model, "spatial_merge_size", None)
    if token_id is None or merge is None or "image_grid_thw" not in images:
        return {}
    S = seq_BS.shape[1]
    in_prompt_BS = torch.arange(S)[None, :] < starts[:, None]
    positions_3BS, shift_B = batch_multimodal_positions(
        seq_BS,
        images["image_grid_thw"],
        image_token_id=token_id,
        spatial_merge_size=merge,
        lengths=starts,
    )
    after_BS = torch.arange(S)[None, :] + shift_B[:, None]
    positions_3BS = torch.where(in_prompt_BS, positions_3BS, after_BS)
    index = ((seq_BS == token_id) & in_prompt_BS).flatten().nonzero().flatten()
    device = images["pixel_values"].device
    return {"positions": positions_3BS.to(device), "image_index": index.to(device)}
