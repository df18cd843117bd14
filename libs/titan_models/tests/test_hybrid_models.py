"""Qwen3.5, Qwen3.5-MoE and Kimi Linear beyond HF parity: training, the mixed KV cache
(attention caches + recurrent states), packed documents, plans (TP by heads, pipeline units,
experts), published sizes, FLOPs, initialisation and bad input."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import titan_models
from dist_moe import MoE
from titan_models import fqn_matches
from titan_models.components import (
    AttentionMetadata,
    GatedRMSNorm,
    LayerKVCache,
    LayerRecurrentState,
    MoEFeedForward,
    RMSNorm,
)
from titan_models.components.linear_attention import DeltaRuleAttention

FAMILIES = ["qwen3_5", "qwen3_5_moe", "kimi_linear"]
TOL = 1e-5
# Two blocks cover every path: linear attention then attention (Kimi: a dense then a MoE one).
TWO = {"num_layers": 2}


def _model(family: str, seed: int = 0, **overrides) -> titan_models.Transformer:
    cls, config = titan_models.get_model(family, "debug", **overrides)
    with torch.device("meta"):
        model = cls(config)
    return model.init_weights(device="cpu", seed=seed)


def _active_params(model: nn.Module) -> int:
    """Every parameter minus the routed experts a token does not select."""
    total = sum(p.numel() for p in model.parameters())
    for m in model.modules():
        if isinstance(m, MoE):
            r = m.config.router
            experts = sum(p.numel() for p in m.experts.parameters())
            total -= experts * (r.num_experts - r.top_k) // r.num_experts
    return total


# ---- training ---------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_debug_flavor_trains_with_the_byte_tokenizer_vocab(family):
    model = _model(family, vocab_size=264, **TWO)
    tokens = torch.randint(0, 264, (2, 25), generator=torch.Generator().manual_seed(0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(6):
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0] - 0.5, losses


# ---- the mixed KV cache -----------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_cached_decoding_matches_full_forward_for_ragged_prompts(family):
    model = _model(family, vocab_size=512, seed=3, **TWO).eval()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (5, 17, 9)]
    new_tokens, step_logits = titan_models.greedy_generate(model, prompts, max_new_tokens=12)
    with torch.no_grad():
        for row, prompt in enumerate(prompts):
            full = model(torch.tensor(prompt + new_tokens[row].tolist())[None])[0]
            expected = full[len(prompt) - 1 : len(prompt) - 1 + 12]
            diff = (step_logits[row] - expected).abs().max().item()
            assert diff <= TOL, f"row {row}: cached decoding differs by {diff}"


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prefill_equals_one_prefill(family):
    # 8-token chunks: a 13-token prefill continues the cached state over two chunks.
    model = _model(family, vocab_size=512, chunk_size=8, **TWO).eval()
    tokens = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(tokens)
        cache = model.new_kv_cache(2, 32)
        parts = [model(part, kv_cache=cache) for part in tokens.split([10, 1, 13], dim=1)]
    assert (torch.cat(parts, dim=1) - full).abs().max().item() <= TOL
    assert cache.lengths.tolist() == [24, 24]


def test_cache_holds_fixed_size_states_for_linear_layers_and_buffers_for_attention():
    model = _model("qwen3_5")  # debug: linear, attention, linear, attention
    small, large = model.new_kv_cache(2, 16), model.new_kv_cache(2, 4096)
    kinds = [type(small.layers[i]) for i in range(4)]
    assert kinds == [LayerRecurrentState, LayerKVCache, LayerRecurrentState, LayerKVCache]
    c = model.config
    conv = (2 * c.linear_num_key_heads * c.linear_key_head_dim) + (
        c.linear_num_value_heads * c.linear_value_head_dim
    )
    state = c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim
    per_layer = conv * (c.linear_conv_kernel_dim - 1) * 4 + state * 4
    assert small.state_bytes_per_row() == large.state_bytes_per_row() == 2 * per_layer
    assert small.bytes_per_token() == 2 * 2 * c.num_kv_heads * c.head_dim * 4  # two attention
    with torch.no_grad():
        model(torch.zeros(2, 3, dtype=torch.long), kv_cache=small)
    assert small.layers[0].states[3].abs().sum() > 0
    small.reset()
    assert all(t.abs().sum() == 0 for t in small.layers[0].states)


# ---- packed documents -------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_batch_equals_documents_run_separately(family):
    model = _model(family, vocab_size=512, chunk_size=8, **TWO).eval()  # docs cross chunks
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(0, 512, (n,), generator=g) for n in (7, 20, 5)]
    ids = torch.cat([torch.full((len(d),), i) for i, d in enumerate(docs)])[None]
    with torch.no_grad():
        packed = model(torch.cat(docs)[None], document_ids=ids)[0]
        separate = torch.cat([model(d[None])[0] for d in docs])
    assert (packed - separate).abs().max().item() <= TOL


def test_packed_gradients_equal_the_sum_over_documents():
    model = _model("qwen3_5", vocab_size=128, chunk_size=8, **TWO)
    g = torch.Generator().manual_seed(1)
    docs = [torch.randint(0, 128, (n,), generator=g) for n in (6, 11)]
    targets = [torch.randint(0, 128, (len(d),), generator=g) for d in docs]
    ids = torch.cat([torch.full((len(d),), i) for i, d in enumerate(docs)])[None]

    def loss(tokens, target, **kw):
        return F.cross_entropy(model(tokens[None], **kw)[0], target, reduction="sum")

    loss(torch.cat(docs), torch.cat(targets), document_ids=ids).backward()
    packed = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    for d, t in zip(docs, targets, strict=True):
        loss(d, t).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(packed[name], p.grad, atol=1e-5, rtol=1e-4, msg=name)


# ---- plans ------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_plan_places_every_weight_once(tp_styles, family):
    model = _model(family)
    plan = titan_models.get_plan(model.config)
    styles = tp_styles(plan, model)
    modules = dict(model.named_modules())
    moes = {n for n, m in modules.items() if isinstance(m, MoE)}
    assert {n for n in modules if any(fqn_matches(p, n) for p in plan.experts)} == moes
    assert bool(moes) == (family != "qwen3_5")
    for name, module in modules.items():
        if any(name == m or name.startswith(m + ".") for m in moes):
            assert styles[name] == [], name  # experts are placed by EP, not TP
        elif isinstance(module, nn.Linear | nn.Embedding | RMSNorm | GatedRMSNorm):
            assert len(styles[name]) == 1, (name, styles[name])
    # Every other parameter (per-head vectors, conv filters) is split with its heads.
    sharded = plan.tensor_parallel.head_sharded
    for pattern in sharded:
        assert any(fqn_matches(pattern, n) for n, _ in model.named_parameters()), pattern
    for name, _ in model.named_parameters():
        owner = modules[name.rsplit(".", 1)[0]]
        plain = isinstance(owner, nn.Linear | nn.Embedding | RMSNorm | GatedRMSNorm | MoE)
        if not plain and not any(name.startswith(m + ".") for m in moes):
            assert sum(fqn_matches(p, name) for p in sharded) == 1, name


def _shard(mixer: nn.Module, prefix: str, tp, rank: int, ranks: int = 2) -> nn.Module:
    """``mixer`` as TP rank ``rank`` holds it per the plan (colwise rows, rowwise columns,
    head-sharded rows, replicated whole)."""
    shard = copy.deepcopy(mixer)
    for name, param in list(shard.named_parameters()):
        module_name, _, leaf = f"{prefix}.{name}".rpartition(".")
        owner = shard.get_submodule(name.rpartition(".")[0]) if "." in name else shard
        if any(fqn_matches(p, module_name) for p in tp.colwise) or any(
            fqn_matches(p, f"{module_name}.{leaf}") for p in tp.head_sharded
        ):
            piece = param.chunk(ranks, dim=0)[rank]
        elif any(fqn_matches(p, module_name) for p in tp.rowwise):
            piece = param.chunk(ranks, dim=1)[rank]
        else:
            assert any(fqn_matches(p, module_name) for p in tp.replicated), module_name
            piece = param
        setattr(owner, leaf, nn.Parameter(piece.clone()))
    return shard


@pytest.mark.parametrize(("family", "layer"), [("qwen3_5", 0), ("qwen3_5", 1), ("kimi_linear", 0)])
def test_on_the_tp_plan_head_shards_sum_to_the_whole_mixer(family, layer):
    # TP=2 on one process: each "rank" keeps the weights the plan gives it; the rowwise
    # outputs are summed. Covers Gated DeltaNet, Qwen3.5's gated attention and KDA, the
    # recurrent (cached) path included.
    model = _model(family).eval()
    tp = titan_models.get_plan(model.config).tensor_parallel
    whole = model.layers[str(layer)].attention
    prefix = f"layers.{layer}.attention"
    shards = [_shard(whole, prefix, tp, r) for r in range(2)]
    x = torch.randn(2, 12, model.config.dim, generator=torch.Generator().manual_seed(0))
    rope = model.rope(torch.arange(12).expand(2, 12), x.dtype)
    meta = AttentionMetadata.causal(2, 12, "cpu")
    with torch.no_grad():
        expected = whole(x, rope, meta)
        assert (sum(s(x, rope, meta) for s in shards) - expected).abs().max().item() <= TOL
        if isinstance(whole, DeltaRuleAttention):
            caches = [m.new_kv_cache(2, 16) for m in (model, model)]
            local = [
                LayerRecurrentState(
                    c, [torch.zeros(2, *shape) for shape, _ in s.recurrent_state_specs()]
                )
                for c, s in zip(caches, shards, strict=True)
            ]
            for c in caches:
                c.begin(12)
            summed = sum(s(x, rope, meta, st) for s, st in zip(shards, local, strict=True))
            assert (summed - expected).abs().max().item() <= TOL


def test_tensor_parallel_degree_must_divide_every_head_count():
    config = titan_models.get_model("qwen3_5", "debug", linear_num_key_heads=1)[1]
    titan_models.check_tensor_parallel(config, 1)
    with pytest.raises(
        ValueError, match=r"degree 2 must divide Qwen3_5Config.linear_num_key_heads=1"
    ):
        titan_models.check_tensor_parallel(config, 2)
    kimi = titan_models.get_model("kimi_linear", "debug", linear_num_heads=6)[1]
    with pytest.raises(ValueError, match=r"KimiLinearConfig.linear_num_heads=6"):
        titan_models.check_tensor_parallel(kimi, 4)


@pytest.mark.parametrize("family", FAMILIES)
def test_pipeline_units_partition_the_model_and_two_stages_chain(family):
    full = _model(family, vocab_size=264).eval()
    plan = titan_models.get_plan(full.config)
    names = [u.name for u in plan.pipeline_units]
    assert names == ["tok_embeddings", *(f"layers.{i}" for i in range(4)), "head"]
    assert sum(u.num_params for u in plan.pipeline_units) == sum(
        p.numel() for p in full.parameters()
    )
    first, last = _model(family, vocab_size=264).eval(), _model(family, vocab_size=264).eval()
    first.norm = first.output = None
    last.tok_embeddings = None
    for i in range(4):
        del (first if i >= 2 else last).layers[str(i)]
    tokens = torch.randint(0, 264, (2, 16), generator=torch.Generator().manual_seed(0))
    ids = torch.tensor([[0] * 5 + [1] * 11, [0] * 16])
    with torch.no_grad():
        assert torch.equal(
            last(first(tokens, document_ids=ids), document_ids=ids), full(tokens, document_ids=ids)
        )


# ---- sizes and FLOPs --------------------------------------------------------------------

# (family, flavour): published total / active parameters in billions (model cards), for the
# text decoder. Qwen3.5's checkpoints also hold a vision tower and an MTP layer (27.8B on disk
# for "27B"); Kimi Linear's card calls 49.1B "48B".
PUBLISHED = {
    ("qwen3_5", "27B"): (27.0, 27.0, 0.01),
    ("qwen3_5_moe", "35B-A3B"): (35.0, 3.0, 0.01),
    ("kimi_linear", "48B-A3B"): (48.0, 3.0, 0.03),
}


@pytest.mark.parametrize(("family", "flavor"), sorted(PUBLISHED))
def test_meta_build_reports_published_total_and_active_parameters(family, flavor):
    cls, config = titan_models.get_model(family, flavor)
    with torch.device("meta"):
        model = cls(config)
    total, active = sum(p.numel() for p in model.parameters()), _active_params(model)
    print(f"{family} {flavor}: {total:,} total, {active:,} active")
    published_total, published_active, rel = PUBLISHED[family, flavor]
    assert total / 1e9 == pytest.approx(published_total, rel=rel)
    assert abs(active / 1e9 - published_active) <= 0.6  # the cards print one digit


@pytest.mark.parametrize("family", FAMILIES)
def test_matmul_params_are_the_active_matmul_weights(family):
    model = _model(family)
    vectors = sum(
        p.numel()
        for n, p in model.named_parameters()
        if n.endswith(("norm.weight", "dt_bias", "A_log"))
    )
    embedding = model.tok_embeddings.weight.numel()
    assert titan_models.matmul_params(model.config) == _active_params(model) - vectors - embedding


def test_delta_rule_flops_are_three_times_the_counted_forward_matmuls():
    """``delta_rule_flops`` = 3 x the chunked form's forward matmuls (the ``6·N`` convention:
    backward = 2 x forward). FlopCounterMode sees every product but the unit-triangular solve,
    C²(K + V) per chunk and head, added by hand."""
    from torch.utils.flop_counter import FlopCounterMode

    from titan_models.components.linear_attention import chunk_delta_rule
    from titan_models.components.linear_attention.layer_types import delta_rule_flops

    B, S, H, K, V, C = 2, 256, 3, 16, 32, 64
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(B, S, H, K, generator=g) for _ in "qk")
    v, beta = torch.randn(B, S, H, V, generator=g), torch.rand(B, S, H, generator=g)
    decay = -torch.rand(B, S, H, generator=g)
    with FlopCounterMode(display=False) as counter:
        chunk_delta_rule(q, k, v, decay, beta, scale=0.25, chunk_size=C)
    counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    solve = H * C * (K + V) * B * S
    forward = counts.get("aten.mm", 0) + counts["aten.bmm"] + solve
    assert delta_rule_flops(H, K, V, C) * B * S == 3 * forward


def test_flops_per_token_counts_attention_and_linear_layers():
    from titan_models.components.linear_attention.layer_types import delta_rule_flops

    config = titan_models.get_model("qwen3_5_moe", "35B-A3B")[1]
    per_token = titan_models.flops_per_token(config, 4096)
    linear = delta_rule_flops(32, 128, 128, 64)
    expected = 6 * titan_models.matmul_params(config) + 10 * 12 * 16 * 256 * 4096 + 30 * linear
    assert per_token == expected
    kimi = titan_models.get_model("kimi_linear", "48B-A3B")[1]
    mla = 6 * 7 * 32 * (192 + 128) * 4096
    assert titan_models.flops_per_token(kimi, 4096) == (
        6 * titan_models.matmul_params(kimi) + mla + 20 * delta_rule_flops(32, 128, 128, 64)
    )


# ---- initialisation ---------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_init_is_deterministic_and_follows_the_reference_inits(family):
    a, b = _model(family, seed=5), _model(family, seed=5)
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(x, y), name
    zero_centred = family.startswith("qwen3_5")
    for name, module in a.named_modules():
        if isinstance(module, RMSNorm):
            assert torch.equal(module.weight, torch.full_like(module.weight, 1 - module.offset))
            assert module.offset == (1.0 if zero_centred and "kv_norm" not in name else 0.0)
        elif isinstance(module, GatedRMSNorm):
            assert torch.equal(module.weight, torch.ones_like(module.weight)), name
        elif isinstance(module, DeltaRuleAttention):
            rates = module.A_log.exp()
            for conv in (module.conv_q, module.conv_k, module.conv_v):
                bound = 1 / math.sqrt(conv.kernel_size)
                assert conv.weight.abs().max() <= bound, name
            if family == "kimi_linear":  # FLA's KDA init
                assert ((rates >= 1) & (rates <= 16)).all(), name
                dt = F.softplus(module.dt_bias)
                assert ((dt > 0.9e-3) & (dt < 1.1e-1)).all(), name
            else:  # HF Qwen3.5's
                assert ((rates >= 0.01) & (rates <= 16)).all(), name
                assert torch.equal(module.dt_bias, torch.ones_like(module.dt_bias)), name
            assert module.wq.weight.std().item() == pytest.approx(0.02, rel=0.1), name


# ---- bad input --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("family", "override", "match"),
    [
        (
            "qwen3_5",
            {"layer_types": ("linear_attention", "sliding_attention") * 2},
            r"layer_types contains \['sliding_attention'\]",
        ),
        (
            "qwen3_5",
            {"layer_types": ("linear_attention",) * 3},
            "layer_types has 3 entries, num_layers=4",
        ),
        (
            "qwen3_5",
            {"linear_num_value_heads": 3},
            "linear_num_value_heads=3 must be a multiple of linear_num_key_heads=2",
        ),
        ("qwen3_5_moe", {"chunk_size": 48}, "chunk_size must be a power of two, got 48"),
        (
            "qwen3_5_moe",
            {"linear_attention_backend": "cuda"},
            "linear_attention_backend must be one of",
        ),
        ("qwen3_5", {"partial_rotary_factor": 0.1}, "partial_rotary_factor=0.1"),
        ("kimi_linear", {"num_mtp_modules": 1}, "num_mtp_modules must be 0"),
        (
            "kimi_linear",
            {"linear_head_dim": 0},
            r"KimiLinearConfig.linear_head_dim must be an int >= 1",
        ),
    ],
)
def test_invalid_hybrid_config_names_the_field(family, override, match):
    with pytest.raises(ValueError, match=match):
        titan_models.get_model(family, "debug", **override)


def _edit_config(folder, **changes):
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


@pytest.mark.parametrize(
    ("family", "changes", "match"),
    [
        (
            "qwen3_5",
            {"layer_types": ["linear_attention", "mamba"]},
            r"layer_types contains \['mamba'\]",
        ),
        (
            "qwen3_5",
            {"layer_types": ["linear_attention"]},
            "layer_types has 1 entries, num_hidden_layers=2",
        ),
        ("qwen3_5_moe", {"hidden_act": "gelu"}, r"hidden_act='gelu'"),
        (
            "kimi_linear",
            {"moe_router_activation_func": "softmax"},
            r"moe_router_activation_func='softmax'",
        ),
        ("kimi_linear", {"mla_use_nope": False}, r"mla_use_nope=False"),
        (
            "kimi_linear",
            {"mlp_layer_types": ["sparse", "moe", "sparse"]},
            r"mlp_layer_types=\['sparse', 'moe', 'sparse'\] is not supported .*'dense' or "
            r"'sparse'",
        ),
    ],
)
def test_unsupported_hf_hybrid_config_names_the_field(hf_checkpoint, family, changes, match):
    _, folder = hf_checkpoint(family)
    _edit_config(folder, **changes)
    with pytest.raises(ValueError, match=match):
        titan_models.from_hf(folder)


def test_moe_feed_forward_shared_gate_is_initialised():
    model = _model("qwen3_5_moe")
    moe = model.layers["0"].feed_forward
    assert isinstance(moe, MoEFeedForward) and moe.shared_experts.gate is not None
    assert moe.shared_experts.gate.weight.std().item() == pytest.approx(0.02, rel=0.3)
