"""Rollout generation: the ``Generator`` protocol and ``TorchGenerator`` over titan_models.

``TorchGenerator`` runs the very model class the trainer trains (one prefill of the ragged
prompts into the titan_models KV cache, then one token per step) and samples each row with its
own seeded ``torch.Generator``, so a sample depends only on its prompt, its seed and the
weights, never on the other rows of the batch (given batch-invariant logits).

Shapes: B rows, P prompt tokens, T new tokens, V vocabulary.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from titan_models import AttentionMetadata, KVCache
from titan_models.components import CacheStep

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
        compile_decode: bool = False,
        weight_version: int = 0,
    ) -> None:
        """``model``: a titan_models ``Transformer`` (the trainer's, or a copy for async mode).

        ``compile_decode``: run each decode step as one ``torch.compile``d graph of static
        shapes (the cache's full capacity, masked), compiled once per batch size and capacity
        bucket (``_CAPACITY_BUCKET`` tokens); the prefill stays eager. Fused kernels round
        differently, so it cannot be combined with ``batch_invariant``. Steps after the first
        of a call skip dynamo's guard checks (``skip_guard_eval_unsafe``, a process-wide
        stance): other ``torch.compile``d code must not run in another thread meanwhile (in
        titan_rl's async mode the trainer thread runs eager code).
        """
        if not hasattr(model, "new_kv_cache"):
            raise TypeError(f"model must be a titan_models Transformer, got {type(model).__name__}")
        if compile_decode and batch_invariant:
            raise ValueError(
                "TorchGenerator: compile_decode=True cannot be combined with batch_invariant=True "
                "(compiled kernels do not keep the invariant reduction order)"
            )
        self.model = model
        self.batch_invariant = batch_invariant
        self.weight_version = weight_version
        self._lock = threading.Lock()
        self._decode_step = (
            torch.compile(functools.partial(_decode_step, model), fullgraph=True, dynamic=False)
            if compile_decode
            else None
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

        capacity = prompt_BP.shape[1] + T
        if self._decode_step is not None:  # few distinct shapes: few compiles
            capacity = -(-capacity // _CAPACITY_BUCKET) * _CAPACITY_BUCKET
        cache = model.new_kv_cache(B, capacity)
        # The prefill needs logits at each row's last prompt token only: the head (the largest
        # GEMM at small sizes) runs on those B rows, not on all B * P.
        h_BPD, _ = model.run_blocks(prompt_BP, kv_cache=cache, input_lengths=lengths_B)
        logits_BV = model.head(h_BPD[torch.arange(B, device=device), lengths_B - 1])
        vocab = logits_BV.shape[-1]
        sampled = _sample(logits_BV, params, _noise(params, rngs, vocab, device))
        step = self._eager_step if self._decode_step is None else self._static_step(cache)

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
            sampled = step(sampled[0][:, None], cache, params, rngs)
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

    def _eager_step(
        self,
        tokens_B1: torch.Tensor,
        cache: KVCache,
        params: SamplingParams,
        rngs: list[torch.Generator],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits_BV = self.model(tokens_B1, kv_cache=cache)[:, 0]
        device = logits_BV.device
        return _sample(logits_BV, params, _noise(params, rngs, logits_BV.shape[-1], device))

    def _static_step(self, cache: KVCache):
        """The compiled step over ``cache``'s buffers; it advances its own slots (the cache's
        ``lengths`` stay at the prompt lengths)."""
        slots_B = cache.lengths.clone()
        buffers = [(layer.k_BKLD, layer.v_BKLD) for layer in cache.layers.values()]
        vocab = self.model.config.vocab_size

        calls = 0

        def step(tokens_B1, cache, params, rngs):
            nonlocal calls
            noise = _noise(params, rngs, vocab, tokens_B1.device)
            args = (tokens_B1, slots_B, buffers, params, noise)
            calls += 1
            if calls == 1:  # guards checked: picks (or compiles) the graph for these shapes
                return self._decode_step(*args)
            # Later steps of this call have the same shapes, params and weights, so the guards
            # that passed on the first step pass again; evaluating them costs ~0.15 ms a step.
            with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
                return self._decode_step(*args)

        return step


_CAPACITY_BUCKET = 32
"""Compiled decoding rounds the cache capacity up to a multiple of this (fewer recompiles)."""


class _StepCache:
    """A layer's cache for one decode step of the compiled path: the same ``update`` contract
    as titan_models' ``LayerKVCache``, over the full (static) capacity."""

    def __init__(self, k_BKLE: torch.Tensor, v_BKLE: torch.Tensor, slots_B: torch.Tensor):
        self.k_BKLE, self.v_BKLE, self.slots_B = k_BKLE, v_BKLE, slots_B

    def update(self, k_B1KE: torch.Tensor, v_B1KE: torch.Tensor):
        rows_B = torch.arange(self.slots_B.shape[0], device=self.slots_B.device)
        # Advanced indices on dims 0 and 2 around a slice: the value is (B, K, E).
        self.k_BKLE[rows_B, :, self.slots_B] = k_B1KE[:, 0]
        self.v_BKLE[rows_B, :, self.slots_B] = v_B1KE[:, 0]
        return self.k_BKLE, self.v_BKLE


class _DecodeKernels(TorchFunctionMode):
    """The compiled decode step's own forms of two ops, for Inductor to fuse:

    - SDPA of one query per row as plain matmuls + softmax (the CPU flash-attention kernel
      costs more than the arithmetic at decode sizes);
    - ``F.linear`` over a few rows as broadcast products + sums (``_rowwise_linear``)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return _masked_attention(*args, **kwargs)
        if func is F.linear:
            return _rowwise_linear(*args, **kwargs)
        return func(*args, **kwargs)


_ROWWISE_ROWS = range(2, 33)
"""Row counts for which the compiled step writes a linear as products + sums (see
``_rowwise_linear``); measured on the debug model with 8 rows."""


def _rowwise_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear`` written as ``(x[:, None, :] * weight).sum(-1)`` when ``x`` has few rows.

    At decode sizes a GEMM library call gains little from a second thread (the 29 GEMMs of a
    debug-model step: 1.78 ms on 1 thread, 1.51 ms on 2); written as a reduction over each
    weight row, Inductor emits a vectorised dot-product kernel that splits the rows over the
    threads (0.87 ms on 2) and fuses with the norm, activation and residual around it. Meant for tracing: run eagerly, it materialises the ``(M, N, K)`` product first."""
    x_MK = x.reshape(-1, x.shape[-1])
    if x_MK.shape[0] not in _ROWWISE_ROWS:
        return F.linear(x, weight, bias)
    out_MN = (x_MK[:, None, :] * weight).sum(-1)
    if bias is not None:
        out_MN = out_MN + bias
    return out_MN.view(*x.shape[:-1], weight.shape[0])


def _masked_attention(
    q_BHSE: torch.Tensor,
    k_BKLE: torch.Tensor,
    v_BKLE: torch.Tensor,
    attn_mask: torch.Tensor,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """``scaled_dot_product_attention`` with a boolean ``(B, 1, S, L)`` mask; query head ``h``
    reads kv head ``h // (H / K)`` (SDPA's ``enable_gqa`` grouping)."""
    B, H, S, E = q_BHSE.shape
    K = k_BKLE.shape[1]
    scale = E**-0.5 if scale is None else scale
    q_BKGE = q_BHSE.reshape(B, K, (H // K) * S, E)
    scores = (q_BKGE @ k_BKLE.transpose(-1, -2)).mul_(scale).view(B, K, H // K, S, -1)
    scores = scores.masked_fill(~attn_mask[:, :, None], float("-inf")).softmax(-1)
    o_BKGE = scores.view(B, K, (H // K) * S, -1) @ v_BKLE
    return o_BKGE.view(B, H, S, E)


def _decode_step(
    model: nn.Module,
    tokens_B1: torch.Tensor,
    slots_B: torch.Tensor,
    buffers: list[tuple[torch.Tensor, torch.Tensor]],
    params: SamplingParams,
    noise_BV: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One decode step of the model's own blocks with static shapes, then the sampler: each
    row writes its token at its slot, attends to the whole capacity masked to the slots up to
    its own, and moves its slot on."""
    capacity = buffers[0][0].shape[2]
    h_B1D = model.tok_embeddings(tokens_B1)
    rope = model.rope(slots_B[:, None], h_B1D.dtype)
    step = CacheStep(slots=slots_B[:, None], lengths=slots_B, kv_len=capacity, reads_cache=True)
    meta = AttentionMetadata.for_cache_step(step)
    with _DecodeKernels():
        for layer, (k_BKLE, v_BKLE) in zip(model.layers.values(), buffers, strict=True):
            h_B1D = layer(h_B1D, rope, meta, _StepCache(k_BKLE, v_BKLE, slots_B))
    slots_B.add_(1)
    return _sample(model.head(h_B1D)[:, 0], params, noise_BV)


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
