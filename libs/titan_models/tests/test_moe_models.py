"""Qwen3-MoE and DeepSeek-V3 beyond HF parity: training, plans, sizes, FLOPs, the MLA latent
cache, multi-token prediction, packed documents and bad input."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import titan_models
from dist_moe import MoE, update_expert_biases
from titan_models import AttentionMetadata, fqn_matches
from titan_models.components import MoEFeedForward, RMSNorm
from titan_models.hf_io import named_state

FAMILIES = ["qwen3_moe", "deepseek_v3"]


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
    model = _model(family, vocab_size=264)
    tokens = torch.randint(0, 264, (4, 33), generator=torch.Generator().manual_seed(0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    for _ in range(8):
        if family == "deepseek_v3":  # the app's path: main loss + MTP loss
            logits, mtp = model(inputs, return_mtp=True)
            extra = titan_models.mtp_loss(mtp, labels, weight=model.config.mtp_loss_weight)
        else:
            logits, extra = model(inputs), 0.0
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        (loss + extra).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        update_expert_biases(model)
        losses.append(loss.item())
    assert losses[0] == pytest.approx(math.log(264), rel=0.05)
    assert losses[-1] < 0.8 * losses[0]
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    # The balance loss rides on autograd; its detached value is on each MoE module.
    assert moes and all(m.aux_loss is not None and m.aux_loss.item() > 0 for m in moes)
    if family == "deepseek_v3":  # aux-loss-free balancing moved the selection biases
        assert all(m.router.expert_bias.abs().sum() > 0 for m in moes)


@pytest.mark.parametrize("family", FAMILIES)
def test_init_is_deterministic_and_depth_scaled(family):
    a, b = _model(family, seed=5), _model(family, seed=5)
    for (name, x), (_, y) in zip(named_state(a), named_state(b), strict=True):
        assert torch.equal(x, y), name
    std = a.config.init_std
    out_std = std / math.sqrt(2 * a.config.num_layers)
    moe = next(m for m in a.modules() if isinstance(m, MoEFeedForward))
    assert moe.experts.w_gate.std().item() == pytest.approx(std, rel=0.05)
    assert moe.experts.w_down.std().item() == pytest.approx(out_std, rel=0.05)
    assert torch.equal(moe.router.expert_bias, torch.zeros_like(moe.router.expert_bias))


# ---- plans ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("family", "overrides"),
    [("qwen3_moe", {}), ("deepseek_v3", {}), ("deepseek_v3", {"q_lora_rank": 0})],
)
def test_plan_lists_the_moe_modules_and_tp_covers_everything_else(tp_styles, family, overrides):
    cls, config = titan_models.get_model(family, "debug", **overrides)
    with torch.device("meta"):
        model = cls(config)
    plan = titan_models.get_plan(config)
    modules = dict(model.named_modules())
    moes = {n for n, m in modules.items() if isinstance(m, MoE)}
    assert {n for n in modules if any(fqn_matches(p, n) for p in plan.experts)} == moes
    styles = tp_styles(plan, model)

    for name, module in modules.items():
        inside_moe = any(name == m or name.startswith(m + ".") for m in moes)
        if inside_moe:
            assert styles[name] == [], name  # experts are placed by EP, not TP
        elif isinstance(module, nn.Linear | nn.Embedding | RMSNorm):
            assert len(styles[name]) == 1, (name, styles[name])


@pytest.mark.parametrize("q_lora_rank", [0, 64])
def test_mla_on_the_tp_plans_head_shards_sums_to_the_whole(q_lora_rank):
    # Emulates TP=2 on one process: each "rank" keeps the weights the plan gives it (colwise:
    # its rows, rowwise: its columns, replicated / unsharded: all) and the rowwise outputs are
    # summed.
    model = _model("deepseek_v3", q_lora_rank=q_lora_rank).eval()
    tp = titan_models.get_plan(model.config).tensor_parallel
    full = model.layers["0"].attention
    x = torch.randn(2, 12, model.config.dim, generator=torch.Generator().manual_seed(0))
    rope = model.rope(torch.arange(12).expand(2, 12), x.dtype)
    shards = []
    for rank in range(2):
        shard = copy.deepcopy(full)
        for name, linear in shard.named_children():
            fqn = f"layers.0.attention.{name}"
            if any(fqn_matches(p, fqn) for p in tp.colwise):
                linear.weight = nn.Parameter(linear.weight.chunk(2, dim=0)[rank].clone())
            elif any(fqn_matches(p, fqn) for p in tp.rowwise):
                linear.weight = nn.Parameter(linear.weight.chunk(2, dim=1)[rank].clone())
            else:
                assert any(fqn_matches(p, fqn) for p in (*tp.replicated, *tp.unsharded)), fqn
        shards.append(shard)
    meta = AttentionMetadata.causal(2, 12, "cpu")
    with torch.no_grad():
        whole = full(x, rope, meta)
        summed = sum(shard(x, rope, meta) for shard in shards)
        assert (summed - whole).abs().max().item() <= 1e-5
        # The latent-space (cached) path reads the local heads off the sharded wkv_b as well.
        caches = [model.new_kv_cache(2, 16) for _ in range(3)]
        steps = [AttentionMetadata.for_cache_step(cache.begin(12)) for cache in caches]
        whole = full(x, rope, steps[0], caches[0].layers[0])
        summed = sum(
            s(x, rope, m, c.layers[0])
            for s, m, c in zip(shards, steps[1:], caches[1:], strict=True)
        )
        assert (summed - whole).abs().max().item() <= 1e-5


@pytest.mark.parametrize("family", FAMILIES)
def test_pipeline_units_partition_the_model_and_mtp_goes_with_the_head(family):
    cls, config = titan_models.get_model(family, "debug")
    with torch.device("meta"):
        model = cls(config)
    plan = titan_models.get_plan(config)
    names = [u.name for u in plan.pipeline_units]
    assert names == ["tok_embeddings", *(f"layers.{i}" for i in range(config.num_layers)), "head"]
    owner = {}
    for unit in plan.pipeline_units:
        count = 0
        for top in unit.modules:
            for pname, p in model.get_submodule(top).named_parameters(prefix=top):
                assert pname not in owner, pname
                owner[pname] = unit.name
                count += p.numel()
        assert count == unit.num_params, unit.name
    assert set(owner) == {n for n, _ in model.named_parameters()}
    has_mtp = family == "deepseek_v3"
    assert ("mtp" in plan.pipeline_units[-1].modules) == has_mtp
    assert plan.remat_units == (("layers.*", "mtp.*") if has_mtp else ("layers.*",))


# ---- sizes and FLOPs --------------------------------------------------------------------

# (family, flavour): published total / active parameters in billions (model cards / papers).
PUBLISHED = {
    ("qwen3_moe", "235B-A22B"): (235.0, 22.0),  # Qwen3 tech report
    ("qwen3_moe", "30B-A3B"): (30.5, 3.3),
    ("deepseek_v3", "671B"): (671.0, 37.0),  # DeepSeek-V3 tech report (main model, no MTP)
}


@pytest.mark.parametrize(("family", "flavor"), sorted(PUBLISHED))
def test_meta_build_reports_published_total_and_active_parameters(family, flavor):
    cls, config = titan_models.get_model(family, flavor)
    with torch.device("meta"):
        model = cls(config)
    assert all(t.is_meta for t in [*model.parameters(), *model.buffers()])
    mtp = sum(p.numel() for p in model.mtp.parameters()) if getattr(model, "mtp", None) else 0
    total = sum(p.numel() for p in model.parameters()) - mtp
    active = _active_params(model)
    if mtp:  # the MTP module's active part, to leave the main model's
        active -= _active_params(model.mtp)
    print(f"{family} {flavor}: {total:,} total, {active:,} active (+{mtp:,} MTP)")
    published_total, published_active = PUBLISHED[family, flavor]
    assert total / 1e9 == pytest.approx(published_total, rel=0.01)
    # Active counts include the embedding and the head; the cards round to two digits, so
    # 37.55B prints as "37B" and 3.35B as "3.3B": half a unit of the last printed digit.
    unit = 0.1 if published_active < 10 else 1.0
    assert abs(active / 1e9 - published_active) <= unit * 0.6


def test_671b_with_mtp_matches_the_685b_checkpoint():
    # DeepSeek-V3's HF repo: 685B = 671B main + 14B MTP (whose embedding and head copies we
    # share with the main model instead of holding twice).
    cls, config = titan_models.get_model("deepseek_v3", "671B")
    with torch.device("meta"):
        model = cls(config)
    total = sum(p.numel() for p in model.parameters())
    copies = 2 * config.vocab_size * config.dim
    assert (total + copies) / 1e9 == pytest.approx(685, rel=0.01)


@pytest.mark.parametrize("family", FAMILIES)
def test_matmul_params_are_the_active_matmul_weights(family):
    cls, config = (
        titan_models.get_model(family, "debug", q_lora_rank=0)
        if (family == "deepseek_v3")
        else titan_models.get_model(family, "debug")
    )
    with torch.device("meta"):
        model = cls(config)
    active = _active_params(model)
    norms = sum(p.numel() for n, p in model.named_parameters() if n.endswith("norm.weight"))
    tables = {
        id(p): p.numel() for m in (model.tok_embeddings, model.output) for p in m.parameters()
    }
    heads = 1 + getattr(config, "num_mtp_modules", 0)  # every MTP module runs the head again
    expected = active - norms - sum(tables.values()) + heads * config.vocab_size * config.dim
    assert titan_models.matmul_params(config) == expected
    seq = 128
    layers = config.num_layers + getattr(config, "num_mtp_modules", 0)
    v_dim = getattr(config, "v_head_dim", config.head_dim)
    attention = 6 * layers * config.num_heads * (config.head_dim + v_dim) * seq
    assert titan_models.flops_per_token(config, seq) == 6 * expected + attention


@pytest.mark.parametrize("family", FAMILIES)
def test_flops_formula_matches_the_counted_matmuls(family):
    from torch.utils.flop_counter import FlopCounterMode

    overrides = {"num_mtp_modules": 0} if family == "deepseek_v3" else {}
    cls, config = titan_models.get_model(family, "debug", **overrides)
    model = cls(config).eval()
    B, S = 2, 128
    with FlopCounterMode(display=False) as counter:
        model(torch.zeros(B, S, dtype=torch.long)).sum().backward()
    counted = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    # The counter does not see torch._grouped_mm: add the routed experts by hand (every
    # token-assignment runs 3 matmuls of D x I, 2 FLOPs a multiply-add, x3 with the backward).
    moe_layers = sum(isinstance(m, MoE) for m in model.modules())
    routed = 6 * B * S * config.num_experts_per_tok * 3 * config.dim * config.moe_hidden_dim
    assert (
        counted["aten.mm"] + moe_layers * routed == 6 * titan_models.matmul_params(config) * B * S
    )
    # (Attention is counted per kernel: the CPU flash kernel's backward counts 2.5x its
    # forward, and MLA's v is zero-padded to the q/k width for it; the formula counts 3x of
    # the true widths, as the dense test checks on the meta device.)


# ---- MLA latent KV cache ----------------------------------------------------------------


@pytest.mark.parametrize("q_lora_rank", [pytest.param(0, marks=pytest.mark.slow), 64])
def test_mla_cached_decoding_matches_full_forward_for_ragged_prompts(q_lora_rank):
    model = _model("deepseek_v3", seed=3, vocab_size=512, q_lora_rank=q_lora_rank).eval()
    c = model.config
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (5, 17, 9)]
    new_tokens, step_logits = titan_models.greedy_generate(model, prompts, max_new_tokens=32)
    with torch.no_grad():
        for row, prompt in enumerate(prompts):
            full = model(torch.tensor(prompt + new_tokens[row].tolist())[None])[0]
            expected = full[len(prompt) - 1 : len(prompt) - 1 + 32]
            diff = (step_logits[row] - expected).abs().max().item()
            assert diff <= 1e-5, f"row {row}: cached decoding differs by {diff}"
    cache = model.new_kv_cache(3, 64)
    per_token = cache.bytes_per_token()
    latent = c.num_layers * (c.kv_lora_rank + c.qk_rope_head_dim) * 4
    full_kv = c.num_layers * c.num_heads * (c.head_dim + c.v_head_dim) * 4
    print(f"MLA cache: {per_token} B/token (latent {latent}; per-head K/V would be {full_kv})")
    assert per_token == latent


def test_mla_chunked_prefill_in_latent_space_equals_the_full_forward():
    model = _model("deepseek_v3", seed=3, vocab_size=512).eval()
    tokens = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(tokens)
        cache = model.new_kv_cache(2, 32)
        chunks = [model(part, kv_cache=cache) for part in tokens.split([10, 1, 13], dim=1)]
    assert (torch.cat(chunks, dim=1) - full).abs().max().item() <= 1e-5
    assert cache.lengths.tolist() == [24, 24]


# ---- multi-token prediction -------------------------------------------------------------


def test_mtp_loss_equals_a_hand_derived_value():
    # Logits are log-probabilities, so each cross-entropy is -log p(target) by construction.
    p = torch.tensor([[0.5, 0.25, 0.25], [0.25, 0.5, 0.25], [0.25, 0.25, 0.5]])
    labels = torch.tensor([[1, 2, 0, 1, 2]])  # the main head's targets: tokens 1..5
    documents = torch.tensor([[0, 0, 0, 1, 1]])
    # Module 1 at i predicts labels[i + 1] = [2, 0, 1, 2, -]; module 2: labels[i + 2] = [0, 1,
    # 2, -, -]. Row b of `p` is the distribution each position puts out for module b-1.
    probs1 = torch.stack([p[0], p[0], p[1], p[2], p[2]])  # p(target): .25, .5, .5, .5, -
    probs2 = torch.stack([p[0], p[1], p[2], p[0], p[0]])  # p(target): .5, .5, .5, -, -
    logits = (probs1.log()[None], probs2.log()[None])
    ln2 = math.log(2)
    # Without documents: module 1 = mean(2ln2, ln2, ln2, ln2) = 1.25 ln2; module 2 = ln2.
    got = titan_models.mtp_loss(logits, labels, weight=0.3)
    assert got.item() == pytest.approx(0.3 * (1.25 * ln2 + ln2) / 2, rel=1e-6)
    # Documents [0 0 0 | 1 1]: module 1 drops i = 2 (target in doc 1): mean(2ln2, ln2, ln2);
    # module 2 drops i = 1, 2: ln2 (i = 0 only, p = .5).
    got = titan_models.mtp_loss(logits, labels, document_ids=documents, weight=0.1)
    assert got.item() == pytest.approx(0.1 * ((4 / 3) * ln2 + ln2) / 2, rel=1e-6)
    # ignore_index targets are skipped, and a module with no target left contributes 0.
    masked = torch.tensor([[1, -100, -100, -100, -100]])
    assert titan_models.mtp_loss(logits, masked, weight=1.0).item() == 0.0


def test_mtp_loss_checks_its_inputs():
    logits = (torch.zeros(2, 4, 7),)
    with pytest.raises(ValueError, match=r"mtp_logits\[0\] must have shape \(2, 5, V\)"):
        titan_models.mtp_loss(logits, torch.zeros(2, 5, dtype=torch.long), weight=0.3)
    with pytest.raises(ValueError, match="num_mtp_modules=0"):
        titan_models.mtp_loss((), torch.zeros(2, 4, dtype=torch.long), weight=0.3)


def test_mtp_module_k_sees_tokens_up_to_i_plus_k_and_trains():
    model = _model("deepseek_v3", vocab_size=264, num_mtp_modules=2).eval()
    tokens = torch.randint(0, 264, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits, mtp = model(tokens, return_mtp=True)
        assert torch.equal(logits, model(tokens))  # the main head is unchanged by MTP
        assert [t.shape for t in mtp] == [(2, 16, 264)] * 2
        changed = tokens.clone()
        changed[:, 10] = (changed[:, 10] + 1) % 264
        _, mtp_changed = model(changed, return_mtp=True)
    for k, (a, b) in enumerate(zip(mtp, mtp_changed, strict=True), start=1):
        # Position i of module k reads tokens 0 .. i + k: positions < 10 - k are untouched.
        assert torch.equal(a[:, : 10 - k], b[:, : 10 - k]), k
        assert not torch.equal(a[:, 10 - k], b[:, 10 - k]), k
    model.train()
    labels = torch.roll(tokens, -1, dims=1)
    logits, mtp = model(tokens, return_mtp=True)
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
    (loss + titan_models.mtp_loss(mtp, labels, weight=model.config.mtp_loss_weight)).backward()
    assert all(p.grad is not None for p in model.mtp.parameters())


def test_return_mtp_refuses_a_cache_and_a_pipeline_stage():
    model = _model("deepseek_v3").eval()
    with pytest.raises(ValueError, match="kv_cache"):
        model(
            torch.zeros(1, 4, dtype=torch.long), kv_cache=model.new_kv_cache(1, 8), return_mtp=True
        )
    model.tok_embeddings = None
    with pytest.raises(ValueError, match="pipeline stage"):
        model(torch.zeros(1, 4, 128), return_mtp=True)


def test_mtp_modules_round_trip_through_hf_files(tmp_path):
    transformers = pytest.importorskip("transformers")
    model = _model("deepseek_v3", seed=2, vocab_size=256).eval()
    out = titan_models.to_hf(model, tmp_path / "hf")
    keys = json.loads((out / "config.json").read_text())
    assert keys["num_nextn_predict_layers"] == 1
    again = titan_models.from_hf(out).eval()
    assert again.config == model.config
    for (name, a), (_, b) in zip(named_state(model), named_state(again), strict=True):
        assert torch.equal(a, b), name
    tokens = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, mtp = model(tokens, return_mtp=True)
        assert torch.equal(again(tokens, return_mtp=True)[1][0], mtp[0])
        hf = transformers.AutoModelForCausalLM.from_pretrained(out)  # MTP layer: ignored by HF
        assert (hf(input_ids=tokens).logits - ours).abs().max().item() <= 1e-4


# ---- pipeline stages -------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_two_pipeline_stages_chain_to_the_full_model(family):
    full = _model(family, vocab_size=264).eval()
    first, last = _model(family, vocab_size=264).eval(), _model(family, vocab_size=264).eval()
    split = full.config.num_layers // 2 + 1
    first.norm = first.output = None
    for i in range(split, full.config.num_layers):
        del first.layers[str(i)]
    last.tok_embeddings = None
    for i in range(split):
        del last.layers[str(i)]
    tokens = torch.randint(0, 264, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hidden = first(tokens)
        assert hidden.shape == (2, 16, full.config.dim)
        assert torch.equal(last(hidden), full(tokens))


# ---- packed documents -------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_batch_equals_documents_run_separately(family):
    model = _model(family, vocab_size=512).eval()
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(0, 512, (n,), generator=g) for n in (7, 20, 5)]
    ids = torch.cat([torch.full((len(d),), i) for i, d in enumerate(docs)])[None]
    with torch.no_grad():
        packed = model(torch.cat(docs)[None], document_ids=ids)[0]
        separate = torch.cat([model(d[None])[0] for d in docs])
    assert (packed - separate).abs().max().item() <= 1e-5


# ---- bad input --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("family", "override", "match"),
    [
        ("deepseek_v3", {"head_dim": 64}, r"head_dim=64 must equal qk_nope_head_dim \+ qk_rope"),
        ("deepseek_v3", {"num_kv_heads": 2}, "num_kv_heads=2 must equal num_heads=4"),
        ("deepseek_v3", {"first_k_dense": 9}, r"first_k_dense must be in \[0, num_layers=3\]"),
        ("deepseek_v3", {"num_expert_groups": 3}, "num_expert_groups=3 must be >= 1 and divide"),
        ("deepseek_v3", {"qk_rope_head_dim": 15}, "qk_rope_head_dim must be even"),
        ("deepseek_v3", {"topk_groups": 1, "num_experts_per_tok": 3}, r"must be <= topk_groups"),
        ("qwen3_moe", {"num_experts_per_tok": 9}, "num_experts_per_tok=9 must be <= num_experts=8"),
        ("qwen3_moe", {"num_experts": 0}, r"Qwen3MoeConfig.num_experts must be an int >= 1"),
    ],
)
def test_invalid_moe_config_names_the_field(family, override, match):
    with pytest.raises(ValueError, match=match):
        titan_models.get_model(family, "debug", **override)


@pytest.mark.parametrize(
    ("family", "changes", "match"),
    [
        ("deepseek_v3", {"scoring_func": "softmax"}, r"scoring_func='softmax' is not supported"),
        ("deepseek_v3", {"topk_method": "greedy"}, r"topk_method='greedy' is not supported"),
        ("deepseek_v3", {"num_key_value_heads": 2}, r"num_key_value_heads=2 is not supported"),
        ("qwen3_moe", {"mlp_only_layers": [1]}, r"mlp_only_layers=\[1\] is not supported"),
        ("qwen3_moe", {"decoder_sparse_step": 2}, r"decoder_sparse_step=2 is not supported"),
    ],
)
def test_unsupported_hf_moe_config_names_the_field(hf_checkpoint, family, changes, match):
    _, folder = hf_checkpoint(family)
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=match):
        titan_models.from_hf(folder)


def test_bf16_export_keeps_the_selection_bias_in_fp32(tmp_path):
    from safetensors import safe_open

    model = _model("deepseek_v3", vocab_size=256)
    with torch.no_grad():
        model.layers["1"].feed_forward.router.expert_bias.uniform_(-0.01, 0.01)
    out = titan_models.to_hf(model, tmp_path / "hf", dtype=torch.bfloat16)
    with safe_open(out / "model.safetensors", framework="pt") as f:
        assert f.get_slice("model.layers.1.mlp.gate.weight").get_dtype() == "BF16"
        assert f.get_slice("model.layers.1.mlp.gate.e_score_correction_bias").get_dtype() == "F32"
    again = titan_models.from_hf(out)
    assert {p.dtype for p in again.parameters()} == {torch.bfloat16}
    bias = again.layers["1"].feed_forward.router.expert_bias
    assert bias.dtype == torch.float32
    assert torch.equal(bias, model.layers["1"].feed_forward.router.expert_bias)


def test_to_hf_refuses_expert_parallel_shards_before_writing(tmp_path):
    model = _model("qwen3_moe")
    experts = model.layers["0"].feed_forward.experts
    experts.w_up = nn.Parameter(experts.w_up[:4].clone())  # what expert_parallel leaves a rank
    with pytest.raises(ValueError, match=r"feed_forward.experts.w_up has shape \(4, 64, 128\)"):
        titan_models.to_hf(model, tmp_path / "hf")
    assert not any(tmp_path.iterdir())
