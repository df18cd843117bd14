"""Every family's transformer blocks compile with ``fullgraph=True`` (no graph break) and run
forward and backward: the CPU-side evidence that a training step's blocks can be captured
whole (CUDA graphs, regional compile). The attention kernel is the one backend that runs on
CPU with a backward, ``sdpa``; FlexAttention (the CUDA default) compiles in the forward here."""

from __future__ import annotations

import pytest
import torch

import titan_models

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


@pytest.mark.parametrize("family", ["llama3", "qwen3_moe"])
def test_flex_attention_blocks_compile_whole_in_the_forward(family):
    torch._dynamo.reset()
    model = _model(family, "flex")
    ids = torch.randint(0, 200, (1, 32))
    with torch.no_grad():  # FlexAttention has no CPU backward
        eager = model(ids)
        for block in model.layers.values():
            block.compile(fullgraph=True, backend="eager")
        torch.testing.assert_close(model(ids), eager, rtol=1e-5, atol=1e-5)
