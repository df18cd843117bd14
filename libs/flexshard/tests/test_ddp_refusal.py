"""DistributedDataParallel over flexshard's parameters is refused (2 gloo ranks, one spawn).

Guards the silent corruption a user hit under HF Trainer / Accelerate: DDP's constructor
broadcast rank 0's local shards over rank 1's, and training then ran on with no error. Before
the guard, ``DDP(sharded)`` returned normally and rank 1's shards became rank 0's.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import flexshard as fs
from flexshard.testing import TinyTransformer, lm_batch
from titan_testing import run_distributed


def _model() -> TinyTransformer:
    # Every sharded dim even over 2 ranks: shard shapes agree across ranks, so (before the
    # guard) DDP's shape check passed and its broadcast went through silently.
    torch.manual_seed(0)
    return TinyTransformer(vocab=38, dim=16, n_layers=2, n_heads=2, hidden=42)


def _locals(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _ranks() -> dict[str, object]:
    out: dict[str, object] = {}
    tokens, _ = lm_batch(38, 2, 6, seed=dist.get_rank())

    # 1. DDP straight over the sharded module: refused before any communication.
    model = fs.shard(_model())
    before = _locals(model)
    try:
        DDP(model)
        out["root"] = None
    except RuntimeError as e:
        out["root"] = str(e)
    after = _locals(model)
    out["root_shards_kept"] = all(torch.equal(before[n], after[n]) for n in before)
    rank0 = _rank0_view(before)  # collective: every rank calls it
    out["differs_from_rank0"] = not all(torch.equal(before[n], rank0[n]) for n in before)

    # 2. DDP over a module holding a sharded submodule: the constructor cannot see it; the
    # first forward raises before any backward or optimizer step.
    inner = fs.shard(_model())
    outer = nn.ModuleDict({"lm": inner, "extra": nn.Linear(38, 38)})
    outer.forward = lambda t: outer["extra"](outer["lm"](t))  # type: ignore[method-assign]
    ddp = DDP(outer)
    try:
        ddp(tokens)
        out["nested"] = None
    except RuntimeError as e:
        out["nested"] = str(e)

    # 3. Allowed: every flexshard parameter listed in the ignore list, DDP reduces the rest
    # (here a parameter flexshard was told to leave alone): constructs and trains.
    model = _model()
    fs.shard(model, ignored_params=[model.norm.weight])
    model._ddp_params_and_buffers_to_ignore = [
        n for n, p in model.named_parameters() if fs.param_info(p) is not None
    ]
    ddp = DDP(model)
    ddp(tokens).square().mean().backward()
    g = model.norm.weight.grad.clone()
    dist.all_reduce(g)
    out["ignored_allowed_grad_averaged"] = torch.allclose(model.norm.weight.grad * 2, g)
    return out


def _rank0_view(local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rank 0's local tensors, received on every rank (what DDP's broadcast would leave)."""
    got = {}
    for n, t in local.items():
        u = t.clone()
        dist.broadcast(u, src=0)
        got[n] = u
    return got


@pytest.fixture(scope="module")
def out():
    return run_distributed(_ranks, 2, timeout=300, num_threads=1)


def test_ddp_over_a_sharded_module_raises_and_leaves_the_shards(out):
    for o in out:
        assert o["root"] is not None, "DDP(sharded module) was constructed"
        assert "flexshard" in o["root"] and "FlexShardTrainerMixin" in o["root"], o["root"]
        assert o["root_shards_kept"]
    # The check is not vacuous: rank 1's shards differ from rank 0's, so a broadcast would
    # have changed them.
    assert out[1]["differs_from_rank0"]


def test_ddp_over_a_parent_of_a_sharded_module_raises_at_first_forward(out):
    for o in out:
        assert o["nested"] is not None, "a forward under DDP reducing flexshard shards ran"
        assert "inside the forward of a DistributedDataParallel" in o["nested"], o["nested"]


def test_ddp_ignoring_every_flexshard_parameter_is_allowed(out):
    for o in out:
        assert o["ignored_allowed_grad_averaged"]
