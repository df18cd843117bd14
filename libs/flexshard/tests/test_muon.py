"""flexshard.optim.Muon: one device against torch.optim.Muon, distributed against one device."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _flexshard_cases as C

from flexshard.optim import Muon, zeropower_via_newtonschulz
from flexshard.testing import lm_batch
from titan_testing import run_distributed


def test_single_device_equals_torch_muon_and_adamw():
    m1 = C.make_model()
    m2 = copy.deepcopy(m1)
    ref = C.make_optimizer({"optim": "muon"}, m1, sharded=False)
    ours = C.make_optimizer({"optim": "muon"}, m2, sharded=True)
    for s in range(5):
        x, y = lm_batch(C.VOCAB, 4, 6, s)
        for m in (m1, m2):
            F.cross_entropy(m(x).flatten(0, 1), y.flatten()).backward()
        for o in ref + ours:
            o.step()
            o.zero_grad()
    for a, b in zip(m1.parameters(), m2.parameters(), strict=True):
        assert torch.equal(a, b)


def test_newton_schulz_orthogonalises_like_the_paper():
    """Muon's quintic iteration maps singular values into ~[0.7, 1.2] and keeps U, V."""
    g = torch.Generator().manual_seed(0)
    for shape in [(32, 64), (64, 32), (48, 48)]:
        a = torch.randn(*shape, generator=g)
        o = zeropower_via_newtonschulz(a, dtype=torch.float32)
        u, _s, vh = torch.linalg.svd(a, full_matrices=False)
        so = torch.linalg.svdvals(o)
        assert so.min() > 0.6 and so.max() < 1.25, so
        # same singular vectors: U^T O V is (nearly) diagonal
        core = u.T @ o @ vh.T
        off = core - torch.diag(torch.diagonal(core))
        assert off.abs().max() < 1e-3, off.abs().max()
    with pytest.raises(ValueError, match="2-D"):
        zeropower_via_newtonschulz(torch.ones(3))


def test_bad_arguments():
    p = torch.nn.Parameter(torch.ones(3))
    with pytest.raises(ValueError, match="adjust_lr_fn"):
        Muon([p], adjust_lr_fn="nope")
    with pytest.raises(ValueError, match="matrices"):
        Muon([{"params": [p], "use_muon": True}])


X = {"reduce": "fp64", "optim": "muon"}
CASES = {
    "muon_owned": {"buckets": "muon_owned", **X},
    "muon_owned_bytes": {"buckets": "owned", **X},
    "muon_shard0_gather": {"buckets": "shard0", **X},
    "muon_shard1_gather": {"buckets": "shard1", **X},
    "muon_blockshard_gather": {"buckets": "blockshard", **X},
    "muon_replicate": {"buckets": "replicate", **X},
}
TOL = 1e-5


@pytest.mark.parametrize("world", [2, 4])
def test_distributed_muon_matches_single_device(world):
    res = run_distributed(C.run_cases, world, CASES, timeout=600, num_threads=1)
    torch.set_num_threads(1)
    failures = []
    for name, case in CASES.items():
        got = C.assemble([r[name]["chunks"] for r in res])
        want, _ = C.reference(case, world)
        err, key = C.max_err(got, want)
        if err > TOL:
            failures.append(f"{name}: {key} differs by {err:.3g}")
        calls = [r[name]["optim_comm"]["calls"] for r in res]
        if "owned" in name or "replicate" in name:  # no collective in the optimizer step
            assert all(not c for c in calls), calls
        else:  # the baseline gathers each bucket's update once per step
            assert all(c.get("all_gather", 0) > 0 for c in calls), calls
    assert not failures, failures
