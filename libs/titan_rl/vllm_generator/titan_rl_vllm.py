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

from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from torch import nn

import titan_models
from titan_models.components.rope import apply_rotary
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
        from vllm.attention import Attention

        folder = Path(vllm_config.model_config.model)
        self.model = titan_models.from_hf(folder, device="cpu")
        config = self.model.config
        for index, layer in self.model.layers.items():
            attn = layer.attention
            attn.vllm_attn = Attention(
                config.num_heads,
                config.head_dim,
                attn.softmax_scale or config.head_dim**-0.5,
                num_kv_heads=config.num_kv_heads,
                cache_config=vllm_config.cache_config,
                prefix=f"{prefix}model.layers.{index}.attention.vllm_attn",
            )

    def get_input_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.tok_embeddings(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        intermediate_tensors=None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """vLLM flattens the batch: ``input_ids`` and ``positions`` are ``(num_tokens,)``."""
        h_ND = inputs_embeds if inputs_embeds is not None else self.get_input_embeddings(input_ids)
        N = h_ND.shape[0]
        rope = self.model.rope(positions[None], h_ND.dtype)
        for layer in self.model.layers.values():
            a = layer.attention
            x_1ND = layer.attention_norm(h_ND)[None]
            q = a.wq(x_1ND).view(1, N, -1, a.head_dim)
            k = a.wk(x_1ND).view(1, N, -1, a.head_dim)
            v = a.wv(x_1ND).view(N, -1)
            if a.q_norm is not None:
                q, k = a.q_norm(q), a.k_norm(k)
            q, k = apply_rotary(q, rope), apply_rotary(k, rope)
            o_NX = a.vllm_attn(q.reshape(N, -1), k.reshape(N, -1), v)
            h_ND = h_ND + a.wo(o_NX)
            h_ND = h_ND + layer.feed_forward(layer.ffn_norm(h_ND))
        return self.model.norm(h_ND)

    def compute_logits(self, hidden_states: torch.Tensor, *args) -> torch.Tensor:
        return self.model.output(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        # The weights were streamed by titan_models.from_hf in __init__; drain vLLM's iterator.
        for _ in weights:
            pass
        return {name for name, _ in self.named_parameters()}


class VLLMGenerator:
    """titan_rl ``Generator`` backed by a vLLM ``LLM`` running ``TitanForCausalLM``."""

    def __init__(self, model_dir: str | Path, *, weight_version: int = 0, **llm_kwargs) -> None:
        register()
        from vllm import LLM

        self.llm = LLM(
            model=str(model_dir),
            dtype="float32",
            hf_overrides={"architectures": [ARCHITECTURE]},
            **llm_kwargs,
        )
        self.weight_version = weight_version

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, seeds: list[int]
    ) -> Generation:
        from vllm import SamplingParams as VSampling
        from vllm import TokensPrompt

        if len(seeds) != len(prompts):
            raise ValueError(f"got {len(seeds)} seeds for {len(prompts)} prompts")
        requests = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        sampling = [
            VSampling(
                max_tokens=params.max_new_tokens,
                temperature=params.temperature,
                top_p=params.top_p,
                top_k=params.top_k or -1,
                stop_token_ids=list(params.stop_token_ids),
                seed=seed,
                logprobs=0,
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
        # vLLM reports the log-probs of its processed distribution only.
        return Generation(tokens, mask, logprobs, logprobs.clone(), reasons, self.weight_version)

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Copy the trainer's weights into the engine's model in place (no disk)."""
        state = {k: v.detach().cpu() for k, v in state_dict.items()}

        def _load(model: nn.Module) -> None:
            with torch.no_grad():
                missing, unexpected = model.model.load_state_dict(state, strict=False)
            # vLLM's attention layers may carry buffers of their own (KV scales): not ours.
            missing = [k for k in missing if ".vllm_attn." not in k]
            if missing or unexpected:
                raise ValueError(f"update_weights: missing {missing}, unexpected {unexpected}")

        self.llm.apply_model(_load)
        self.weight_version = version
