"""Rollout generation: the ``Generator`` protocol and ``TorchGenerator`` over titan_models.

``TorchGenerator`` runs the very model class the trainer trains (one prefill of the ragged
prompts into the titan_models KV cache, then one token per step) and samples each row with its
own seeded ``torch.Generator``, so a sample depends only on its prompt, its seed and the
weights, never on the other rows of the batch (given batch-invariant logits).

Shapes: B rows, P prompt tokens, T new tokens, V vocabulary.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from .batch_invariant import batch_invariant
from .logprobs import token_logprobs


@dataclass(frozen=True, kw_only=True, slots=True)
class SamplingParams:
    """How to sample a continuation."""

    max_new_tokens: int
    """Most tokens generated per row (a row stops earlier at a stop token)."""
    temperature: float = 1.0
    """Softmax temperature; 0 is greedy."""
    top_p: float = 1.0
    """Nucleus: keep the smallest set of tokens whose probability reaches ``top_p`` (1 = off)."""
    top_k: int = 0
    """Keep the ``top_k`` most likely tokens (0 = off)."""
    stop_token_ids: tuple[int, ...] = ()
    """A row ends after emitting one of these (the stop token is part of the response)."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens={self.max_new_tokens} must be >= 1")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature={self.temperature} must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p={self.top_p} must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k={self.top_k} must be >= 0 (0 = off)")


@dataclass(frozen=True, slots=True)
class Generation:
    """Sampled responses of one ``generate`` call (rows in prompt order)."""

    tokens: torch.Tensor
    """``(B, T)`` sampled ids, 0 after a row's end."""
    mask: torch.Tensor
    """``(B, T)`` True on the real tokens of each response."""
    logprobs: torch.Tensor
    """``(B, T)`` raw log-probs of the sampled tokens: ``log softmax(logits / temperature)``,
    before top-k / top-p (what the trainer recomputes). 0 where ``mask`` is off."""
    processed_logprobs: torch.Tensor
    """``(B, T)`` log-probs under the distribution actually sampled from (after top-k/top-p)."""
    finish_reasons: list[str]
    """``"stop"`` (a stop token) or ``"length"`` (``max_new_tokens`` reached), per row."""
    weight_version: int
    """Version of the weights that produced every token of this batch."""

    @property
    def lengths(self) -> torch.Tensor:
        """``(B,)`` response lengths."""
        return self.mask.sum(1)

    def responses(self) -> list[list[int]]:
        """Each row's response ids."""
        return [row[: int(n)].tolist() for row, n in zip(self.tokens, self.lengths, strict=True)]

    def validate(self, num_prompts: int) -> None:
        """Raise ``ValueError`` if the fields disagree in shape (a broken generator)."""
        shape = tuple(self.tokens.shape)
        if len(shape) != 2 or shape[0] != num_prompts:
            raise ValueError(f"generation has tokens {shape} for {num_prompts} prompts")
        for name in ("mask", "logprobs", "processed_logprobs"):
            got = tuple(getattr(self, name).shape)
            if got != shape:
                raise ValueError(f"generation.{name} has shape {got}, tokens have {shape}")
        if len(self.finish_reasons) != num_prompts:
            raise ValueError(
                f"generation has {len(self.finish_reasons)} finish reasons for {num_prompts} rows"
            )
        mask = self.mask.bool()
        if bool((mask[:, 1:] & ~mask[:, :-1]).any()):
            raise ValueError("generation.mask must be a prefix of each row (no holes)")


@runtime_checkable
class Generator(Protocol):
    """What the RL loop needs from an inference engine."""

    weight_version: int

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, seeds: list[int]
    ) -> Generation:
        """Sample one response per prompt; row ``i`` uses ``seeds[i]``."""
        ...

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Load new weights (in memory) and tag what follows with ``version``."""
        ...


class TorchGenerator:
    """Batched sampling with the titan_models KV cache (see the module docstring)."""

    def __init__(
        self,
        model: nn.Module,
        *,
        batch_invariant: bool = False,
        weight_version: int = 0,
    ) -> None:
        """``model``: a titan_models ``Transformer`` (the trainer's, or a copy for async mode)."""
        if not hasattr(model, "new_kv_cache"):
            raise TypeError(f"model must be a titan_models Transformer, got {type(model).__name__}")
        self.model = model
        self.batch_invariant = batch_invariant
        self.weight_version = weight_version
        self._lock = threading.Lock()

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Copy ``state_dict`` into the model in place (checked first: names and shapes)."""
        own = self.model.state_dict()
        missing, unexpected = sorted(set(own) - set(state_dict)), sorted(set(state_dict) - set(own))
        if missing or unexpected:
            raise ValueError(f"update_weights: missing keys {missing}, unexpected {unexpected}")
        for name, tensor in state_dict.items():
            if tuple(tensor.shape) != tuple(own[name].shape):
                raise ValueError(
                    f"update_weights: {name} has shape {tuple(tensor.shape)}, "
                    f"the model has {tuple(own[name].shape)}"
                )
        with self._lock, torch.no_grad():
            for name, tensor in state_dict.items():
                if own[name].data_ptr() != tensor.data_ptr():
                    own[name].copy_(tensor)
            self.weight_version = version

    @torch.no_grad()
    def generate(
        self, prompts: list[list[int]], params: SamplingParams, seeds: list[int]
    ) -> Generation:
        """Sample one response per prompt (see ``Generation``)."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("prompts must be a non-empty list of non-empty token lists")
        if len(seeds) != len(prompts):
            raise ValueError(f"got {len(seeds)} seeds for {len(prompts)} prompts")
        with self._lock, batch_invariant() if self.batch_invariant else nullcontext():
            return self._generate(prompts, params, seeds)

    def _generate(
        self, prompts: list[list[int]], params: SamplingParams, seeds: list[int]
    ) -> Generation:
        model = self.model
        device = next(model.parameters()).device
        B, T = len(prompts), params.max_new_tokens
        lengths_B = torch.tensor([len(p) for p in prompts], device=device)
        prompt_BP = torch.zeros(B, int(lengths_B.max()), dtype=torch.long, device=device)
        for row, prompt in enumerate(prompts):
            prompt_BP[row, : len(prompt)] = torch.tensor(prompt, device=device)
        rngs = [torch.Generator(device=device).manual_seed(int(s)) for s in seeds]
        stop_ids = torch.tensor(sorted(set(params.stop_token_ids)), dtype=torch.long, device=device)

        tokens_BT = torch.zeros(B, T, dtype=torch.long, device=device)
        mask_BT = torch.zeros(B, T, dtype=torch.bool, device=device)
        raw_BT = torch.zeros(B, T, device=device)
        processed_BT = torch.zeros(B, T, device=device)
        done_B = torch.zeros(B, dtype=torch.bool, device=device)

        cache = model.new_kv_cache(B, prompt_BP.shape[1] + T)
        logits_BSV = model(prompt_BP, kv_cache=cache, input_lengths=lengths_B)
        logits_BV = logits_BSV[torch.arange(B, device=device), lengths_B - 1]
        for t in range(T):
            next_B, processed_B = _sample(logits_BV, params, rngs)
            live_B = ~done_B
            tokens_BT[:, t] = torch.where(live_B, next_B, 0)
            mask_BT[:, t] = live_B
            raw_BT[:, t] = torch.where(
                live_B, token_logprobs(logits_BV, next_B, params.temperature), 0
            )
            processed_BT[:, t] = torch.where(live_B, processed_B, 0)
            done_B |= torch.isin(next_B, stop_ids)
            if bool(done_B.all()) or t == T - 1:
                break
            logits_BV = model(tokens_BT[:, t : t + 1], kv_cache=cache)[:, 0]
        ends = mask_BT.sum(1)
        reasons = [
            "stop" if n > 0 and int(tokens_BT[i, n - 1]) in params.stop_token_ids else "length"
            for i, n in enumerate(ends.tolist())
        ]
        width = int(ends.max())
        return Generation(
            tokens=tokens_BT[:, :width].cpu(),
            mask=mask_BT[:, :width].cpu(),
            logprobs=raw_BT[:, :width].cpu(),
            processed_logprobs=processed_BT[:, :width].cpu(),
            finish_reasons=reasons,
            weight_version=self.weight_version,
        )


def _sample(
    logits_BV: torch.Tensor, params: SamplingParams, rngs: list[torch.Generator]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sampled ids ``(B,)`` and their log-probs under the processed distribution."""
    logits_BV = logits_BV.float()
    if params.temperature == 0.0:
        return logits_BV.argmax(-1), torch.zeros(logits_BV.shape[0], device=logits_BV.device)
    scaled_BV = logits_BV / params.temperature if params.temperature != 1.0 else logits_BV
    processed_BV = _top_k_top_p(scaled_BV, params.top_k, params.top_p)
    logp_BV = processed_BV.log_softmax(-1)
    # Exponential race: argmax p_i / E_i with E_i ~ Exp(1) draws i with probability p_i. Each
    # row draws its noise from its own generator, so rows never share randomness.
    noise_BV = torch.stack([torch.empty_like(logp_BV[0]).exponential_(generator=g) for g in rngs])
    next_B = (logp_BV - noise_BV.log()).argmax(-1)
    return next_B, logp_BV.gather(-1, next_B[:, None]).squeeze(-1)


def _top_k_top_p(logits_BV: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Logits with the tokens outside the top-k / top-p set at -inf."""
    if top_k and top_k < logits_BV.shape[-1]:
        kth_B1 = logits_BV.topk(top_k, dim=-1).values[:, -1:]
        logits_BV = logits_BV.masked_fill(logits_BV < kth_B1, float("-inf"))
    if top_p < 1.0:
        sorted_BV, order_BV = logits_BV.sort(dim=-1, descending=True)
        probs_BV = sorted_BV.softmax(-1)
        # Drop a token when the tokens ranked above it already reach top_p (the first stays).
        drop_BV = (probs_BV.cumsum(-1) - probs_BV) >= top_p
        drop_BV = drop_BV.scatter(-1, order_BV, drop_BV)
        logits_BV = logits_BV.masked_fill(drop_BV, float("-inf"))
    return logits_BV
