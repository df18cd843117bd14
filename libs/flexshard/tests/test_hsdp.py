"""HSDP (a 2-D replicate x shard mesh), nested sharding (experts over their own mesh), the
gradient divide factor, and the global norm's extra / disjoint groups: 4 gloo ranks against
one process."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import flexshard as fs
from flexshard.testing import lm_batch
from titan_testing import run_distributed

VOCAB, DIM, HIDDEN, EXPERTS, BATCH, SEQ, STEPS = 32, 16, 24, 4, 8, 6, 3


class Experts(nn.Module):
    """Stand-in for routed experts: every token through every expert, summed (enough to
    give the experts' weights their own gradient path)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(EXPERTS, DIM, DIM) / DIM)
        self.grad_group = None  # ranks whose tokens these experts also serve (see _SumGrad)

    def forward(self, x):
        w = self.w if self.grad_group is None else _SumGrad.apply(self.w, self.grad_group)
        return torch.einsum("bsd,edf->bsf", x, w)


class _SumGrad(torch.autograd.Function):
    """Identity whose gradient is summed over a group: what expert parallelism's all-to-all
    backward leaves on an expert's weight (every rank's tokens' contributions)."""

    @staticmethod
    def forward(ctx, w, group):
        ctx.group = group
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(DIM, HIDDEN)
        self.w2 = nn.Linear(HIDDEN, DIM)
        self.experts = Experts()

    def forward(self, x):
        return x + self.w2(F.gelu(self.w1(x))) + self.experts(x)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, t):
        x = self.tok_emb(t)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _make() -> Model:
    torch.manual_seed(0)
    return Model()


def _train(model: Model, dp_rank: int, dp: int, *, summed: bool) -> list[float]:
    """AdamW steps on this rank's slice of each global batch; the loss is the global mean
    (``summed``: a sum over local tokens divided by the global count, for divide factor 1)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    b = BATCH // dp
    norms = []
    for step in range(STEPS):
        x, y = lm_batch(VOCAB, BATCH, SEQ, seed=step)
        x, y = x[dp_rank * b : (dp_rank + 1) * b], y[dp_rank * b : (dp_rank + 1) * b]
        logits = model(x).flatten(0, 1)
        if summed:
            loss = F.cross_entropy(logits, y.flatten(), reduction="sum") / (BATCH * SEQ)
        else:
            loss = F.cross_entropy(logits, y.flatten())
        loss.backward()
        norms.append(fs.clip_grad_norm_(model, 1e9).item())
        opt.step()
        opt.zero_grad()
    return norms


def _hsdp_cases() -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    rank = dist.get_rank()
    out: dict = {}
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    dp_rank = mesh["dp_replicate"].get_local_rank() * 2 + mesh["dp_shard"].get_local_rank()

    # HSDP: shards over dp_shard, gradients summed over the replicas too; averaged over 4.
    model = _make()
    fs.shard(model, mesh, mp=fs.MixedPrecision(reduce_dtype=torch.float64))
    out["hsdp_norms"] = _train(model, dp_rank, 4, summed=False)
    out["hsdp_full"] = fs.full_state_dict(model, rank0_only=False)
    out["hsdp_comm"] = fs.comm_stats(model).as_dict()["calls"]

    # Nested: each block's experts sharded first over the replicate dim alone (as experts are
    # over the ranks left by expert parallelism), then the rest over the whole 2-D mesh with
    # a divide factor of 1 (the loss is already divided by the global token count).
    model = _make()
    for layer in model.layers:
        fs.shard(
            layer.experts,
            mesh["dp_replicate"],
            mp=fs.MixedPrecision(reduce_dtype=torch.float64),
            gradient_divide_factor=1.0,
        )
    fs.shard(
        model,
        mesh,
        mp=fs.MixedPrecision(reduce_dtype=torch.float64),
        gradient_divide_factor=1.0,
    )
    for layer in model.layers:
        layer.experts.grad_group = mesh["dp_shard"].get_group()
    out["nested_norms"] = _train(model, dp_rank, 4, summed=True)
    out["nested_full"] = fs.full_state_dict(model, rank0_only=False)
    experts = [layer.experts for layer in model.layers]
    out["nested_experts_full"] = [fs.full_state_dict(e, rank0_only=False)["w"] for e in experts]
    model.set_requires_gradient_sync(False)
    out["nested_sync_flags"] = [e.flexshard_state.sync_grads for e in experts]

    # Global norm with disjoint and extra groups, against the norm of the whole gradient:
    # 2 pipeline stages x 2 data-parallel ranks; each rank holds its own "expert" row
    # (disjoint over its dp group), each stage a parameter replicated over its dp group.
    torch.manual_seed(1)
    whole, stage = torch.randn(4, 5), torch.randn(2, 3)
    mine = nn.Parameter(torch.zeros(5))
    mine.grad = whole[rank].clone()
    shared = nn.Parameter(torch.zeros(3))
    shared.grad = stage[rank // 2].clone()
    pp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    dp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pp, dp = pp_groups[rank % 2], dp_groups[rank // 2]
    norm = fs.global_grad_norm([mine, shared], extra_groups=[pp], disjoint={dp: [mine]})
    out["norm"] = float(norm)
    out["rank"] = rank
    return out


@pytest.fixture(scope="module")
def res():
    return run_distributed(_hsdp_cases, 4, timeout=600, num_threads=1)


def _reference() -> tuple[Model, list[float]]:
    torch.set_num_threads(1)
    ref = _make()
    norms = _train(ref, 0, 1, summed=False)
    return ref, norms


def test_hsdp_replicas_of_shards_train_like_one_process(res):
    ref, norms = _reference()
    want = ref.state_dict()
    for r in res:
        assert r["hsdp_norms"] == pytest.approx(norms, rel=1e-5)
        for k, v in want.items():
            torch.testing.assert_close(r["hsdp_full"][k], v, rtol=0, atol=1e-5)
    # one reduce-scatter per bucket and one all-reduce over the replicas per bucket
    calls = res[0]["hsdp_comm"]
    assert calls["reduce_scatter"] == calls["all_reduce"] > 0


def test_nested_experts_and_divide_factor_one_train_like_one_process(res):
    ref, norms = _reference()
    want = ref.state_dict()
    for r in res:
        assert r["nested_norms"] == pytest.approx(norms, rel=1e-5)
        for k, v in want.items():
            if ".experts." in k:
                layer = int(k.split(".")[1])
                torch.testing.assert_close(r["nested_experts_full"][layer], v, rtol=0, atol=1e-5)
            else:
                torch.testing.assert_close(r["nested_full"][k], v, rtol=0, atol=1e-5)
        assert r["nested_sync_flags"] == [False, False]  # the outer call reached them


def test_global_norm_sums_disjoint_and_extra_groups(res):
    torch.manual_seed(1)
    whole, stage = torch.randn(4, 5), torch.randn(2, 3)
    for r in res:
        want = math.sqrt(float(whole.square().sum()) + float(stage.square().sum()))
        assert r["norm"] == pytest.approx(want, rel=1e-6)
