"""5 AdamW steps of the debug transformer, sharded every way, against one process (gloo)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _flexshard_cases as C

from titan_testing import run_distributed

# reduce="fp64": gradients are reduced in float64, where the sum of a few fp32 values is
# exact, so the order of the cross-rank sum cannot matter and the distributed run must equal
# the one-process run to the last bit or so (FP32_TOL). The "*_fp32" cases reduce in fp32 (the
# default): a different summation order changes a gradient by an ulp, and Adam divides by
# sqrt(v) + eps, which amplifies that for near-zero gradients (FP32_REDUCE_TOL).
#
# reduce_order="rank" (the "*_ordered" cases): plain fp32 reduction, but each rank adds the
# ranks' contributions in rank order, as the one-process reference does: within FP32_TOL too.
X = {"reduce": "fp64"}
RANK_ORDER = {"reduce_order": "rank"}
CASES = {
    "shard0": {"buckets": "shard0", **X},
    "shard0_keep_gathered_noprefetch": {"buckets": "shard0", "reshard": False, "prefetch": 0, **X},
    "shard0_prefetch2": {"buckets": "shard0", "prefetch": 2, **X},
    "shard1": {"buckets": "shard1", **X},
    "replicate": {"buckets": "replicate", **X},
    "owned": {"buckets": "owned", **X},
    "owned_flops": {"buckets": "owned_flops", **X},
    "blockshard": {"buckets": "blockshard", **X},
    "mixed": {"buckets": "mixed", **X},
    "shard0_accum": {"buckets": "shard0", "accum": 2, **X},
    "shard0_accum_keep_gathered": {"buckets": "shard0", "accum": 2, "reshard": False, **X},
    "owned_accum": {"buckets": "owned", "accum": 2, **X},
    "mixed_accum": {"buckets": "mixed", "accum": 2, **X},
    "shard0_clip": {"buckets": "shard0", "clip": 0.05, **X},
    "mixed_clip": {"buckets": "mixed", "clip": 0.05, **X},
    "shard0_remat": {"buckets": "shard0", "remat": True, **X},
    "mixed_remat_accum": {"buckets": "mixed", "remat": True, "accum": 2, **X},
    "shard0_fp32": {"buckets": "shard0"},
    "shard0_fp32_ordered": {"buckets": "shard0", **RANK_ORDER},
    "owned_fp32_ordered": {"buckets": "owned", **RANK_ORDER},
    "blockshard_fp32_ordered": {"buckets": "blockshard", **RANK_ORDER},
    "replicate_fp32_ordered": {"buckets": "replicate", **RANK_ORDER},
    "mixed_accum_fp32_ordered": {"buckets": "mixed", "accum": 2, **RANK_ORDER},
    "replicate_fp32": {"buckets": "replicate"},
    "mixed_fp32": {"buckets": "mixed"},
    "shard0_bf16": {"buckets": "shard0", "mp": "bf16"},
    "owned_bf16": {"buckets": "owned", "mp": "bf16"},
    "mixed_bf16_accum": {"buckets": "mixed", "mp": "bf16", "accum": 2},
}
FP32_TOL = 1e-6  # vs one process computing each rank's gradient (same kernels, 1 thread)
FP32_REDUCE_TOL = 1e-5
FULL_BATCH_TOL = 1e-5  # vs one backward over the whole batch (other fp32 rounding)
BF16_TOL = 2e-5  # bf16 parameters, fp32 reduction, vs the per-rank bf16 reference


@pytest.fixture(scope="module", params=[2, 4], ids=["world2", "world4"])
def results(request):
    world = request.param
    res = run_distributed(C.run_cases, world, CASES, timeout=900, num_threads=1)
    return world, res


@pytest.mark.parametrize("name", list(CASES))
def test_matches_single_process(results, name):
    import torch

    torch.set_num_threads(1)  # the ranks run single-threaded: same kernels, same rounding
    world, res = results
    case = CASES[name]
    got = C.assemble([r[name]["chunks"] for r in res])
    want, norms = C.reference(case, world)
    err, key = C.max_err(got, want)
    if case.get("mp") == "bf16":
        tol = BF16_TOL
    else:
        exact_sum = case.get("reduce") == "fp64" or case.get("reduce_order") == "rank"
        tol = FP32_TOL if exact_sum else FP32_REDUCE_TOL
    assert err <= tol, f"{name} world={world}: {key} differs by {err:.3g} (> {tol})"
    print(f"{name} world={world}: max |diff| {err:.3g} ({key})")
    if case.get("mp") != "bf16":  # and against one backward over the whole batch
        err, key = C.max_err(got, C.reference(case, world, per_rank=False)[0])
        assert err <= FULL_BATCH_TOL, f"{name} world={world}: {key} differs by {err:.3g}"
    if case.get("clip"):
        for r in res:
            assert r[name]["norms"] == pytest.approx(norms, rel=1e-5), (r[name]["norms"], norms)
        assert norms[0] > case["clip"]  # clipping was active
    accum = case.get("accum", 1)
    for r in res:
        for micro, fwd, bwd in r[name]["micro_comm"]:
            if micro < accum - 1:  # no gradient communication before the last micro-step
                reductions = {"reduce_scatter", "all_reduce", "reduce", "all_to_all"}
                assert not reductions & set(bwd), bwd
                if case.get("reshard") is False:
                    assert not bwd, bwd  # parameters stay gathered: no communication at all
            if micro > 0 and case.get("reshard") is False:
                assert not fwd, fwd  # ...and the next micro-step's forward reuses them
