"""vLLM generator for titan_rl: vLLM runs the titan_models model code (out-of-tree model).

Not part of the ``titan_rl`` wheel and not in the main lock (vLLM pins its own torch): it is
installed, with titan_models and titan_rl, into the separate environment that ``build_env.sh``
makes. ``register()`` adds ``TitanForCausalLM`` to vLLM's model registry; an HF folder written
by ``titan_models.to_hf``, opened with ``hf_overrides={"architectures": ["TitanForCausalLM"]}``,
then runs our modules: the embedding, RMSNorms, q/k/v/o projections, QK-norm, RoPE, SwiGLU and
head are titan_models' own; only the attention core is vLLM's paged ``Attention`` (vLLM owns
the KV cache). ``VLLMGenerator`` implements titan_rl's ``Generator`` protocol and takes new
weights straight from the trainer's state dict (``LLM.apply_model``; no disk round trip).

Written against vLLM's documented out-of-tree model interface (``vllm_config``/``prefix``
constructor, ``forward(input_ids, positions, ...)``, ``compute_logits``, ``load_weights``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from functools import partial
from pathlib import Path

import torch
from torch import nn

from titan_models.components.rope import apply_rotary
from titan_models.hf_io import named_state
from titan_models.registry import family_for_hf
from titan_rl import Generation, SamplingParams

ARCHITECTURE = "TitanForCausalLM"


def register() -> None:
    """Make ``TitanForCausalLM`` known to vLLM (call before building an ``LLM``)."""
    from vllm import ModelRegistry

    ModelRegistry.register_model(ARCHITECTURE, "titan_rl_vllm:TitanForCausalLM")


class TitanForCausalLM(nn.Module):
    """titan_models' Transformer with vLLM's paged attention core in every layer."""

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        super().__init__()
        from vllm.model_executor.layers.attention import Attention

        # The folder's own config.json (as titan_models.to_hf wrote it), not vLLM's parsed copy.
        folder = Path(vllm_config.model_config.model)
        self.hf_config = json.loads((folder / "config.json").read_text())
        family = family_for_hf(self.hf_config.get("model_type"))
        self.adapter = family.hf_adapter
        config = self.adapter.config_from_hf(self.hf_config)
        self.model = family.model_cls(config)  # random init; load_weights overwrites it
        if any(not hasattr(layer.attention, "wk") for layer in self.model.layers.values()):
            raise ValueError(f"{family.name}: only GQA attention runs under vLLM (not MLA)")
        # vLLM's attention cores (its paged KV cache, its scale buffers) sit beside our model,
        # so self.model keeps exactly titan_models' state dict.
        self.attn_cores = nn.ModuleList(
            Attention(
                config.num_heads,
                config.head_dim,
                layer.attention.softmax_scale or config.head_dim**-0.5,
                num_kv_heads=config.num_kv_heads,
                cache_config=vllm_config.cache_config,
                prefix=f"{prefix}attn_cores.{index}",
            )
            for index, layer in enumerate(self.model.layers.values())
        )

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings ``(N, D)`` (vLLM's name for the input embedding)."""
        return self.model.tok_embeddings(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors=None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """vLLM flattens the batch: ``input_ids`` and ``positions`` are ``(num_tokens,)``."""
        h_ND = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
        N = h_ND.shape[0]
        rope = self.model.rope(positions[None], h_ND.dtype)
        for layer, core in zip(self.model.layers.values(), self.attn_cores, strict=True):
            a = layer.attention
            x_1ND = layer.attention_norm(h_ND)[None]
            q = a.wq(x_1ND).view(1, N, -1, a.head_dim)
            k = a.wk(x_1ND).view(1, N, -1, a.head_dim)
            v = a.wv(x_1ND).view(N, -1)
            if a.q_norm is not None:
                q, k = a.q_norm(q), a.k_norm(k)
            q, k = apply_rotary(q, rope), apply_rotary(k, rope)
            o_NX = core(q.reshape(N, -1), k.reshape(N, -1), v)
            h_ND = h_ND + a.wo(o_NX)
            h_ND = h_ND + layer.feed_forward(layer.ffn_norm(h_ND))
        return self.model.norm(h_ND)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Logits ``(N, V)`` from the final-norm hidden states."""
        return self.model.output(hidden_states)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy the checkpoint tensors vLLM streams (HF names) into our parameters through
        titan_models' HF key map; returns the names of the parameters filled."""
        targets: dict[str, list[tuple[str, object]]] = {}
        for fqn, param in named_state(self.model):
            for ht in self.adapter.hf_tensors(fqn, param, self.hf_config):
                targets.setdefault(ht.key, []).append((f"model.{fqn}", ht))
        config = self.model.config
        loaded: set[str] = set()
        for key, tensor in weights:
            if key not in targets:
                if self.adapter.is_ignored(key, config):
                    continue
                raise ValueError(f"checkpoint tensor {key!r} has no place in {ARCHITECTURE}")
            for fqn, ht in targets[key]:
                ht.ours.copy_(ht.from_hf(tensor) if ht.from_hf else tensor)
                loaded.add(fqn)
        missing = {fqn for pairs in targets.values() for fqn, _ in pairs} - loaded
        if missing:
            raise ValueError(f"checkpoint lacks tensors for {sorted(missing)}")
        return loaded


class VLLMGenerator:
    """titan_rl ``Generator`` backed by a vLLM ``LLM`` running ``TitanForCausalLM``.

    vLLM reports one log-prob per sampled token; the engine runs in its
    ``processed_logprobs`` mode (after temperature, top-k and top-p), which is titan_rl's
    ``processed_logprobs`` and, without top-k / top-p, also its raw ``logprobs``. With top-k or
    top-p the raw values are not available from vLLM, so ``generate`` refuses those settings
    rather than return log-probs the trainer would misread.
    """

    def __init__(self, model_dir: str | Path, *, weight_version: int = 0, **llm_kwargs) -> None:
        """``model_dir``: an HF folder written by ``titan_models.to_hf``; ``llm_kwargs`` go to
        ``vllm.LLM`` (``max_model_len``, ``gpu_memory_utilization``, ...)."""
        register()
        # update_weights sends a function and the state dict to vLLM's engine process
        # (LLM.apply_model); vLLM pickles such objects only when allowed. Both ends are ours.
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        from vllm import LLM

        self.llm = LLM(
            model=str(model_dir),
            dtype="float32",
            hf_overrides={"architectures": [ARCHITECTURE]},
            skip_tokenizer_init=True,  # token ids in, token ids out: no tokenizer files
            logprobs_mode="processed_logprobs",
            **llm_kwargs,
        )
        self.weight_version = weight_version

    def close(self) -> None:
        """Stop vLLM's engine processes (another ``LLM`` can start in this process after)."""
        self.llm.llm_engine.engine_core.shutdown()

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, seeds: list[int]
    ) -> Generation:
        """Sample one response per prompt through vLLM (see ``titan_rl.Generator``)."""
        from vllm import SamplingParams as VSampling
        from vllm import TokensPrompt

        if len(seeds) != len(prompts):
            raise ValueError(f"got {len(seeds)} seeds for {len(prompts)} prompts")
        if params.top_k or params.top_p < 1.0:
            raise ValueError(
                f"VLLMGenerator: top_k={params.top_k}, top_p={params.top_p}: vLLM reports only "
                "the processed log-probs, so the raw ones titan_rl needs exist only without "
                "top-k / top-p (use top_k=0, top_p=1.0)"
            )
        requests = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        sampling = [
            VSampling(
                max_tokens=params.max_new_tokens,
                temperature=params.temperature,
                stop_token_ids=list(params.stop_token_ids),
                seed=seed,
                logprobs=0,
                detokenize=False,
            )
            for seed in seeds
        ]
        outputs = self.llm.generate(requests, sampling, use_tqdm=False)
        T = max(len(o.outputs[0].token_ids) for o in outputs)
        tokens = torch.zeros(len(prompts), T, dtype=torch.long)
        mask = torch.zeros(len(prompts), T, dtype=torch.bool)
        logprobs = torch.zeros(len(prompts), T)
        reasons = []
        for i, out in enumerate(outputs):
            sample = out.outputs[0]
            n = len(sample.token_ids)
            tokens[i, :n] = torch.tensor(sample.token_ids)
            mask[i, :n] = True
            for t, (tok, entry) in enumerate(
                zip(sample.token_ids, sample.logprobs or [], strict=False)
            ):
                logprobs[i, t] = entry[tok].logprob
            reasons.append("stop" if sample.finish_reason == "stop" else "length")
        return Generation(tokens, mask, logprobs, logprobs.clone(), reasons, self.weight_version)

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Copy the trainer's state dict (titan_models names) into the engine's model in place
        (no disk); names and shapes are checked before anything is written."""
        state = {k: v.detach().cpu() for k, v in state_dict.items()}
        self.llm.apply_model(partial(_load_state, state=state))
        self.weight_version = version


def _load_state(engine_model: nn.Module, *, state: dict[str, torch.Tensor]) -> None:
    """Runs in each vLLM worker: ``state`` into ``engine_model.model``, checked first."""
    own = engine_model.model.state_dict()
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    if missing or unexpected:
        raise ValueError(f"update_weights: missing keys {missing}, unexpected {unexpected}")
    for name, tensor in state.items():
        if tensor.shape != own[name].shape:
            raise ValueError(
                f"update_weights: {name} has shape {tuple(tensor.shape)}, "
                f"the engine's model has {tuple(own[name].shape)}"
            )
    with torch.no_grad():
        for name, tensor in state.items():
            own[name].copy_(tensor)
