"""PP 2 on gloo gives the loss and gradients of one process, for the families whose blocks are
not plain residual blocks: gpt-oss (sliding / full attention with sinks, biased experts),
DeepSeek-V4 (its stages send ``hc_mult`` residual streams, and its hash-routed layers need the
token ids on every stage), Qwen3.5-MoE and Kimi Linear (linear-attention state per document),
and Kimi K2.5, Muse Glimmer and Muse Spark on text (a vision tower rides on the first stage and
gets no gradient; Muse Glimmer's stages also split its NoPE / sliding layers and keep the soft
cap on the last; Muse Spark's normed embedding is on the first stage).

One spawn of two ranks runs every family through the app's own path (build on meta, split by
the plan, materialise, one 1F1B step over 2 microbatches of a packed batch). Each rank also
runs the single-process reference on the same microbatches (PP accumulates microbatches as
``grad_accum`` does) and compares the summed loss and the gradients of the parameters its
stage holds; fp32.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from titan_testing import run_distributed
from titan_train.cli import parse_config

FAMILIES = (
    "gpt_oss", "deepseek_v4", "qwen3_5_moe", "kimi_linear", "kimi_k25", "muse_glimmer", "muse_spark",
)  # fmt: skip
TEXT = ["--data.source", "arithmetic"]  # the app's PP takes text batches only
EXTRA = {"kimi_k25": TEXT, "muse_glimmer": TEXT, "muse_spark": TEXT}
TOLERANCE = 1e-5  # fp32; measured 0.0 (the same ops on the same microbatches)
PP2 = [
    "--parallel.pp", "2", "--parallel.dp-shard", "1", "--parallel.pp-microbatches", "2",
    "--training.batch-size", "4", "--training.seq-len", "48", "--metrics.no-tensorboard",
]  # fmt: skip


def _pp2_against_one_process(out: str) -> dict:
    from titan_train.build import build_loaders, build_model, build_parallel, resolve
    from titan_train.losses import loss_sum
    from titan_train.materialize import materialize
    from titan_train.parallelize import build_stages
    from titan_train.pipelined import pipeline_micro_step

    results: dict = {}
    for family in FAMILIES:
        argv = ["--output-dir", f"{out}/{family}", *PP2, *EXTRA.get(family, [])]
        cfg = parse_config(argv, f"{family}_debug")
        job = resolve(cfg)
        pm = build_parallel(job, "cpu")
        materialize(pm, torch.device("cpu"), seed=cfg.training.seed)
        build_stages(pm, cfg)
        batch = next(build_loaders(job)[0])
        assert int(batch.document_ids.amax()) > 0  # packed: every family resets per document
        scale = 1.0 / batch.num_target_tokens
        loss = pipeline_micro_step(pm, batch, torch.tensor(scale), cfg, sync=True)
        dist.all_reduce(loss, group=pm.group("pp"))  # only the last stage holds it

        reference = build_model(job, torch.device("cpu"))
        ref_loss = torch.zeros(())
        for mb in batch.split(cfg.parallel.pp_microbatches):
            part = loss_sum(reference, mb) * scale
            part.backward()
            ref_loss += part.detach()
        ref_grads = dict(reference.named_parameters())
        worst, held, no_grad = 0.0, [], []
        for name, p in pm.named_parameters():
            held.append(name)
            if p.grad is None:
                assert ref_grads[name].grad is None, name
                no_grad.append(name)
                continue
            worst = max(worst, (p.grad - ref_grads[name].grad).abs().max().item())
        results[family] = {
            "loss": loss.item(),
            "ref_loss": ref_loss.item(),
            "grads": worst,
            "held": held,
            "no_grad": no_grad,
            "all": sorted(ref_grads),
        }
    return results


def test_pp2_equals_one_process_for_gpt_oss_deepseek_v4_and_the_hybrids(tmp_path):
    ranks = run_distributed(_pp2_against_one_process, 2, str(tmp_path), timeout=600)
    for family in FAMILIES:
        first, last = ranks[0][family], ranks[1][family]
        print(family, {k: (first[k], last[k]) for k in ("loss", "ref_loss", "grads")})
        for r in (first, last):
            assert abs(r["loss"] - r["ref_loss"]) <= TOLERANCE, (family, r["loss"], r["ref_loss"])
            assert r["grads"] <= TOLERANCE, (family, r["grads"])
            # Only DeepSeek-V4's lightning indexers (no indexer loss) and the unused media
            # towers of a text batch get no gradient.
            assert all(
                ".attention.indexer." in n or n.startswith(("visual.", "audio."))
                for n in r["no_grad"]
            ), r["no_grad"]
        # The two stages split the model: every parameter on exactly one of them.
        assert sorted(first["held"] + last["held"]) == first["all"], family
        assert "tok_embeddings.weight" in first["held"] and "output.weight" in last["held"]
