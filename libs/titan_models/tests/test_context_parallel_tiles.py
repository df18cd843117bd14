"""The context-parallel tile kernels (``sdpa``, ``flex``, ``torch``) give the single-process
result and each other's: CP 2 on gloo, ring and all-gather, whole-chunk and half-chunk tiles
(many merges), for plain causal, packed documents, a sliding window, both, and sinks; the
output and every gradient within 1e-5 of ``sdpa`` on the whole sequence and of the ``torch``
kernel (fp32; the largest difference measured is 3.4e-6). One ``run_distributed`` spawn per
kernel (``flex``'s is slow: un-compiled FlexAttention on CPU).

The tile counts are those of the plan the backend executes: at 128K CP 8 (Llama 3 8B, 32
heads) the fused kernels run 17 tiles per layer per rank, the ``torch`` kernel 8,487.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

import titan_models
from titan_models.components import attend, flex
from titan_models.components.attention_metadata import AttentionMetadata
from titan_models.components.context_parallel import shard_metadata, tile_count
from titan_models.components.context_parallel_tiles import KERNELS, resolve_kernel, tile_size
from titan_testing import run_distributed

TOLERANCE = 1e-5
SEQ = 48  # 4 chunks of 12 at CP 2
NAMES = ("out", "dq", "dk", "dv", "dsinks")
# (name, packed documents, window, sinks)
CASES = (
    ("causal", False, None, False),
    ("documents", True, None, False),
    ("window", False, 5, False),
    ("documents+window", True, 9, False),
    ("sinks", True, None, True),
)


def _document_ids(batch: int, seq: int) -> torch.Tensor:
    """Rows of packed documents whose boundaries fall inside and on chunk edges."""
    lengths = ([7, 13, 1, 20, 7], [24, 17, 7])
    return torch.stack(
        [
            torch.repeat_interleave(torch.arange(len(lengths[b % 2])), torch.tensor(lengths[b % 2]))
            for b in range(batch)
        ]
    )


def _results(cp: titan_models.ContextParallel | None, case, inputs) -> list[torch.Tensor]:
    """Output and gradients (q, k, v, sinks) of one case: the whole sequence with ``sdpa``
    when ``cp`` is None, else this rank's shard (gradients sharded the same way)."""
    _, documents, window, sinks = case
    q, k, v, w, sink_logits, ids = inputs
    B = q.shape[0]
    if cp is None:
        meta = (
            AttentionMetadata.from_document_ids(ids)
            if documents
            else AttentionMetadata.causal(B, SEQ, "cpu")
        )
        leaves = [t.clone().requires_grad_() for t in (q, k, v, sink_logits)]
        out = attend(*leaves[:3], meta, window=window, sinks=leaves[3] if sinks else None)
        (out * w).sum().backward()
        return [out, *(t.grad for t in leaves[:3])] + ([leaves[3].grad] if sinks else [])
    leaves = [cp.shard(t).requires_grad_() for t in (q, k, v)]
    leaves.append(sink_logits.clone().requires_grad_())
    meta = shard_metadata(
        cp,
        B,
        SEQ // cp.size,
        "cpu",
        positions=None,
        document_ids=cp.shard(ids) if documents else None,
    )
    out = attend(*leaves[:3], meta, window=window, sinks=leaves[3] if sinks else None)
    (out * cp.shard(w)).sum().backward()
    results = [out, *(t.grad for t in leaves[:3])]
    if sinks:
        dist.all_reduce(leaves[3].grad, group=cp.group)
        results.append(leaves[3].grad)
    return results


def _kernel_checks(kernels: tuple[str, ...]) -> dict[str, float]:
    """Largest difference of each (kernel, algorithm, tile, case, tensor) from one process
    (``/ref``) and from the ``torch`` kernel on the same tiles (``/torch``)."""
    flex._EAGER_FLEX = True  # CPU: un-compiled FlexAttention (compiling it there is forward-only)
    B, H, K, E = 2, 4, 2, 8
    g = torch.Generator().manual_seed(0)
    q, k, v, w = (torch.randn(B, SEQ, n, E, generator=g) for n in (H, K, K, H))
    inputs = (q, k, v, w, torch.randn(H, generator=g), _document_ids(B, SEQ))
    diffs = {}
    for case in CASES:
        ref = _results(None, case, inputs)
        for algorithm in ("ring", "allgather"):
            for tile in (0, 6):  # picked (whole chunks), and half chunks: merges
                mine = {}
                for kernel in ("torch", *kernels):
                    cp = titan_models.ContextParallel(
                        algorithm=algorithm, tile_kernel=kernel, tile_size=tile
                    )
                    mine[kernel] = _results(cp, case, inputs)
                for kernel, results in mine.items():
                    for i, (a, b, t) in enumerate(zip(results, ref, mine["torch"], strict=True)):
                        label = f"{kernel}/{algorithm}/tile{tile}/{case[0]}/{NAMES[i]}"
                        b = b if i == 4 else cp.shard(b)
                        diffs[f"{label}/ref"] = (a - b).abs().max().item()
                        diffs[f"{label}/torch"] = (a - t).abs().max().item()
    return diffs


def _assert_all_close(results: list[dict[str, float]], kernels: tuple[str, ...]) -> None:
    worst = {key: max(r[key] for r in results) for key in results[0]}
    bad = {key: d for key, d in worst.items() if not d <= TOLERANCE}
    assert not bad, f"tile kernels differ by more than {TOLERANCE}: {bad}"
    # kernels (torch too) x 2 algorithms x 2 tile sizes x (4 cases x 4 tensors + sinks' 5) x 2
    assert len(worst) == (1 + len(kernels)) * 2 * 2 * (4 * 4 + 5) * 2


def test_cp2_sdpa_tiles_equal_torch_tiles_and_one_process():
    """The default kernel: ~1.5 s of work per rank; the rest is the spawn."""
    _assert_all_close(run_distributed(_kernel_checks, 2, ("sdpa",), timeout=600), ("sdpa",))


@pytest.mark.slow
@pytest.mark.extended  # the sdpa tiles (the default) run in the fast suite
def test_cp2_flex_tiles_equal_torch_tiles_and_one_process():
    """FlexAttention un-compiled on CPU (its compile there has no backward): ~40 s."""
    _assert_all_close(run_distributed(_kernel_checks, 2, ("flex",), timeout=600), ("flex",))


# --- single process ---------------------------------------------------------------------------


def test_fused_tiles_at_128k_cp8_are_at_most_256_per_layer():
    """Llama 3 8B (32 heads) at 128K CP 8, batch 1: every rank's plan for one layer."""
    local = 131072 // 8
    for kernel in KERNELS:
        for window in (None, 128, 4096):
            for documents in (False, True):
                tile = tile_size(kernel, local, 1, 32, window, 1 << 22)
                counts = [tile_count(r, 8, local, window, documents, tile) for r in range(8)]
                if kernel != "torch":
                    assert max(counts) <= 256, (kernel, window, documents, counts)
    torch_tile = tile_size("torch", local, 1, 32, None, 1 << 22)
    assert torch_tile == 362 and tile_count(0, 8, local, None, False, torch_tile) == 8487
    whole = tile_size("sdpa", local, 1, 32, None, 1 << 22)
    assert whole == 8192 and tile_count(0, 8, local, None, False, whole) == 17


def test_kernel_resolution_and_bad_input():
    assert resolve_kernel("sdpa", "cpu", None) == "sdpa"
    assert resolve_kernel("sdpa", "cuda", 30.0) == "torch"  # no soft cap in the sdpa ops
    assert resolve_kernel("flex", "meta", None) == "sdpa"  # fake mode: FlexAttention refuses meta
    with pytest.raises(
        ValueError, match=r"tile_kernel='cudnn' must be one of \['torch', 'flex', 'sdpa'\]"
    ):
        titan_models.ContextParallel(tile_kernel="cudnn")  # pyrefly: ignore[bad-argument-type]
    with pytest.raises(ValueError, match=r"tile_size=-1 must be an int >= 0"):
        titan_models.ContextParallel(tile_size=-1)


# --- one tile, kernel against kernel (CPU here; CUDA through tools/gpu_check.sh) ----------------

_DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _one_tile(kernel: str, device: str, dtype: torch.dtype, tile, window: int | None):
    """Forward and backward of one tile with ``kernel``: (out, lse, dq, dk, dv) in fp32."""
    from titan_models.components import context_parallel_tiles as cpt

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    gen = torch.Generator().manual_seed(0)
    B, H, K, E, Tq, L = 1, 4, 2, 32, tile.q1 - tile.q0, tile.k1 - tile.k0
    q = torch.randn(B, H, Tq, E, generator=gen).to(device, dtype)
    k = torch.randn(B, K, L, E, generator=gen).to(device, dtype)
    v = torch.randn(B, K, L, E, generator=gen).to(device, dtype)
    do = torch.randn(B, H, Tq, E, generator=gen).to(device, dtype)
    opt = cpt.TileOptions(
        kernel=kernel, groups=H // K, scale=E**-0.5, softcap=None, window=window, starts=None,
        acc=torch.float32,
    )  # fmt: skip
    if kernel == "flex":
        masks = cpt.flex_block_masks([[tile]], window, None, device)
        opt = dataclasses.replace(opt, block_masks=masks)
    out, lse = cpt.forward(q, k, v, tile, opt)
    out = out.to(dtype)
    delta = (do.float() * out.float()).sum(-1) if kernel == "torch" else None
    dq, dk, dv = cpt.backward(q, k, v, out, lse.float(), do, delta, tile, opt)
    return [t.float() for t in (out, lse, dq, dk, dv)]


@pytest.mark.parametrize("device", _DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("shape", "window"),
    [("off_diagonal", None), ("causal_diagonal", None), ("window", 12)],
)
def test_one_tile_fused_kernels_equal_the_torch_ops(device, dtype, shape, window, monkeypatch):
    from titan_models.components.context_parallel_tiles import Tile

    if device == "cpu":  # compiled FlexAttention on the CPU is forward-only
        monkeypatch.setattr(flex, "_EAGER_FLEX", True)

    if device == "cpu" and dtype == torch.bfloat16:
        pytest.skip("bf16 on this CPU: ~150x slower matmuls; the CPU checks run fp32")
    tiles = {
        "off_diagonal": Tile(0, 16, 32, 0, 24, 0, masked=False, causal=False),
        "causal_diagonal": Tile(0, 16, 16, 0, 16, 16, masked=True, causal=True),
        "window": Tile(0, 16, 16, 0, 16, 8, masked=True, causal=False),  # every row sees a key
    }
    tile = tiles[shape]
    want = _one_tile("torch", device, dtype, tile, window)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    kernels = ["sdpa", "flex"]  # flex: eager on the CPU, compiled on CUDA
    for kernel in kernels:
        got = _one_tile(kernel, device, dtype, tile, window)
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want, strict=True):
            rows = torch.isfinite(b) if name == "lse" else slice(None)
            torch.testing.assert_close(a[rows], b[rows], rtol=tol, atol=tol, msg=f"{kernel} {name}")
