"""Expert parallelism (EP=2 over gloo, dist_moe's AllToAllDispatcher) applied from the plan
gives the logits and gradients of the single-process model, for every MoE family (Qwen3-MoE,
DeepSeek-V3, the linear-attention hybrids Qwen3.5-MoE and Kimi Linear, gpt-oss with its biased
clamped-SwiGLU experts, DeepSeek-V4 with its hash-routed and learned layers).

One ``run_distributed`` call runs every check (spawning ranks costs seconds). Each rank runs
the single-process reference on the whole batch itself, then the EP model on its own row:
its logits must equal the reference's row; an expert's gradient (this rank's slice) must equal
the reference's, since it sums over both ranks' tokens; every other gradient, summed over the
ranks, must equal the reference's (the loss is a sum over rows, so it splits exactly).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

import titan_models
from dist_moe import ExpertPlacement, MoE, expert_parallel, update_expert_biases
from titan_models import fqn_matches
from titan_testing import run_distributed

TOLERANCE = 1e-5
FAMILIES = ("qwen3_moe", "deepseek_v3", "qwen3_5_moe", "kimi_linear", "gpt_oss", "deepseek_v4")


def _build(family: str, **overrides) -> titan_models.Transformer:
    cls, config = titan_models.get_model(family, "debug", vocab_size=264, **overrides)
    with torch.device("meta"):
        model = cls(config)
    return model.init_weights(device="cpu", seed=0)


def _loss(model, tokens, labels):
    """Sum over rows and positions (so two ranks' losses add up to the whole batch's)."""

    def summed(logits_NV, targets_N):
        return F.cross_entropy(logits_NV, targets_N, ignore_index=-100, reduction="sum")

    if getattr(model.config, "num_mtp_modules", 0):
        logits, mtp = model(tokens, return_mtp=True)
        extra = titan_models.mtp_loss(mtp, labels, weight=0.3, loss_fn=summed)
        return logits, mtp, summed(logits.flatten(0, 1), labels.flatten()) + extra
    logits = model(tokens)
    return logits, (), summed(logits.flatten(0, 1), labels.flatten())


def _ep_checks() -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 264, (world, 24), generator=g)
    labels = torch.roll(tokens, -1, dims=1)
    out: dict = {}
    for family in FAMILIES:
        # The sequence balance loss averages over the sequences of one forward, which a split
        # batch changes; it is off here (dist_moe's own EP tests cover it).
        ref = _build(family, aux_loss_coef=0.0)
        ref_logits, ref_mtp, loss = _loss(ref, tokens, labels)
        loss.backward()

        model = _build(family, aux_loss_coef=0.0)
        plan = titan_models.get_plan(model.config)
        placed = {}
        for name, module in model.named_modules():
            if any(fqn_matches(p, name) for p in plan.experts):
                placed[name] = expert_parallel(module)
        row = slice(rank, rank + 1)
        logits, mtp, loss = _loss(model, tokens[row], labels[row])
        loss.backward()

        diffs = {"logits": (logits - ref_logits[row]).abs().max().item()}
        for k, (a, b) in enumerate(zip(mtp, ref_mtp, strict=True)):
            diffs[f"mtp{k}"] = (a - b[row]).abs().max().item()
        ref_params = dict(ref.named_parameters())
        worst_expert, worst_other = 0.0, 0.0
        for name, p in model.named_parameters():
            owner = name.rsplit(".experts.", 1)[0]
            if ".experts." in name and owner in placed:  # w_* and (gpt-oss) b_* rows
                expected = placed[owner].shard(ref_params[name].grad)
                worst_expert = max(worst_expert, (p.grad - expected).abs().max().item())
            elif p.grad is None:  # DeepSeek-V4's indexers: trained by no loss here
                assert ref_params[name].grad is None, name
                diffs.setdefault("no_grad", []).append(name)
            else:
                grad = p.grad.clone()
                dist.all_reduce(grad)
                worst_other = max(worst_other, (grad - ref_params[name].grad).abs().max().item())
        diffs["expert_grads"], diffs["other_grads"] = worst_expert, worst_other
        # Aux-loss-free balancing: the EP counts are summed over the ranks, so every replica
        # makes the reference's update (the reference's all-reduce doubles its counts, which
        # the sign-only rule ignores).
        update_expert_biases(ref)
        update_expert_biases(model)
        biases = [
            (a.router.expert_bias - b.router.expert_bias).abs().max().item()
            for a, b in zip(
                (m for m in model.modules() if isinstance(m, MoE)),
                (m for m in ref.modules() if isinstance(m, MoE)),
                strict=True,
            )
        ]
        diffs["bias"] = max(biases)
        diffs["moved"] = max(
            m.router.expert_bias.abs().max().item() for m in ref.modules() if isinstance(m, MoE)
        )
        diffs["placed"] = sorted(placed)
        out[family] = diffs

    # Bad input: 3 experts over 2 ranks is refused before any collective.
    bad = _build("qwen3_moe", num_experts=3, num_experts_per_tok=2)
    try:
        expert_parallel(bad.layers["0"].feed_forward)
        out["indivisible"] = "no error"
    except ValueError as error:
        out["indivisible"] = str(error)
    assert isinstance(ExpertPlacement(num_experts=8, ep_size=2, ep_rank=rank), ExpertPlacement)
    return out


def test_ep2_matches_ep1_for_every_moe_family():
    per_rank = run_distributed(_ep_checks, 2, timeout=240)
    for rank, out in enumerate(per_rank):
        for family in FAMILIES:
            diffs = out[family]
            for key in ("logits", "expert_grads", "other_grads", "bias"):
                assert diffs[key] <= TOLERANCE, (rank, family, key, diffs[key])
            # Only DeepSeek-V4's lightning indexers have no gradient (no indexer loss).
            no_grad = diffs.get("no_grad", [])
            assert all(".attention.indexer." in n for n in no_grad), (family, no_grad)
            assert bool(no_grad) == (family == "deepseek_v4"), (family, no_grad)
        # DeepSeek-V3 balances without an aux loss: its bias update did something.
        assert out["deepseek_v3"]["moved"] > 0
        assert out["deepseek_v3"]["mtp0"] <= TOLERANCE
        assert out["qwen3_moe"]["placed"] == ["layers.0.feed_forward", "layers.1.feed_forward"]
        assert out["deepseek_v3"]["placed"] == [
            "layers.1.feed_forward",
            "layers.2.feed_forward",
            "mtp.0.feed_forward",
        ]
        assert out["qwen3_5_moe"]["placed"] == [f"layers.{i}.feed_forward" for i in range(4)]
        assert out["kimi_linear"]["placed"] == [f"layers.{i}.feed_forward" for i in (1, 2, 3)]
        assert out["kimi_linear"]["moved"] > 0  # sigmoid routing with the aux-loss-free bias
        every_block = [f"layers.{i}.feed_forward" for i in range(4)]
        assert out["gpt_oss"]["placed"] == every_block
        assert out["deepseek_v4"]["placed"] == every_block  # layer 0 routes by token id
        assert out["deepseek_v4"]["moved"] > 0  # its learned layers balance without aux loss
        assert "num_experts=3 must be divisible" in out["indivisible"], out["indivisible"]
