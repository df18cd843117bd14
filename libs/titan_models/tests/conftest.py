"""Tiny random Hugging Face checkpoints, built offline, for parity and interop tests."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

LLAMA_ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def _hf_config(family: str, **overrides):
    import transformers

    common = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    if family == "llama3":
        kw = dict(
            common,
            head_dim=16,
            rope_theta=500_000.0,
            rope_scaling=LLAMA_ROPE_SCALING,
            max_position_embeddings=131_072,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
        )
        kw.update(overrides)
        return transformers.LlamaConfig(**kw)
    if family == "mistral":
        kw = dict(common, head_dim=16, rope_theta=10_000.0, rms_norm_eps=1e-5, sliding_window=8)
        kw.update(overrides)
        return transformers.MistralConfig(**kw)
    if family == "qwen3_moe":
        kw = dict(
            common,
            head_dim=16,
            rope_theta=1_000_000.0,
            rms_norm_eps=1e-6,
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
        )
        kw.update(overrides)
        return transformers.Qwen3MoeConfig(**kw)
    if family == "deepseek_v3":
        kw = dict(
            common,
            num_hidden_layers=3,
            num_key_value_heads=4,
            moe_intermediate_size=32,
            n_routed_experts=8,
            n_shared_experts=1,
            num_experts_per_tok=2,
            n_group=4,
            topk_group=2,
            first_k_dense_replace=1,
            routed_scaling_factor=2.5,
            q_lora_rank=32,
            kv_lora_rank=16,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            rms_norm_eps=1e-6,
            max_position_embeddings=512,
        )
        kw.update(overrides)
        return transformers.DeepseekV3Config(**kw)
    if family in ("qwen3_5", "qwen3_5_moe"):
        kw = dict(
            common,
            head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=8,
            linear_value_head_dim=16,
            layer_types=["linear_attention", "full_attention"],
            rms_norm_eps=1e-6,
        )
        if family == "qwen3_5_moe":
            del kw["intermediate_size"]
            kw.update(
                moe_intermediate_size=32,
                shared_expert_intermediate_size=48,
                num_experts=4,
                num_experts_per_tok=2,
            )
        kw.update(overrides)
        if family == "qwen3_5":
            return transformers.Qwen3_5TextConfig(**kw)
        return transformers.Qwen3_5MoeTextConfig(**kw)
    if family == "kimi_linear":
        kw = dict(
            common,
            num_hidden_layers=3,
            num_key_value_heads=4,
            moe_intermediate_size=32,
            num_local_experts=4,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            kv_lora_rank=16,
            q_lora_rank=None,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            linear_num_heads=4,
            linear_head_dim=16,
            layer_types=["linear_attention", "full_attention", "linear_attention"],
            mlp_layer_types=["dense", "sparse", "sparse"],
            pad_token_id=None,
            bos_token_id=None,
            eos_token_id=None,
        )
        kw.update(overrides)
        return transformers.KimiLinearConfig(**kw)
    kw = dict(common, head_dim=32, rope_theta=1_000_000.0, rms_norm_eps=1e-6)
    kw.update(overrides)
    return transformers.Qwen3Config(**kw)


@pytest.fixture
def hf_checkpoint(tmp_path):
    """``make(family, attn="sdpa", shard=None, fused=False, **config) -> (hf_model, folder)``: a
    random tiny HF model in fp32, saved with ``save_pretrained`` (sharded when ``shard`` is a
    size; MoE experts fused as transformers holds them in memory when ``fused``)."""
    pytest.importorskip("transformers")
    import transformers

    def make(
        family: str,
        *,
        attn: str = "sdpa",
        shard: str | None = None,
        seed: int = 0,
        fused: bool = False,
        **kw,
    ):
        torch.manual_seed(seed)
        config = _hf_config(family, **kw)
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn)
        # Random norm weights, so a mix-up of norms cannot hide behind weights of one; a
        # random selection bias, so a lost e_score_correction_bias changes the routing.
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.uniform_(0.5, 1.5)
            for name, b in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    b.uniform_(-0.05, 0.05)
        folder = tmp_path / f"hf-{family}-{len(list(tmp_path.iterdir()))}"
        extra = {"max_shard_size": shard} if shard else {}
        if fused:  # transformers' in-memory layout on disk (experts.gate_up_proj, ...)
            extra["save_original_format"] = False
        model.save_pretrained(folder, **extra)
        return model, folder

    return make


@pytest.fixture
def token_batch():
    """``make(vocab, seed=1) -> (tokens, labels)``: two random (2, 64) id tensors."""

    def make(vocab: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        return (
            torch.randint(0, vocab, (2, 64), generator=g),
            torch.randint(0, vocab, (2, 64), generator=g),
        )

    return make


@pytest.fixture
def backward_both(token_batch, assert_logits_match):
    """``run(ours, hf)``: the same batch through both models, logits checked to match, then a
    cross-entropy backward through each (gradients left on the parameters)."""
    import torch.nn.functional as F

    def run(ours: torch.nn.Module, hf: torch.nn.Module) -> None:
        vocab = hf.config.vocab_size
        tokens, labels = token_batch(vocab)
        hf_logits = hf(input_ids=tokens).logits
        our_logits = ours(tokens)
        assert our_logits.shape == (2, 64, vocab)
        assert_logits_match(our_logits, hf_logits)
        F.cross_entropy(hf_logits.flatten(0, 1), labels.flatten()).backward()
        F.cross_entropy(our_logits.flatten(0, 1), labels.flatten()).backward()

    return run


@pytest.fixture
def assert_logits_match():
    """``check(ours, theirs)``: same shape, max |Δ| <= 1e-4 and per-token KL <= 1e-6."""
    import torch.nn.functional as F

    def check(ours: torch.Tensor, theirs: torch.Tensor) -> None:
        assert ours.shape == theirs.shape
        assert (ours - theirs).abs().max().item() <= 1e-4
        kl = F.kl_div(
            F.log_softmax(ours, -1), F.log_softmax(theirs, -1), log_target=True, reduction="none"
        ).sum(-1)
        assert kl.max().item() <= 1e-6

    return check


@pytest.fixture
def tp_styles():
    """``styles(plan, model) -> {module name: [TensorParallelPlan fields naming it]}``, after
    checking that every module pattern of the plan names at least one module
    (``head_sharded`` holds parameter patterns, ``head_shared_columns`` a hook on modules
    styled otherwise: neither is a module style)."""
    import dataclasses

    from titan_models import fqn_matches

    def styles(plan, model) -> dict[str, list[str]]:
        tp = plan.tensor_parallel
        names = [n for n, _ in model.named_modules()]
        hooks = ("head_sharded", "head_shared_columns")
        fields = [f.name for f in dataclasses.fields(tp) if f.name not in hooks]
        for field in fields:
            for pattern in getattr(tp, field):
                assert any(fqn_matches(pattern, n) for n in names), (field, pattern)
        for pattern, _ in tp.head_shared_columns:
            assert any(fqn_matches(pattern, n) for n in names), ("head_shared_columns", pattern)
        return {
            n: [f for f in fields if any(fqn_matches(p, n) for p in getattr(tp, f))] for n in names
        }

    return styles


class _FromHfError:
    """``from_hf_error(folder, config=, tensors=) -> str``: the ``ValueError`` message of
    ``from_hf`` after editing ``config.json`` (``{field: value}``, ``None`` deletes it) and/or
    the tensors (``tensors(dict) -> dict``); the files are restored afterwards."""

    def __call__(self, folder, *, config=None, tensors=None) -> str:
        import json

        from safetensors.torch import load_file, save_file

        import titan_models

        config_path, weights = folder / "config.json", folder / "model.safetensors"
        config_text, state = config_path.read_text(), load_file(weights)
        try:
            if config:
                edited = json.loads(config_text)
                for key, value in config.items():
                    if value is None:
                        edited.pop(key, None)
                    else:
                        edited[key] = value
                config_path.write_text(json.dumps(edited))
            if tensors:
                save_file(tensors(dict(state)), weights, metadata={"format": "pt"})
            with pytest.raises(ValueError) as error:
                titan_models.from_hf(folder)
            return str(error.value)
        finally:
            config_path.write_text(config_text)
            save_file(state, weights, metadata={"format": "pt"})

    @staticmethod
    def keys(folder) -> list[str]:
        """The tensor names of ``folder/model.safetensors``, sorted."""
        from safetensors import safe_open

        with safe_open(folder / "model.safetensors", "pt") as f:
            return sorted(f.keys())


@pytest.fixture
def from_hf_error() -> _FromHfError:
    """See ``_FromHfError``."""
    return _FromHfError()
