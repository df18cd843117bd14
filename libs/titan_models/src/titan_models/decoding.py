"""A tiny greedy decoder over the KV cache, for tests and examples (sampling is titan_rl's)."""

from __future__ import annotations

import torch

from .components import Transformer


@torch.no_grad()
def greedy_generate(
    model: Transformer, prompts: list[list[int]], max_new_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy continuation of ragged ``prompts`` (one prefill, then one token per step).

    Returns the new tokens ``(B, max_new_tokens)`` and the logits that chose them
    ``(B, max_new_tokens, V)``.
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("prompts must be a non-empty list of non-empty token lists")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    device = next(model.parameters()).device
    lengths_B = torch.tensor([len(p) for p in prompts], device=device)
    tokens_BS = torch.zeros(len(prompts), int(lengths_B.max()), dtype=torch.long, device=device)
    for row, prompt in enumerate(prompts):
        tokens_BS[row, : len(prompt)] = torch.tensor(prompt, device=device)
    cache = model.new_kv_cache(len(prompts), tokens_BS.shape[1] + max_new_tokens)

    logits_BSV = model(tokens_BS, kv_cache=cache, input_lengths=lengths_B)
    logits_BV = logits_BSV[torch.arange(len(prompts), device=device), lengths_B - 1]
    steps = [logits_BV]
    for _ in range(max_new_tokens - 1):
        next_B1 = steps[-1].argmax(-1, keepdim=True)
        steps.append(model(next_B1, kv_cache=cache)[:, 0])
    logits_BTV = torch.stack(steps, dim=1)
    return logits_BTV.argmax(-1), logits_BTV
