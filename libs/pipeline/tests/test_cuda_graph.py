"""CUDA-graph mode of a pipeline stage: refused off CUDA, captured once per fixed microbatch
shape, and (on a GPU) losses and gradients equal to eager's."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from titan_pipeline import PipelineStage
from titan_pipeline import stage as stage_module
from titan_testing import requires_gpus


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))


def test_cuda_graph_stage_is_refused_without_cuda_and_checks_its_flag():
    if torch.cuda.is_available():
        pytest.skip("the refusal is for machines without CUDA")
    with pytest.raises(ValueError, match=r"cuda_graph=True\) captures CUDA graphs.*cpu"):
        PipelineStage(_mlp(), 0, 2, cuda_graph=True)
    with pytest.raises(ValueError, match="cuda_graph must be a bool, got 1"):
        PipelineStage(_mlp(), 0, 2, cuda_graph=1)  # pyrefly: ignore[bad-argument-type]
    assert PipelineStage(_mlp(), 0, 2).cuda_graph is False  # eager by default


def test_cuda_graph_stage_captures_once_and_refuses_other_shapes_kwargs_and_split(monkeypatch):
    # The capture itself needs a GPU: stand in for it to check the stage's bookkeeping.
    captured = []

    def fake_capture(module, sample_args):
        captured.append(tuple(a.shape for a in sample_args))
        return module

    monkeypatch.setattr(stage_module, "_check_cuda_module", lambda module: None)
    monkeypatch.setattr(torch.cuda, "make_graphed_callables", fake_capture)
    st = PipelineStage(_mlp(), 1, 2, cuda_graph=True)
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="needs CUDA tensors, got an input on cpu"):
        st._forward(0, x, {})
    monkeypatch.setattr(torch.Tensor, "device", property(lambda t: torch.device("cuda", 0)))
    st._forward(0, x, {})
    st._forward(1, x + 1, {})
    assert captured == [((4, 8),)]  # one capture, replayed for the second microbatch
    with pytest.raises(ValueError, match=r"captured for microbatches of.*\(4, 8\).*\(2, 8\)"):
        st._forward(2, torch.randn(2, 8), {})
    with pytest.raises(ValueError, match=r"one tensor input, got keyword inputs \['mask'\]"):
        st._forward(3, x, {"mask": x})
    with pytest.raises(ValueError, match="without the zero-bubble I/W split"):
        st._backward(0, torch.ones(4, 8), split=True)


@pytest.mark.gpu
@requires_gpus(1)
def test_cuda_graph_stage_losses_and_gradients_equal_eager_on_cuda():
    results = []
    for graph in (False, True):
        module = _mlp().cuda()
        st = PipelineStage(module, 1, 2, cuda_graph=graph)
        outs = []
        for mb in range(3):
            x = torch.randn(4, 8, device="cuda", generator=torch.Generator("cuda").manual_seed(mb))
            y = st._forward(mb, x, {})
            outs.append(y.clone())
            outs.append(st._backward(mb, torch.ones_like(y), split=False).clone())
        torch.cuda.synchronize()
        results.append((outs, [p.grad.clone() for p in module.parameters()]))
    (eager_outs, eager_grads), (graph_outs, graph_grads) = results
    for a, b in zip(eager_outs + eager_grads, graph_outs + graph_grads, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)  # same kernels, replayed
