"""Rollout generation: the ``Generator`` protocol and ``TorchGenerator``.

``TorchGenerator`` runs the very model the trainer trains and samples each row with its own
seeded ``torch.Generator``, so a sample depends only on its prompt, its seed and the weights,
never on the other rows of the batch (given batch-invariant logits). A titan_models
``Transformer`` is decoded through its own forward: one prefill of the ragged prompts into a
static KV cache (``static=True``: every step has the same shapes and no host sync), then
``model(tokens, kv_cache=cache)`` once per token; any other causal LM (``titan_rl.CausalLM``)
recomputes the whole sequence each step.

Shapes: B rows, P prompt tokens, T new tokens, V vocabulary.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Protocol, cast, runtime_checkable

import torch
from torch import nn

from titan_models import KVCache, Transformer

from .batch_invariant import batch_invariant
from .causal_lm import causal_lm_logits
from .cpu_decode import RowwiseLinear
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
        """Sample one response per prompt; row ``i`` uses ``seeds[i]``. A generator for a
        vision-language model also takes ``images=`` (its image keyword arguments, rows in
        order); rollouts pass it only for prompts with images."""
        ...

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Load new weights (in memory) and tag what follows with ``version``."""
        ...


class TorchGenerator:
    """Batched sampling from a causal LM (see the module docstring)."""

    def __init__(
        self,
        model: nn.Module,
        *,
        batch_invariant: bool = False,
        compile_decode: bool = False,
        cpu_rowwise_linear: bool = False,
        weight_version: int = 0,
    ) -> None:
        """``model``: a titan_models ``Transformer`` (the fast path: its own forward over a
        static KV cache) or any causal LM that fits ``titan_rl.CausalLM`` (the whole sequence
        recomputed each step); the trainer's model, or a copy for async mode.

        ``compile_decode``: ``torch.compile`` the decode step (the model's forward over the
        static cache, then the sampler) as one graph of fixed shapes, compiled once per batch
        size, capacity bucket (``_CAPACITY_BUCKET`` tokens) and sampling setting; the prefill
        stays eager. Transformer only; not with ``batch_invariant`` (fused kernels round
        differently from the trainer's forward).

        ``cpu_rowwise_linear``: CPU-only opt-in for ``compile_decode``: the decode step's
        linears traced as products and sums (``titan_rl.cpu_decode.RowwiseLinear``), which
        Inductor turns into threaded dot-product loops; the model's forward is unchanged.
        """
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"model must be a torch.nn.Module causal LM (titan_rl.CausalLM), "
                f"got {type(model).__name__}"
            )
        self._cached = isinstance(model, Transformer)
        if compile_decode and not self._cached:
            raise ValueError(
                "TorchGenerator: compile_decode=True needs a titan_models Transformer (the "
                f"static KV cache path); {type(model).__name__} is decoded by recomputing"
            )
        if compile_decode and batch_invariant:
            raise ValueError(
                "TorchGenerator: compile_decode=True cannot be combined with batch_invariant=True "
                "(compiled kernels do not keep the invariant reduction order)"
            )
        if cpu_rowwise_linear:
            where = {p.device.type for p in model.parameters()}
            if not compile_decode or where != {"cpu"}:
                raise ValueError(
                    "TorchGenerator: cpu_rowwise_linear=True is a CPU kernel choice for the "
                    "compiled decode step: it needs compile_decode=True and a model on the CPU "
                    f"(got compile_decode={compile_decode}, parameters on {sorted(where)})"
                )
        self.model = model
        self.batch_invariant = batch_invariant
        self.compile_decode = compile_decode
        self._linear_mode = RowwiseLinear if cpu_rowwise_linear else nullcontext
        self.weight_version = weight_version
        self._lock = threading.Lock()
        step = functools.partial(_decode_step, cast(Transformer, model))  # called if _cached
        self._decode_step = (
            torch.compile(
                step,
                fullgraph=True,
                dynamic=False,
                options={"guard_filter_fn": _model_structure_is_fixed},
            )
            if compile_decode
            else step
        )

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
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        seeds: list[int],
        *,
        images: dict[str, Any] | None = None,
    ) -> Generation:
        """Sample one response per prompt (see ``Generation``). ``images``: for a
        vision-language model, the keyword arguments its prefill takes for the images at the
        prompts' placeholders (``pixel_values``, ``image_grid_thw``), images in prompt order."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("prompts must be a non-empty list of non-empty token lists")
        if len(seeds) != len(prompts):
            raise ValueError(f"got {len(seeds)} seeds for {len(prompts)} prompts")
        if images is not None and not (self._cached and hasattr(self.model, "visual")):
            raise ValueError(
                "generate(images=...) needs a titan_models vision-language model (a "
                f"Transformer with a vision tower); got {type(self.model).__name__}"
            )
        with self._lock, batch_invariant() if self.batch_invariant else nullcontext():
            return self._generate(prompts, params, seeds, images or {})

    def _generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        seeds: list[int],
        images: dict[str, Any],
    ) -> Generation:
        device = next(self.model.parameters()).device
        B, T = len(prompts), params.max_new_tokens
        lengths_B = torch.tensor([len(p) for p in prompts], device=device)
        prompt_BP = torch.zeros(B, int(lengths_B.max()), dtype=torch.long, device=device)
        for row, prompt in enumerate(prompts):
            prompt_BP[row, : len(prompt)] = torch.tensor(prompt, device=device)
        rngs = [torch.Generator(device=device).manual_seed(int(s)) for s in seeds]
        stop_ids = torch.tensor(sorted(set(params.stop_token_ids)), dtype=torch.long, device=device)

        start = self._cached_decoder if self._cached else self._recompute_decoder
        logits_BV, step = start(prompt_BP, lengths_B, T, params, images)
        vocab = logits_BV.shape[-1]
        sampled = _sample(logits_BV, params, _noise(params, rngs, vocab, device))

        # Per step: the model, the sampler and (with stop tokens) one host sync for the stop
        # check; the outputs are assembled once at the end.
        steps, live = [sampled], [torch.ones(B, dtype=torch.bool, device=device)]
        done_B = torch.zeros(B, dtype=torch.bool, device=device)
        for _ in range(T - 1):
            if len(stop_ids):
                done_B = done_B | torch.isin(sampled[0], stop_ids)
                if bool(done_B.all()):
                    break
                live.append(~done_B)
            else:
                live.append(live[0])
            sampled = step(sampled[0][:, None], _noise(params, rngs, vocab, device))
            steps.append(sampled)
        mask_BT = torch.stack(live, 1)
        tokens_BT, raw_BT, processed_BT = (
            torch.stack(column, 1).masked_fill(~mask_BT, 0) for column in zip(*steps, strict=True)
        )
        ends = mask_BT.sum(1)
        reasons = [
            "stop" if n > 0 and int(tokens_BT[i, n - 1]) in params.stop_token_ids else "length"
            for i, n in enumerate(ends.tolist())
        ]
        return Generation(
            tokens=tokens_BT.cpu(),
            mask=mask_BT.cpu(),
            logprobs=raw_BT.cpu(),
            processed_logprobs=processed_BT.cpu(),
            finish_reasons=reasons,
            weight_version=self.weight_version,
        )

    def _cached_decoder(
        self,
        prompt_BP: torch.Tensor,
        lengths_B: torch.Tensor,
        T: int,
        params: SamplingParams,
        images: dict[str, Any],
    ) -> tuple[torch.Tensor, _Step]:
        """A Transformer: one prefill of the ragged prompts (and their images) into a static
        KV cache, then each step is ``model(tokens_B1, kv_cache=cache)`` (compiled or not) and
        the sampler."""
        model = self.model
        assert isinstance(model, Transformer)  # the cached path
        B, P = prompt_BP.shape
        capacity = P + T
        if self.compile_decode:  # few distinct shapes: few compiles
            capacity = -(-capacity // _CAPACITY_BUCKET) * _CAPACITY_BUCKET
        cache = model.new_kv_cache(B, capacity, static=True)
        # The prefill needs logits at each row's last prompt token only: the head (the largest
        # GEMM at small sizes) runs on those B rows, not on all B * P.
        h_BPD, _ = model.run_blocks(prompt_BP, kv_cache=cache, input_lengths=lengths_B, **images)
        logits_BV = model.head(h_BPD[torch.arange(B, device=h_BPD.device), lengths_B - 1])

        def step(tokens_B1: torch.Tensor, noise_BV: torch.Tensor | None) -> _Sampled:
            with self._linear_mode():
                return self._decode_step(tokens_B1, cache, params, noise_BV)

        return logits_BV, step

    def _recompute_decoder(
        self,
        prompt_BP: torch.Tensor,
        lengths_B: torch.Tensor,
        T: int,
        params: SamplingParams,
        images: dict[str, Any],
    ) -> tuple[torch.Tensor, _Step]:
        """Any causal LM: the right-padded rows grow by one token per step and each step runs
        the model over all of them (no cache: O(T²) work, for small models and checks)."""
        B, P = prompt_BP.shape
        rows_B = torch.arange(B, device=prompt_BP.device)
        seq_BL = torch.cat([prompt_BP, prompt_BP.new_zeros(B, T)], dim=1)
        ends_B = lengths_B.clone()  # each row's length: where its next token goes
        width = P

        def step(tokens_B1: torch.Tensor, noise_BV: torch.Tensor | None) -> _Sampled:
            nonlocal width
            seq_BL[rows_B, ends_B] = tokens_B1[:, 0]
            ends_B.add_(1)
            width += 1
            logits_BV = causal_lm_logits(self.model, seq_BL[:, :width])[rows_B, ends_B - 1]
            return _sample(logits_BV, params, noise_BV)

        logits_BV = causal_lm_logits(self.model, prompt_BP)[rows_B, lengths_B - 1]
        return logits_BV, step


_CAPACITY_BUCKET = 32
"""Compiled decoding rounds the cache capacity up to a multiple of this (fewer recompiles)."""

_Sampled = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""The sampler's ``(next ids, raw log-probs, processed log-probs)``, each ``(B,)``."""

_Step = Callable[[torch.Tensor, torch.Tensor | None], _Sampled]
"""One decode step: the last sampled ids ``(B, 1)`` and the step's noise → the next sample."""


def _decode_step(
    model: Transformer,
    tokens_B1: torch.Tensor,
    cache: KVCache,
    params: SamplingParams,
    noise_BV: torch.Tensor | None,
) -> _Sampled:
    """One token per row through the model's own forward over the static cache, then the
    sampler (one graph when compiled: same shapes at every step)."""
    return _sample(model(tokens_B1, kv_cache=cache)[:, 0], params, noise_BV)


def _model_structure_is_fixed(guards: list[Any]) -> list[bool]:
    """The compiled decode step's guards: every tensor's (parameters' shapes, dtypes and
    devices included) and everything outside the model (the cache, the sampling settings);
    not the checks of the model's module attributes and hook dictionaries (~650 of ~850 for
    a 4-layer Llama, evaluated before every step). The generator's contract: the model's
    modules, attributes and hooks stay as they were at the first compiled step; weights may
    change in place (``update_weights``, an optimizer step)."""
    return [
        g.guard_type == "TENSOR_MATCH" or not g.orig_guard.source.is_unspecialized_nn_module()
        for g in guards
    ]


def _noise(
    params: SamplingParams, rngs: list[torch.Generator], vocab: int, device: torch.device
) -> torch.Tensor | None:
    """``(B, V)`` Exp(1) noise for the sampler, row ``b`` from ``rngs[b]`` (rows never share
    randomness); ``None`` when greedy."""
    if params.temperature == 0.0:
        return None
    return torch.stack([torch.empty(vocab, device=device).exponential_(generator=g) for g in rngs])


def _sample(
    logits_BV: torch.Tensor, params: SamplingParams, noise_BV: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sampled ids ``(B,)``, their raw log-probs (``token_logprobs``: after temperature, before
    top-k / top-p) and their log-probs under the processed distribution (0 when greedy)."""
    logits_BV = logits_BV.float()
    if params.temperature == 0.0:
        next_B = logits_BV.argmax(-1)
        processed_B = torch.zeros(logits_BV.shape[0], device=logits_BV.device)
        return next_B, token_logprobs(logits_BV, next_B, params.temperature), processed_B
    scaled_BV = logits_BV / params.temperature if params.temperature != 1.0 else logits_BV
    processed_BV = _top_k_top_p(scaled_BV, params.top_k, params.top_p)
    logp_BV = processed_BV.log_softmax(-1)
    assert noise_BV is not None  # drawn whenever the temperature is not 0
    # Exponential race: argmax p_i / E_i with E_i ~ Exp(1) draws i with probability p_i.
    next_B = (logp_BV - noise_BV.log()).argmax(-1)
    processed_B = logp_BV.gather(-1, next_B[:, None]).squeeze(-1)
    return next_B, token_logprobs(logits_BV, next_B, params.temperature), processed_B


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
