"""Initial values do not depend on the layout: any set of pieces filled by ``init_state``
equals, bit for bit, the whole model initialised by ``init_weights`` on one process."""

from __future__ import annotations

import itertools

import pytest
import torch

import titan_models
from titan_models.components.init import _BLOCK_ELEMENTS


class Pieces:
    """The sharded-tensor protocol over pieces of a tensor (as flexshard's ShardedParam)."""

    def __init__(self, full: torch.Tensor, pieces: list[tuple[tuple[int, ...], torch.Tensor]]):
        self.global_shape = tuple(full.shape)
        self._pieces = pieces

    def local_chunks(self):
        return self._pieces


def _cut(full: torch.Tensor, parts: int, dim: int) -> list[tuple[tuple[int, ...], torch.Tensor]]:
    """Empty tensors shaped like ``parts`` slices of ``full`` along ``dim`` (uneven sizes)."""
    if full.dim() == 0:
        return [((), torch.empty_like(full))]
    size = full.shape[dim]
    bounds = sorted({0, size, *(size * k // parts + k % 2 for k in range(1, parts))})
    out = []
    for lo, hi in itertools.pairwise(bounds):
        lo, hi = min(lo, size), min(hi, size)
        shape = list(full.shape)
        shape[dim] = hi - lo
        offset = [0] * full.dim()
        offset[dim] = lo
        out.append((tuple(offset), torch.empty(shape, dtype=full.dtype)))
    return out


@pytest.mark.parametrize(
    ("family", "overrides"),
    [
        ("llama3", {}),
        ("qwen3_moe", {}),
        ("deepseek_v3", {}),
        # a row of > _BLOCK_ELEMENTS / 3 elements: blocks of one or two rows
        ("llama3", {"dim": 64, "vocab_size": _BLOCK_ELEMENTS // 40}),
    ],
)
def test_pieces_filled_by_init_state_equal_the_whole_model(family, overrides):
    cls, config = titan_models.get_model(family, "debug", **overrides)
    whole = dict(cls(config).init_weights(seed=3).state_dict())
    with torch.device("meta"):
        model = cls(config)
    state = {}
    for k, (key, full) in enumerate(whole.items()):
        dim = k % max(1, full.dim())  # rows for some, columns (a TP-like cut) for others
        state[key] = Pieces(full, _cut(full, 3 + k % 2, dim))
    titan_models.init_state(state, model.param_inits(), seed=3)
    for key, full in whole.items():
        for offset, piece in state[key].local_chunks():
            index = tuple(slice(o, o + n) for o, n in zip(offset, piece.shape, strict=True))
            assert torch.equal(piece, full[index]), key


def test_seed_and_name_decide_the_values():
    cls, config = titan_models.get_model("llama3", "debug")
    a = cls(config).init_weights(seed=0)
    b = cls(config).init_weights(seed=0)
    c = cls(config).init_weights(seed=1)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))
    wq = "layers.0.attention.wq.weight"
    assert not torch.equal(a.state_dict()[wq], c.state_dict()[wq])
    # same shape, same std, another name: other values
    assert not torch.equal(a.state_dict()[wq], a.state_dict()["layers.1.attention.wq.weight"])


def test_a_parameter_without_initialiser_is_an_error():
    cls, config = titan_models.get_model("llama3", "debug")
    model = cls(config).init_weights()
    inits = model.param_inits()
    del inits["norm.weight"]
    with pytest.raises(ValueError, match="'norm.weight' has no initialiser"):
        titan_models.init_state(model.state_dict(keep_vars=True), inits, seed=0)
