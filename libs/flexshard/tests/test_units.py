"""Single-process checks: FP8 tile quantisation, placement objects, default buckets."""

from __future__ import annotations

import pytest
import torch

import flexshard as fs
from flexshard.testing import TinyTransformer


def test_fp8_tiles_within_documented_bound():
    g = torch.Generator().manual_seed(0)
    scales = torch.tensor([1e-6, 1e-2, 1.0, 3e2, 1e4])
    x = torch.randn(5, 16, 16, generator=g) * scales[:, None, None]
    x[0, 0, :4] = 0.0
    x[1, 3, 3] = 1e-9  # far below the tile's amax: lands in the subnormal range
    x = torch.cat([x, torch.zeros(1, 16, 16)])  # an all-zero tile
    q, s = fs.quantize_tiles(x)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and s.shape == (6,)
    y = fs.dequantize_tiles(q, s)
    err = (y - x).abs()
    assert bool((err <= fs.fp8_block_error_bound(x)).all())
    # the tile's largest element maps to 448 exactly, and zero tiles stay zero
    assert torch.equal(y[5], torch.zeros(16, 16))
    amax = x.abs().amax(dim=(1, 2))
    assert torch.allclose(y.abs().amax(dim=(1, 2))[:5], amax[:5], rtol=2**-4)
    # relative error of normal values is at most 2^-4
    big = x.abs() > amax[:, None, None] / 16
    assert bool((err[big] <= x.abs()[big] * 2**-4 * (1 + 1e-6)).all())


def test_fp8_pow2_tile_scales_are_powers_of_two_within_the_bound():
    g = torch.Generator().manual_seed(1)
    mags = torch.tensor([1e-30, 1e-3, 1.0, 448.0, 3e5])
    x = torch.randn(5, 32, 32, generator=g) * mags[:, None, None]
    x[3, 0, 0] = 448.0 * 4  # amax / 448 exactly a power of two: no rounding up
    x = torch.cat([x, torch.zeros(1, 32, 32)])
    q, s = fs.quantize_tiles(x, pow2=True)
    mant, _ = torch.frexp(s)
    assert bool((mant == 0.5).all())  # every scale is 2^k
    plain = fs.quantize_tiles(x)[1]
    assert bool((s >= plain).all()) and bool((s[:5] < 2 * plain[:5]).all())
    assert s[3] == 4.0 and s[5] == 1.0
    y = fs.dequantize_tiles(q, s)
    assert bool(((y - x).abs() <= fs.fp8_block_error_bound(x, pow2=True)).all())
    # q * 2^k is exact: dequantising in bf16 loses nothing
    assert torch.equal(fs.dequantize_tiles(q, s, torch.bfloat16).float(), y)
    with pytest.raises(ValueError, match="fp8_block_pow2"):
        fs.Bucket("*", fs.Shard(0), quantize="fp8_block_pow2")
    with pytest.raises(ValueError, match="fp8_block_pow2"):
        fs.Bucket("*", fs.BlockShard((4, 4)), quantize="fp8")


def test_fp8_rejects_non_tiles():
    with pytest.raises(ValueError, match=r"\(n, r, c\)"):
        fs.quantize_tiles(torch.ones(4, 4))


def test_placement_and_bucket_validation():
    assert fs.Shard(1).dim == 1
    assert fs.BlockShard([4, 8]).block == (4, 8)
    for bad in [lambda: fs.Shard("0"), lambda: fs.BlockShard((4,)), lambda: fs.Owned(owner=-1)]:
        with pytest.raises(ValueError):
            bad()
    with pytest.raises(ValueError, match="placement"):
        fs.Bucket("**", placement="Shard(0)")
    with pytest.raises(ValueError, match=r"Bucket.match: .*'layers\.0\*\*'.*whole segment"):
        fs.Bucket("layers.0**")
    with pytest.raises(ValueError, match="floating"):
        fs.MixedPrecision(param_dtype=torch.int8)


def test_default_buckets_one_per_block_plus_root():
    model = TinyTransformer(n_layers=3)
    bks = fs.default_buckets(model)
    assert [b.name for b in bks] == ["layers.0", "layers.1", "layers.2", "<root>"]
    assert all(isinstance(b.placement, fs.Shard) and b.placement.dim == 0 for b in bks)
    covered = [id(p) for b in bks for p in b.match]
    assert sorted(covered) == sorted(id(p) for p in model.parameters())
    root = {id(p) for p in bks[-1].match}
    assert root == {id(model.tok_emb.weight), id(model.norm.weight), id(model.head.weight)}


def test_shard_needs_a_process_group():
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    with pytest.raises(ValueError, match="not initialised"):
        fs.shard(TinyTransformer())
