"""Log-probabilities of sampled tokens: one function for the generator and the trainer.

The generator takes the log-prob of each token from the logits row that sampled it; the trainer
recomputes them with one causal forward over ``prompt + response``. Both go through
``token_logprobs`` on the same ``(V,)`` logits row, so in batch-invariant mode they are equal.

Prompts come as token lists, or as TRL and veRL hold them: a left-padded ``(B, P)`` tensor with
its attention mask. Either way each row is packed as ``prompt + response`` from column 0 (right
padding), so positions start at 0 on every row, no attention mask reaches the model (a
recurrent or linear-attention layer never reads a pad token) and the bits do not depend on how
much left padding the host added.

Shapes: B sequences, P prompt tokens, T response tokens, S packed tokens, V vocabulary.
"""

from __future__ import annotations

from typing import Any, Literal, overload

import torch
from torch import nn

from .causal_lm import CausalLM, causal_lm_logits

Prompts = list[list[int]] | torch.Tensor
"""Token lists, or a left-padded ``(B, P)`` id tensor (with a ``prompt_mask``)."""


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """``log softmax(logits / temperature)[token]`` per row, in fp32 or fp64 (``temperature``
    0 → 1)."""
    return _log_softmax(logits, temperature).gather(-1, tokens[..., None]).squeeze(-1)


def _log_softmax(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    # At least fp32 (bf16 log-probs are too coarse for a PPO ratio); fp64 stays fp64.
    scaled = logits if logits.dtype == torch.float64 else logits.float()
    if temperature not in (0.0, 1.0):
        scaled = scaled / temperature
    return scaled.log_softmax(-1)


def pack_sequences(
    prompts: Prompts,
    responses: torch.Tensor,
    response_mask: torch.Tensor,
    pad_id: int = 0,
    *,
    prompt_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ``prompt + response`` rows ``(B, S)`` and each response's start index.

    ``prompts``: token lists, or a ``(B, P)`` tensor left-padded as ``prompt_mask`` says (1 =
    real token; ``None``: no padding). Both give the same rows for the same prompts. A row's
    response is cut after its last masked-in token (0 on the mask: left as context).
    """
    B, T = responses.shape
    if tuple(response_mask.shape) != (B, T):
        raise ValueError(
            f"response_mask {tuple(response_mask.shape)} must have the shape of responses {(B, T)}"
        )
    if isinstance(prompts, torch.Tensor):
        return _pack_padded(prompts, prompt_mask, responses, response_mask, pad_id)
    if prompt_mask is not None:
        raise ValueError(
            "prompt_mask is for a left-padded (B, P) prompt tensor; token-list prompts carry "
            "no padding (pass prompt_mask=None)"
        )
    if not isinstance(prompts, list | tuple):
        raise TypeError(
            f"prompts must be a list of token lists or a (B, P) tensor, got {type(prompts).__name__}"
        )
    if len(prompts) != B:
        raise ValueError(f"{len(prompts)} prompts for {B} responses: one prompt per response")
    if any(len(p) == 0 for p in prompts):
        raise ValueError(
            "every prompt needs at least one token (it predicts the first response token)"
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


def _pack_padded(
    prompts_BP: torch.Tensor,
    prompt_mask: torch.Tensor | None,
    responses_BT: torch.Tensor,
    response_mask: torch.Tensor,
    pad_id: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The tensor path of ``pack_sequences``: each row shifted left by its padding, on the
    prompts' device, one gather for the whole batch."""
    B, T = responses_BT.shape
    if prompts_BP.ndim != 2 or prompts_BP.shape[0] != B or prompts_BP.is_floating_point():
        raise ValueError(
            f"prompts as a tensor must be integer ids (B, P) with B = {B} (the responses' "
            f"batch), got {prompts_BP.dtype} {tuple(prompts_BP.shape)}"
        )
    device = prompts_BP.device
    P = prompts_BP.shape[1]
    if prompt_mask is None:
        keep_BP = torch.ones(B, P, dtype=torch.bool, device=device)
    elif tuple(prompt_mask.shape) != (B, P):
        raise ValueError(
            f"prompt_mask {tuple(prompt_mask.shape)} must have the shape of prompts {(B, P)}"
        )
    else:
        keep_BP = prompt_mask.to(device).bool()
    # One check for both rules (one host sync): left padding only (no real token before a
    # pad), and at least one real token, which predicts the first response token.
    bad_B = (keep_BP[:, 1:] < keep_BP[:, :-1]).any(1) | ~keep_BP.any(1)
    if bool(bad_B.any()):
        row = int(bad_B.nonzero()[0])
        raise ValueError(
            f"prompt_mask row {row} is {keep_BP[row].int().tolist()}: each row must be left "
            "padding (zeros, then ones) with at least one real token"
        )
    starts_B = keep_BP.sum(1)
    position_T = torch.arange(1, T + 1, device=device)
    lengths_B = starts_B + (response_mask.to(device).bool() * position_T).amax(1)
    S = int(lengths_B.max())
    full_BL = torch.cat([prompts_BP.long(), responses_BT.to(device).long()], dim=1)
    column_S = torch.arange(S, device=device)
    index_BS = (column_S[None, :] + (P - starts_B)[:, None]).clamp(max=P + T - 1)
    seq_BS = full_BL.gather(1, index_BS).masked_fill(
        column_S[None, :] >= lengths_B[:, None], pad_id
    )
    return seq_BS, starts_B


@overload
def sequence_logprobs(
    model: CausalLM,
    prompts: Prompts,
    responses: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    prompt_mask: torch.Tensor | None = ...,
    temperature: float = ...,
    images: dict[str, Any] | None = ...,
    with_entropy: Literal[False] = ...,
) -> torch.Tensor: ...


@overload
def sequence_logprobs(
    model: CausalLM,
    prompts: Prompts,
    responses: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    prompt_mask: torch.Tensor | None = ...,
    temperature: float = ...,
    images: dict[str, Any] | None = ...,
    with_entropy: Literal[True],
) -> tuple[torch.Tensor, torch.Tensor]: ...


def sequence_logprobs(
    model: CausalLM,
    prompts: Prompts,
    responses: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    prompt_mask: torch.Tensor | None = None,
    temperature: float = 1.0,
    images: dict[str, Any] | None = None,
    with_entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The trainer's log-prob ``(B, T)`` of every masked-in response token (0 elsewhere).

    One forward of ``model`` (any ``titan_rl.CausalLM``: a titan_models model, a transformers
    model) over the right-padded ``prompt + response`` rows (``pack_sequences``); response
    token ``t`` of row ``b`` is predicted by the logits at ``starts[b] + t - 1``.
    Differentiable. ``prompts``: token lists, or a left-padded ``(B, P)`` tensor with
    ``prompt_mask`` (TRL's ``prompt_ids`` / ``prompt_mask``; veRL's ``prompts`` and the first
    ``P`` columns of its ``attention_mask``): the same bits either way. ``images``: the
    vision-language model's image keyword arguments for the rows' prompts (as the generator
    got them, ``RolloutBatch.model_images``). ``with_entropy``: also return each token's
    entropy ``(B, T)`` of the temperature-scaled distribution (0 off the mask), from the
    same forward.
    """
    seq_BS, starts = pack_sequences(prompts, responses, response_mask, prompt_mask=prompt_mask)
    weight = next(iter(model.parameters()), None) if isinstance(model, nn.Module) else None
    device = weight.device if weight is not None else responses.device
    extra = {}
    if images is not None:
        extra = {k: v.to(device) if torch.is_tensor(v) else v for k, v in images.items()}
        extra |= _prompt_image_inputs(model, seq_BS.cpu(), starts.cpu(), extra)
    logits_BSV = causal_lm_logits(model, seq_BS.to(device), **extra)
    B, T = responses.shape
    starts = starts.to(device)
    index_BT = (starts[:, None] - 1 + torch.arange(T, device=device)).clamp(max=seq_BS.shape[1] - 1)
    logits_BTV = logits_BSV[torch.arange(B, device=device)[:, None], index_BT]
    logp_BTV = _log_softmax(logits_BTV, temperature)
    tokens_BT = responses.to(device).clamp(min=0)
    off_BT = ~response_mask.to(device).bool()
    lp_BT = logp_BTV.gather(-1, tokens_BT[..., None]).squeeze(-1).masked_fill(off_BT, 0.0)
    if not with_entropy:
        return lp_BT
    entropy_BT = -(logp_BTV.exp() * logp_BTV).sum(-1)
    return lp_BT, entropy_BT.masked_fill(off_BT, 0.0)


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
