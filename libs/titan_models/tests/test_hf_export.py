"""``hf_export``: the HF key mapping of a model whose tensors are split over ranks.

Each "rank" below passes only its pieces (rows of every tensor, as a flexshard ``Shard(0)`` or
an expert-parallel split leaves them; three ranks, so the rows split unevenly); put together and brought to HF's layout with the
export's transforms, the pieces of every HF tensor equal what ``to_hf`` writes from the whole
model, bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

import titan_models
from titan_models.hf_io import named_state


class Rows:
    """This rank's rows of a tensor, as the sharded-tensor protocol."""

    def __init__(self, tensor: torch.Tensor, rank: int, world: int) -> None:
        self.global_shape, self.dtype = tuple(tensor.shape), tensor.dtype
        n = tensor.shape[0] if tensor.dim() else 1
        lo, hi = rank * n // world, (rank + 1) * n // world
        whole = tensor.dim() == 0
        self._chunks = [((), tensor)] if whole and rank == 0 else []
        if not whole:
            self._chunks = [((lo, *(0,) * (tensor.dim() - 1)), tensor[lo:hi])]

    def local_chunks(self) -> list[tuple[tuple[int, ...], torch.Tensor]]:
        return self._chunks


@pytest.mark.parametrize("family", ["llama3", "deepseek_v3"])
def test_pieces_of_every_rank_make_the_tensors_to_hf_writes(tmp_path, family):
    cls, config = titan_models.get_model(family, "debug", num_layers=2)
    torch.manual_seed(0)
    model = cls(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()  # no two rows alike, so a misplaced piece shows
    want = load_file(str(titan_models.to_hf(model, tmp_path / "whole") / "model.safetensors"))
    world = 3
    state = dict(named_state(model))
    exports = [
        titan_models.hf_export({k: Rows(v, r, world) for k, v in state.items()}, config)
        for r in range(world)
    ]
    assert exports[0].config == exports[1].config and exports[0].config["torch_dtype"]
    assert set(exports[0].tensors) == set(want)
    assert exports[0].transforms.keys() == exports[1].transforms.keys()
    if family == "deepseek_v3":  # experts stacked in ours, one key each in HF's; and
        assert exports[0].transforms  # rope rows interleaved in ours, rotate-half in HF's
    for key, expected in want.items():
        pieces = exports[0].tensors[key]
        full = torch.full(pieces.global_shape, float("nan"), dtype=pieces.dtype)
        for export in exports:
            for offset, chunk in export.tensors[key].local_chunks():
                full[tuple(slice(o, o + s) for o, s in zip(offset, chunk.shape, strict=True))] = (
                    chunk
                )
        transform = exports[0].transforms.get(key)
        got = transform(full) if transform is not None else full
        assert torch.equal(got, expected), key


def test_a_key_held_elsewhere_is_left_out_and_wrong_input_is_named():
    cls, config = titan_models.get_model("llama3", "debug", num_layers=2)
    model = cls(config)
    state = dict(named_state(model))
    stage = {k: v for k, v in state.items() if k.startswith("layers.1.")}  # a pipeline stage
    export = titan_models.hf_export(stage, config, dtype=torch.bfloat16)
    assert export.tensors and all(k.startswith("model.layers.1.") for k in export.tensors)
    assert all(p.dtype == torch.bfloat16 for p in export.tensors.values())
    assert export.config["torch_dtype"] == "bfloat16"
    with pytest.raises(ValueError, match=r"'norm.weight' has global shape \(3,\)"):
        titan_models.hf_export({"norm.weight": torch.ones(3)}, config)
    with pytest.raises(ValueError, match="keys are not in Llama3: nope"):
        titan_models.hf_export({"nope": torch.ones(3)}, config)
    with pytest.raises(ValueError, match="dtype must be a floating torch.dtype"):
        titan_models.hf_export(state, config, dtype=torch.int8)
