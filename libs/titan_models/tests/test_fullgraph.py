"""Every family's transformer blocks compile with ``fullgraph=True`` (no graph break) and run
forward and backward: the CPU-side evidence that a training step's blocks can be captured
whole (CUDA graphs, regional compile). The attention kernel is the one backend that runs on
CPU with a backward, ``sdpa``; FlexAttention (the CUDA default) compiles in the forward here.
The MoE layer under expert parallelism (EP 2 on gloo, static-shape all-to-all) compiles whole
too, collectives included."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

import dist_moe
import titan_models
from titan_testing import run_distributed

pytestmark = pytest.mark.slow  # dynamo traces each block: 5-60 s per family on 2 shared cores


def _model(family: str, backend: str) -> torch.nn.Module:
    cls, config = titan_models.get_model(family, "debug", attention_backend=backend)
    with torch.device("meta"):
        model = cls(config)
    return model.init_weights(device="cpu", seed=0)


@pytest.mark.parametrize("family", sorted(titan_models.list_models()))
def test_every_block_compiles_whole_and_matches_eager(family):
    torch._dynamo.reset()
    model = _model(family, "sdpa")
    ids = torch.randint(0, 200, (2, 32))
    docs = torch.tensor([[0] * 20 + [1] * 12, [0] * 32])  # packed documents: masks from ids
    eager = model(ids, document_ids=docs)
    eager.float().square().mean().backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    for block in model.layers.values():
        block.compile(fullgraph=True, backend="eager")  # a graph break raises here
    out = model(ids, document_ids=docs)
    out.float().square().mean().backward()
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-5)
    for name, p in model.named_parameters():
        if name in want:
            torch.testing.assert_close(p.grad, want[name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize(
    "family",
    [pytest.param("llama3", marks=pytest.mark.extended), "qwen3_moe"],  # one flex family in CI
)
def test_flex_attention_blocks_compile_whole_in_the_forward(family):
    torch._dynamo.reset()
    model = _model(family, "flex")
    ids = torch.randint(0, 200, (1, 32))
    with torch.no_grad():  # FlexAttention has no CPU backward
        eager = model(ids)
        for block in model.layers.values():
            block.compile(fullgraph=True, backend="eager")
        torch.testing.assert_close(model(ids), eager, rtol=1e-5, atol=1e-5)


def _ep_moe_compiled_vs_eager() -> tuple[float, float, float]:
    """One rank of EP 2: the first MoE layer of qwen3_moe debug, eager, then compiled with
    ``fullgraph=True``; max |difference| of the output, the parameter and input gradients."""
    model = _model("qwen3_moe", "sdpa")
    moe = next(m for m in model.modules() if isinstance(m, dist_moe.MoE))
    permute = dataclasses.replace(moe.config.permute, static_shapes=True)  # no host sync
    moe.config = dataclasses.replace(moe.config, permute=permute)
    dist_moe.expert_parallel(moe, dist.group.WORLD)
    x = torch.randn(2, 16, moe.config.dim, generator=torch.Generator().manual_seed(dist.get_rank()))
    results = []
    for compiled in (False, True):
        moe.zero_grad(set_to_none=True)
        run = torch.compile(moe, fullgraph=True, backend="eager") if compiled else moe
        xi = x.clone().requires_grad_()
        out = run(xi)
        out.square().mean().backward()
        grads = {n: p.grad.clone() for n, p in moe.named_parameters() if p.grad is not None}
        results.append((out.detach(), grads, xi.grad))
    (o0, g0, x0), (o1, g1, x1) = results
    assert g0.keys() == g1.keys() and g0
    grad_diff = max((g1[n] - g0[n]).abs().max().item() for n in g0)
    return (o1 - o0).abs().max().item(), grad_diff, (x1 - x0).abs().max().item()


def test_the_expert_parallel_moe_layer_compiles_whole():
    # The static-shape all-to-all reads no count on the host, so dynamo traces the layer,
    # its two all-to-alls included, without a break; measured: bitwise equal to eager.
    for diffs in run_distributed(_ep_moe_compiled_vs_eager, 2, timeout=900):
        assert diffs == (0.0, 0.0, 0.0), diffs
