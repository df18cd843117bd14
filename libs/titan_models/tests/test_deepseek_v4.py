"""DeepSeek-V4 reproduces transformers (logits, gradients) for several attention schedules,
compression rates, stream counts and routing modes, round-trips through HF files, and decodes
with its compressed cache like the full forward."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

import titan_models
from titan_models.hf_io import checkpoint_files, named_state

transformers = pytest.importorskip("transformers")

TOL = 1e-4
SLIDING, CSA, HCA = (
    "sliding_attention",
    "compressed_sparse_attention",
    "heavily_compressed_attention",
)

CASES = [
    # Every attention kind, one hash-routed layer, two streams, sqrt-softplus scores.
    pytest.param({}, id="mixed-hash1-hc2-sqrtsoftplus"),
    # CSA only at rate 2 with top-2 of ~20 entries (selection drops most), three streams, sigmoid.
    pytest.param(
        {
            "layer_types": [CSA, CSA],
            "num_hidden_layers": 2,
            "mlp_layer_types": ["moe", "moe"],
            "compress_rates": {CSA: 2, HCA: 8},
            "index_topk": 2,
            "hc_mult": 3,
            "scoring_func": "sigmoid",
        },
        id="csa_only-rate2-top2-hc3-sigmoid",
    ),
    # HCA at rate 16 then sliding, two hash layers, four streams, window 4.
    pytest.param(
        {
            "layer_types": [HCA, SLIDING, HCA],
            "num_hidden_layers": 3,
            "mlp_layer_types": ["hash_moe", "hash_moe", "moe"],
            "compress_rates": {CSA: 4, HCA: 16},
            "hc_mult": 4,
            "sliding_window": 4,
        },
        id="hca_sliding-rate16-hash2-hc4-window4",
    ),
]


def _hf_config(**overrides):
    kw = dict(
        vocab_size=256,
        hidden_size=64,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        q_lora_rank=32,
        num_experts_per_tok=2,
        n_routed_experts=4,
        n_shared_experts=1,
        layer_types=[SLIDING, CSA, HCA, CSA],
        compress_rates={CSA: 4, HCA: 8},
        mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
        hc_mult=2,
        hc_sinkhorn_iters=5,
        sliding_window=8,
        o_groups=2,
        o_lora_rank=16,
        index_n_heads=2,
        index_head_dim=16,
        index_topk=3,
        num_nextn_predict_layers=0,
        max_position_embeddings=512,
        partial_rotary_factor=0.5,
    )
    kw.update(overrides)
    return transformers.DeepseekV4Config(**kw)


@pytest.fixture
def v4_checkpoint(tmp_path):
    """``make(**config) -> (hf_model, folder)``: a random tiny DeepSeek-V4 whose
    hyper-connection maps, compressor position biases, gate biases, sinks and norm weights are
    all random (none of them can hide), saved as transformers saves it."""

    def make(seed: int = 0, **overrides):
        torch.manual_seed(seed)
        hf = transformers.AutoModelForCausalLM.from_config(
            _hf_config(**overrides), attn_implementation="eager"
        ).float()
        with torch.no_grad():
            for name, p in hf.named_parameters():
                if name.endswith("norm.weight"):
                    p.uniform_(0.5, 1.5)
                elif any(s in name for s in ("_hc.", "hc_head", "position_bias", "sinks")):
                    p.normal_(0, 0.5)
            for name, b in hf.named_buffers():
                if name.endswith("e_score_correction_bias"):  # learned layers' gate bias
                    b.normal_(0, 0.5)
        folder = tmp_path / f"v4-{seed}-{len(list(tmp_path.iterdir()))}"
        hf.save_pretrained(folder)
        return hf, folder

    return make


def _grads_as_ours(hf, folder):
    """transformers' gradients in our layout: written as a checkpoint in place of the weights
    (transformers' own save mapping) and read back through our adapter. A weight the loss
    does not reach is written as zero: the indexer's, whose top-k passes no gradient (the
    paper trains it with its own loss, which neither implementation has)."""
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(p.grad if p.grad is not None else torch.zeros_like(p))
    grads_folder = folder.parent / f"{folder.name}-grads"
    hf.save_pretrained(grads_folder)
    return dict(named_state(titan_models.from_hf(grads_folder)))


@pytest.mark.parametrize("overrides", CASES)
def test_logits_and_gradients_match_transformers(v4_checkpoint, overrides):
    hf, folder = v4_checkpoint(**overrides)
    ours = titan_models.from_hf(folder).eval()  # eval: no balance loss, as transformers
    assert type(ours).__name__ == "DeepSeekV4"
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (2, 40), generator=g)
    labels = torch.randint(0, 256, (2, 40), generator=g)
    hf_logits = hf(input_ids=tokens).logits
    our_logits = ours(tokens)
    assert (our_logits - hf_logits).abs().max().item() <= TOL
    F.cross_entropy(hf_logits.flatten(0, 1), labels.flatten()).backward()
    F.cross_entropy(our_logits.flatten(0, 1), labels.flatten()).backward()
    expected = _grads_as_ours(hf, folder)
    for name, param in ours.named_parameters():
        grad = param.grad if param.grad is not None else torch.zeros_like(param)
        diff = (grad - expected[name]).abs().max().item()
        assert diff <= TOL, f"{name}: gradient differs by {diff}"


def test_to_hf_then_from_pretrained_gives_the_same_logits(v4_checkpoint, tmp_path):
    hf, folder = v4_checkpoint()
    ours = titan_models.from_hf(folder)
    out = titan_models.to_hf(ours, tmp_path / "exported", max_shard_size="100KB")
    assert checkpoint_files(out).keys() == checkpoint_files(folder).keys()
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    tokens = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        # Same weights, same HF code: bit-identical logits.
        assert torch.equal(reloaded(input_ids=tokens).logits, hf(input_ids=tokens).logits)
    again = titan_models.from_hf(out)
    for (name, a), (_, b) in zip(named_state(ours), named_state(again), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("layer_types", [[SLIDING, CSA], [HCA, CSA]], ids=["sliding", "hca"])
def test_cached_decoding_matches_full_forward_for_each_attention_kind(layer_types):
    # Ragged prompts that end mid compression block, decoded past several block boundaries.
    cls, config = titan_models.get_model(
        "deepseek_v4", "debug", vocab_size=256, num_layers=2, layer_types=tuple(layer_types),
        mlp_layer_types=("hash_moe", "moe"), index_topk=2,  # CSA keeps 2 of up to 6 entries
        # 16 indexer heads: with 2, an entry's ReLU scores are often all 0, and top-k breaks
        # such ties differently over the full row's entries and the cache's fewer ones.
        index_heads=16,
    )  # fmt: skip
    with torch.device("meta"):
        model = cls(config)
    model.init_weights(device="cpu", seed=3).eval()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 13, 9)]
    new_tokens, step_logits = titan_models.greedy_generate(model, prompts, max_new_tokens=12)
    with torch.no_grad():
        for row, prompt in enumerate(prompts):
            full = model(torch.tensor(prompt + new_tokens[row].tolist())[None])[0]
            expected = full[len(prompt) - 1 : len(prompt) - 1 + 12]
            diff = (step_logits[row] - expected).abs().max().item()
            assert diff <= 1e-5, f"row {row}: cached decoding differs by {diff}"


BAD_V4_FIELDS = [
    ({"num_key_value_heads": 2}, r"num_key_value_heads=2 is not supported"),
    ({"n_shared_experts": 2}, r"n_shared_experts=2 is not supported"),
    ({"norm_topk_prob": False}, r"norm_topk_prob=False is not supported"),
    ({"router_jitter_noise": 0.1}, r"router_jitter_noise=0.1 is not supported"),
    ({"scoring_func": "tanh"}, r"scoring_func='tanh' is not supported"),
    ({"attention_bias": True}, r"attention_bias=True is not supported"),
    ({"hidden_act": "gelu"}, r"hidden_act='gelu' is not supported"),
    ({"layer_types": [SLIDING, CSA, "chunked_attention", CSA]}, r"layer_types=.*chunked"),
    ({"mlp_layer_types": ["hash_moe", "dense", "moe", "moe"]}, r"mlp_layer_types=.*dense"),
    ({"layer_types": None, "compress_ratios": [0, 4, 64, 4]}, r"compress_ratios has \[64\]"),
    ({"quantization_config": {"quant_method": "fp8"}}, r"quantization_config"),
    ({"hidden_size": None}, r"hidden_size is missing"),
]


def test_unsupported_config_fields_and_tensor_dtypes_are_named(v4_checkpoint, from_hf_error):
    _, folder = v4_checkpoint()
    for edit, match in BAD_V4_FIELDS:
        message = from_hf_error(folder, config=edit)
        assert re.search(match, message), (edit, message)
    # An FP8 expert weight (the released checkpoints' storage) and a float hash table.
    keys = from_hf_error.keys(folder)
    expert = next(k for k in keys if ".experts." in k)
    table = next(k for k in keys if k.endswith("tid2eid"))

    def fp8(t):
        t[expert] = t[expert].to(torch.float8_e4m3fn)
        return t

    def float_table(t):
        t[table] = t[table].float()
        return t

    message = from_hf_error(folder, tensors=fp8)
    assert f"{expert}: dtype F8_E4M3 is not a floating dtype" in message, message
    message = from_hf_error(folder, tensors=float_table)
    assert f"{table}: dtype F32 is not an integer dtype" in message, message
    titan_models.from_hf(folder)  # restored: loads
