"""ExpertPlacement: contiguous ownership and weight slicing."""

import pytest
import torch

from dist_moe import ExpertPlacement


def test_contiguous_ownership_and_shard():
    p = ExpertPlacement(num_experts=8, ep_size=4, ep_rank=2)
    assert p.num_local_experts == 2
    assert list(p.local_experts) == [4, 5]
    assert [p.owner(e) for e in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    w = torch.arange(8 * 3 * 2.0).reshape(8, 3, 2)
    assert torch.equal(p.shard(w), w[4:6])
    shards = [ExpertPlacement(num_experts=8, ep_size=4, ep_rank=r).shard(w) for r in range(4)]
    assert torch.equal(torch.cat(shards), w)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(num_experts=6, ep_size=4, ep_rank=0), "divisible"),
        (dict(num_experts=8, ep_size=0, ep_rank=0), "ep_size"),
        (dict(num_experts=8, ep_size=2, ep_rank=2), "ep_rank"),
    ],
)
def test_bad_placement_names_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ExpertPlacement(**kwargs)


def test_shard_rejects_a_weight_that_is_not_full():
    p = ExpertPlacement(num_experts=8, ep_size=2, ep_rank=0)
    with pytest.raises(ValueError, match="full_weight"):
        p.shard(torch.zeros(4, 3))
    with pytest.raises(ValueError, match="expert"):
        p.owner(8)
