"""2-D composition: Shard(0) buckets over dp on parameters that are tensor-parallel DTensors."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import flexshard as fs
from flexshard.testing import lm_batch
from titan_testing import run_distributed

VOCAB, DIM, HIDDEN, LAYERS, BATCH, SEQ, STEPS = 32, 16, 24, 2, 4, 5, 3


class MLPBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(DIM, eps=1e-6)
        self.w1 = nn.Linear(DIM, HIDDEN)
        self.w2 = nn.Linear(HIDDEN, DIM)

    def forward(self, x):
        return x + self.w2(F.gelu(self.w1(self.norm(x))))


class MLPModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(MLPBlock() for _ in range(LAYERS))
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, t):
        x = self.tok_emb(t)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _make():
    torch.manual_seed(0)
    return MLPModel()


def _loss(model, x, y):
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def _run_2d():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = _make()
    for layer in model.layers:
        parallelize_module(layer, mesh["tp"], {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
    fs.shard(model, mesh["dp"], mp=fs.MixedPrecision(reduce_dtype=torch.float64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    dp = mesh["dp"].get_local_rank()
    b = BATCH // 2
    norms = []
    for step in range(STEPS):
        x, y = lm_batch(VOCAB, BATCH, SEQ, seed=step)
        _loss(model, x[dp * b : (dp + 1) * b], y[dp * b : (dp + 1) * b]).backward()
        norms.append(fs.clip_grad_norm_(model, 1e9).item())
        opt.step()
        opt.zero_grad()
    sd = fs.sharded_state_dict(model)
    full = fs.full_state_dict(model, rank0_only=False)
    chunks = {
        k: [(o, t.clone()) for o, t in v.local_chunks()]
        if isinstance(v, fs.ShardedParam)
        else [((0,) * v.dim(), v.detach().clone())]
        for k, v in sd.items()
    }
    kinds = {n: type(p).__name__ for n, p in model.named_parameters()}
    return {"chunks": chunks, "full": full, "norms": norms, "kinds": kinds, "rank": dist.get_rank()}


def test_shard0_on_tensor_parallel_dtensors_matches_single_process():
    res = run_distributed(_run_2d, 4, timeout=600, num_threads=1)
    torch.set_num_threads(1)
    ref = _make()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    norms = []
    for step in range(STEPS):
        x, y = lm_batch(VOCAB, BATCH, SEQ, seed=step)
        _loss(ref, x, y).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9).item())
        opt.step()
        opt.zero_grad()
    want = {k: v.detach() for k, v in copy.deepcopy(ref).state_dict().items()}
    # local shards are plain tensors; the TP-ness lives in the gathered parameters
    assert set(res[0]["kinds"].values()) == {"Parameter"}
    for r in res:
        assert r["norms"] == pytest.approx(norms, rel=1e-5)
        for k, v in want.items():
            assert torch.allclose(r["full"][k], v, atol=1e-5, rtol=0), k
    # chunks (dp shard of a tp shard, with global offsets) cover each tensor; duplicates
    # (tp-replicated pieces) agree
    for k, v in want.items():
        full = torch.full_like(v, float("nan"))
        for r in res:
            for off, t in r["chunks"][k]:
                idx = tuple(slice(o, o + n) for o, n in zip(off, t.shape, strict=True))
                prev = full[idx]
                assert bool(torch.isnan(prev).all() | (prev == t).all()), k
                full[idx] = t
        assert not torch.isnan(full).any(), k
        assert torch.allclose(full, v, atol=1e-5, rtol=0), k
