"""Packed sequences with document masking behave as the documents run one by one."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import titan_models
from titan_models.components import positions_from_document_ids


@pytest.mark.parametrize(
    ("family", "overrides"),
    [
        ("llama3", {}),
        ("qwen3", {}),
        # Layer 1 slides over 6 tokens, shorter and longer than the documents; both backends.
        ("qwen3", {"sliding_window": 6, "sliding_window_layers": (1,)}),
        ("qwen3", {"sliding_window": 6, "attention_backend": "sdpa"}),
    ],
)
def test_packed_batch_equals_documents_run_separately(family, overrides):
    cls, config = titan_models.get_model(family, "debug", num_layers=2, vocab_size=512, **overrides)
    model = cls(config).eval()
    g = torch.Generator().manual_seed(0)
    rows = [[7, 20, 5], [32]]  # document lengths per packed row, 32 tokens each
    docs = [[torch.randint(0, 512, (n,), generator=g) for n in row] for row in rows]
    tokens = torch.stack([torch.cat(row) for row in docs])
    document_ids = torch.stack(
        [torch.cat([torch.full((len(d),), i) for i, d in enumerate(row)]) for row in docs]
    )
    with torch.no_grad():
        packed = model(tokens, document_ids=document_ids)
        separate = torch.stack([torch.cat([model(d[None])[0] for d in row]) for row in docs])
    assert (packed - separate).abs().max().item() <= 1e-5


def test_packed_gradients_equal_the_sum_over_documents():
    cls, config = titan_models.get_model("llama3", "debug", num_layers=1, vocab_size=128)
    model = cls(config)
    g = torch.Generator().manual_seed(1)
    docs = [torch.randint(0, 128, (n,), generator=g) for n in (6, 10)]
    targets = [torch.randint(0, 128, (len(d),), generator=g) for d in docs]
    ids = torch.cat([torch.full((len(d),), i) for i, d in enumerate(docs)])[None]

    def loss(tokens, target, **kw):
        return F.cross_entropy(model(tokens[None], **kw)[0], target, reduction="sum")

    loss(torch.cat(docs), torch.cat(targets), document_ids=ids).backward()
    packed = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    for d, t in zip(docs, targets, strict=True):
        loss(d, t).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(packed[name], p.grad, atol=1e-5, rtol=1e-4, msg=name)


def test_positions_restart_in_every_document():
    ids = torch.tensor([[0, 0, 0, 1, 1, 2], [5, 5, 5, 5, 5, 5]])
    assert positions_from_document_ids(ids).tolist() == [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5]]


def test_explicit_positions_shape_is_checked():
    cls, config = titan_models.get_model("llama3", "debug", num_layers=1)
    model = cls(config)
    with pytest.raises(ValueError, match="positions must have shape"):
        model(torch.zeros(2, 4, dtype=torch.long), positions=torch.zeros(4, dtype=torch.long))
