"""titan_models' linear-attention hybrids (Qwen3.5-MoE, Kimi Linear) as two pipeline stages
(titan_pipeline, 1F1B, two microbatches of packed documents, gloo) train like one process:
the same loss and, rank by rank, the gradients of the parameters the stage holds.

The stages are cut from the model's declarative plan (``ModelPlan.pipeline_units``) and keep
the full model's FQNs; the document ids ride along every stage's forward as side inputs.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import titan_models
import titan_pipeline
from titan_testing import run_distributed

TOLERANCE = 1e-5
FAMILIES = ("qwen3_5_moe", "kimi_linear")


def _build(family: str) -> titan_models.Transformer:
    # No balance loss (it averages over the sequences of one forward, which microbatches
    # change); 8-token chunks, so documents cross chunk boundaries.
    cls, config = titan_models.get_model(
        family, "debug", vocab_size=264, aux_loss_coef=0.0, chunk_size=8
    )
    with torch.device("meta"):
        model = cls(config)
    return model.init_weights(device="cpu", seed=0)


def _stage(model: titan_models.Transformer, modules: set[str]) -> titan_models.Transformer:
    """A copy of ``model`` holding only the top-level modules / blocks in ``modules``."""
    part = copy.deepcopy(model)
    for name in ("tok_embeddings", "norm", "output"):
        if name not in modules:
            setattr(part, name, None)
    for index in [k for k in part.layers if f"layers.{k}" not in modules]:
        del part.layers[index]
    return part


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")


def _pp_checks() -> dict:
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 264, (4, 24), generator=g)
    labels = torch.randint(0, 264, (4, 24), generator=g)
    ids = torch.zeros(4, 24, dtype=torch.long)
    ids[:, 5:] = 1
    ids[:, 17:] = 2
    out = {}
    for family in FAMILIES:
        ref = _build(family)
        ref_loss = _loss(ref(tokens, document_ids=ids), labels)
        ref_loss.backward()

        model = _build(family)
        units = titan_models.get_plan(model.config).pipeline_units
        ranges = titan_pipeline.balance([u.num_params for u in units], 2)
        part = _stage(model, {m for i in ranges[rank] for m in units[i].modules})
        schedule = titan_pipeline.build_schedule("1f1b", num_ranks=2, num_microbatches=2)
        width = model.config.vocab_size if rank == 1 else model.config.dim
        stage = titan_pipeline.PipelineStage(
            part,
            rank,
            2,
            output_spec=lambda shape, _dtype, w=width: ((*shape[:2], w), torch.float32),
        )
        losses = titan_pipeline.run(
            schedule,
            [stage],
            titan_pipeline.split_microbatches(tokens, 2),
            titan_pipeline.split_microbatches(labels, 2),
            _loss,
            loss_scale=1.0,
            stage_kwargs=[{"document_ids": d} for d in ids.chunk(2)],
        )
        ref_params = dict(ref.named_parameters())
        grads = [
            (p.grad - ref_params[name].grad).abs().max().item()
            for name, p in part.named_parameters()
        ]
        out[family] = {
            "loss": abs(sum(float(x) for x in losses) - ref_loss.item()) if rank == 1 else 0.0,
            "grads": max(grads),
            "params": len(grads),
            "units": [units[i].name for i in ranges[rank]],
        }
    return out


@pytest.mark.slow
def test_pp2_of_the_hybrid_families_equals_one_process():
    per_rank = run_distributed(_pp_checks, 2, timeout=600)
    for family in FAMILIES:
        first, last = per_rank[0][family], per_rank[1][family]
        assert first["params"] > 0 and last["params"] > 0
        assert first["units"][0] == "tok_embeddings" and last["units"][-1] == "head"
        for rank, got in enumerate((first, last)):
            assert got["loss"] <= TOLERANCE * 100, (family, rank, got)  # a sum over 96 tokens
            assert got["grads"] <= TOLERANCE, (family, rank, got)
