"""Remat composes with modules wrapped by other libraries: FSDP2 and DTensor parameters.

One 2-rank gloo run. Each rank compares its own plain, unsharded step with the wrapped one on
identical data, so reductions average identical values and gradients must match bitwise.
"""

from __future__ import annotations

import torch

import torch_remat as tr
from titan_testing import run_distributed


def _stack(seed: int):
    from conftest import Stack

    torch.manual_seed(seed)
    model = Stack(layers=2, dim=32)
    tokens = torch.randint(0, 64, (2, 16))
    return model, tokens


class _MLPStack(torch.nn.Module):
    def __init__(self, dim: int = 32, layers: int = 3) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(
            torch.nn.Sequential(
                torch.nn.Linear(dim, 2 * dim),
                torch.nn.GELU(),
                torch.nn.Dropout(0.1),
                torch.nn.Linear(2 * dim, dim),
            )
            for _ in range(layers)
        )

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


def _step(model, tokens) -> None:
    torch.manual_seed(99)
    model(tokens).square().mean().backward()


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _compose_with_fsdp_and_dtensor(tests_dir: str) -> dict[str, bool | int]:
    import sys

    sys.path.insert(0, tests_dir)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Replicate, distribute_module

    mesh = init_device_mesh("cpu", (2,))
    ref, tokens = _stack(0)
    _step(ref, tokens)
    want = [p.grad for p in ref.parameters()]
    out: dict[str, bool | int] = {}
    for name, policy in [
        ("full", tr.Full()),
        ("selective", tr.Selective()),
        ("offload", tr.Offload()),
    ]:
        model, _ = _stack(0)
        tr.apply(model, policy)
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        _step(model, tokens)
        got = [_full(p.grad) for p in model.parameters()]
        out[f"fsdp_{name}"] = all(torch.equal(g, w) for g, w in zip(got, want, strict=True))

    # Tensor-parallel style: every parameter a DTensor (replicated), inputs and output converted
    # at the root by distribute_module's hooks. An MLP stack: DTensor has no sharding rule for
    # the CPU flash-attention op.
    torch.manual_seed(0)
    model = _MLPStack()
    x = torch.randn(4, 8, 32)
    _step(model, x)
    want = [p.grad for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    distribute_module(
        model,
        mesh,
        input_fn=lambda mod, inputs, mesh: tuple(
            DTensor.from_local(x, mesh, [Replicate()]) for x in inputs
        ),
        output_fn=lambda mod, out, mesh: out.to_local(),
    )
    assert all(isinstance(p, DTensor) for p in model.parameters())
    tr.apply(model, tr.Selective(matmul_every=2))
    m = tr.measure(model, (x,), steps=1, warmup=0)
    out["dtensor_saved_bytes"] = m.saved_bytes
    _step(model, x)
    got = [_full(p.grad) for p in model.parameters()]
    out["dtensor_selective"] = all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    return out


def test_remat_under_fsdp2_and_dtensor_parameters_matches_plain_gradients():
    import os

    results = run_distributed(
        _compose_with_fsdp_and_dtensor, 2, os.path.dirname(__file__), timeout=300
    )
    print(results)
    for r in results:
        assert r["fsdp_full"] and r["fsdp_selective"] and r["fsdp_offload"], r
        assert r["dtensor_selective"], r
        assert r["dtensor_saved_bytes"] > 0, r
