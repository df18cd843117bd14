"""Shared-memory weight slots: pieces from several ranks, versions, in-place loads."""

from __future__ import annotations

import pytest
import torch

from titan_rl import TorchGenerator
from titan_rl.weight_sync import SharedWeights, load_weights


class _Rows:
    """A sharded value as flexshard's ``sharded_state_dict`` gives it: rows of a tensor."""

    def __init__(self, full: torch.Tensor, rank: int, world: int) -> None:
        self.global_shape, self.dtype = tuple(full.shape), full.dtype
        rows = -(-full.shape[0] // world)
        self._chunk = (rank * rows, full[rank * rows : (rank + 1) * rows])

    def local_chunks(self):
        start, chunk = self._chunk
        return [((start,) + (0,) * (chunk.dim() - 1), chunk)] if len(chunk) else []


def test_pieces_of_every_rank_load_bitwise_at_their_version(tiny_model, tmp_path):
    """Guards the slot protocol: 3 "ranks" write row shards and dealt whole tensors; a
    generator loads them in place and holds the full weights bitwise; the other slot keeps
    the previous version; a stale or unstamped version is refused."""
    full = {k: v.detach().clone() for k, v in tiny_model.state_dict().items()}
    layout = {k: (tuple(v.shape), v.dtype) for k, v in full.items()}
    shared = SharedWeights.create(layout, str(tmp_path))
    try:
        world = 3
        for version in (1, 2):
            step = {k: v + version for k, v in full.items()}
            for rank in range(world):  # 2-D tensors sharded by rows, the rest whole
                state = {k: _Rows(v, rank, world) if v.dim() == 2 else v for k, v in step.items()}
                shared.write(version, state, rank, world)
            with pytest.raises(RuntimeError, match=f"holds version -1, not {version}"):
                load_weights(TorchGenerator(tiny_model), shared.ref(version), version)
            shared.stamp(version)
        gen = TorchGenerator(tiny_model)
        ptrs = {k: v.data_ptr() for k, v in gen.model.state_dict().items()}
        load_weights(gen, shared.ref(1), 1)
        assert gen.weight_version == 1
        for k, v in gen.model.state_dict().items():
            assert torch.equal(v, full[k] + 1), k
            assert v.data_ptr() == ptrs[k]  # in place: compiled graphs and caches stay valid
        load_weights(gen, shared.ref(2), 2)
        assert all(torch.equal(v, full[k] + 2) for k, v in gen.model.state_dict().items())
        with pytest.raises(RuntimeError, match="slot 1 holds version 1, not 3"):
            load_weights(gen, shared.ref(3), 3)
        with pytest.raises(ValueError, match="missing"):
            shared.write(4, {}, 0, 1)
    finally:
        shared.unlink()
