"""NCCL on CUDA: the training parity cases on 1-2 GPUs (skipped without CUDA)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _flexshard_cases as C

from titan_testing import cuda_device_count, requires_gpus, run_distributed

CUDA = {"device": "cuda", "reduce": "fp64"}
CASES = {
    "shard0": {"buckets": "shard0", **CUDA},
    "mixed": {"buckets": "mixed", **CUDA},
    "owned_accum": {"buckets": "owned", "accum": 2, **CUDA},
    "shard0_keep_gathered": {"buckets": "shard0", "reshard": False, **CUDA},
    "mixed_bf16": {"buckets": "mixed", "mp": "bf16", "device": "cuda"},
}


@pytest.mark.gpu
@requires_gpus(1)
def test_nccl_training_matches_single_process():
    import torch

    world = min(2, cuda_device_count())
    res = run_distributed(C.run_cases, world, CASES, backend="nccl", timeout=600)
    torch.set_num_threads(1)
    for name, case in CASES.items():
        got = C.assemble([r[name]["chunks"] for r in res])
        want, _ = C.reference(case, world)  # CPU reference: other kernels, so a looser bound
        err, key = C.max_err(got, want)
        tol = 5e-3 if case.get("mp") == "bf16" else 1e-4
        assert err <= tol, f"{name}: {key} differs by {err:.3g}"
