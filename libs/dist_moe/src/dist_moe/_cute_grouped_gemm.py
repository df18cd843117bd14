"""Grouped GEMM over packed experts in CuTe DSL (``nvidia-cutlass-dsl``): the kernel itself.

Imports only ``cutlass`` (not torch), so its code generation can be checked in an
environment that has the DSL and nothing else; ``cute_gemm.py`` is the torch-facing wrapper.

Problem: for each group (expert) ``g``::

    out[g, m, :] = x[g, m, :] @ w[g].T      for m < counts[g]

``x`` (G, M, K) holds each expert's rows at a static capacity ``M`` (the symmetric-memory
dispatcher's ``to_owner`` layout), ``w`` (G, N, K) is the ``nn.Linear`` layout, ``out`` is
(G, M, N); all K-major bf16 with fp32 accumulation. ``counts`` (G,) int32 are read on the
device: a CTA whose row tile starts at or past ``counts[g]`` returns at once, so the grid
is static (no host sync) and empty capacity costs one launch slot per tile, not a GEMM.
Rows of a live tile past ``counts[g]`` are computed like the others (they hold zeros in the
dispatcher's buffers).

Kernel: one CTA per (row tile, column tile, group); 128 x 128 x 64 tiles; 4 warps in a 2 x 2
arrangement of ``mma.sync.m16n8k16`` (bf16 in, fp32 accumulate), a warp-level MMA that SM80,
SM90 and SM100 all execute; K-tiles stream through a two-stage shared-memory ring filled by
``cp.async`` (16-byte copies into a 128-byte-swizzled layout, so the ``ldmatrix`` reads
into registers are free of bank conflicts). Not written here: Hopper's WGMMA/TMA and
Blackwell's tcgen05/TMEM pipelines, which a peak-throughput kernel for those parts needs.
Shapes must be multiples of the tile: M % 128, N % 128, K % 64 == 0.
"""

from __future__ import annotations

import functools
import os
import tempfile

import cutlass
import cutlass.cute as cute
import cutlass.utils
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

TILE_M, TILE_N, TILE_K = 128, 128, 64
STAGES = 2
NUM_THREADS = 128
SUPPORTED_ARCHS = ("sm_90a", "sm_100a")


def _smem_layout(rows: int):
    # (rows, 64) bf16, K-major: 8 x 64 atoms (128-byte rows) with a 3-bit XOR swizzle.
    atom = cute.make_composed_layout(
        cute.make_swizzle(3, 3, 3), 0, cute.make_layout((8, TILE_K), stride=(TILE_K, 1))
    )
    return cute.tile_to_shape(atom, (rows, TILE_K, STAGES), (0, 1, 2))


def _g2s_copy(dtype):
    # 16-byte cp.async per thread; 8 threads cover a 64-wide row, 16 rows per pass.
    atom = cute.make_copy_atom(
        cute.nvgpu.cpasync.CopyG2SOp(cache_mode=cute.nvgpu.cpasync.LoadCacheMode.GLOBAL),
        dtype,
        num_bits_per_copy=128,
    )
    per_row = TILE_K // 8
    threads = cute.make_layout((NUM_THREADS // per_row, per_row), stride=(per_row, 1))
    return cute.make_tiled_copy_tv(atom, threads, cute.make_layout((1, 8)))


@cute.kernel
def _grouped_gemm_kernel(
    mX: cute.Tensor,
    mW: cute.Tensor,
    mOut: cute.Tensor,
    mCounts: cute.Tensor,
    sX_layout: cute.ComposedLayout,
    sW_layout: cute.ComposedLayout,
    copy_x: cute.TiledCopy,
    copy_w: cute.TiledCopy,
    tiled_mma: cute.TiledMma,
):
    tidx, _, _ = cute.arch.thread_idx()
    m_tile, n_tile, g = cute.arch.block_idx()
    if m_tile * TILE_M < mCounts[g]:
        gX = cute.local_tile(mX[g, None, None], (TILE_M, TILE_K), (m_tile, None))
        gW = cute.local_tile(mW[g, None, None], (TILE_N, TILE_K), (n_tile, None))
        gOut = cute.local_tile(mOut[g, None, None], (TILE_M, TILE_N), (m_tile, n_tile))

        smem = cutlass.utils.SmemAllocator()
        sX = smem.allocate_tensor(mX.element_type, sX_layout, 16)
        sW = smem.allocate_tensor(mW.element_type, sW_layout, 16)

        thr_x, thr_w = copy_x.get_slice(tidx), copy_w.get_slice(tidx)
        tXgX, tXsX = thr_x.partition_S(gX), thr_x.partition_D(sX)
        tWgW, tWsW = thr_w.partition_S(gW), thr_w.partition_D(sW)

        thr_mma = tiled_mma.get_slice(tidx)
        tCsX = thr_mma.partition_A(sX)
        tCsW = thr_mma.partition_B(sW)
        tCgOut = thr_mma.partition_C(gOut)
        tCrX = tiled_mma.make_fragment_A(tCsX[None, None, None, 0])
        tCrW = tiled_mma.make_fragment_B(tCsW[None, None, None, 0])
        acc = tiled_mma.make_fragment_C(tCgOut)
        acc.fill(0.0)

        ldsm = cute.nvgpu.warp.LdMatrix8x8x16bOp(False, 4)
        s2r_x = cute.make_tiled_copy_A(cute.make_copy_atom(ldsm, mX.element_type), tiled_mma)
        s2r_w = cute.make_tiled_copy_B(cute.make_copy_atom(ldsm, mW.element_type), tiled_mma)
        thr_s2r_x, thr_s2r_w = s2r_x.get_slice(tidx), s2r_w.get_slice(tidx)
        tSsX, tSrX = thr_s2r_x.partition_S(sX), thr_s2r_x.retile(tCrX)
        tSsW, tSrW = thr_s2r_w.partition_S(sW), thr_s2r_w.retile(tCrW)

        num_k_tiles = cute.size(tXgX, mode=[3])
        num_k_blocks = cute.size(tCrX, mode=[2])

        # prologue: tile 0 into stage 0
        cute.copy(copy_x, tXgX[None, None, None, 0], tXsX[None, None, None, 0])
        cute.copy(copy_w, tWgW[None, None, None, 0], tWsW[None, None, None, 0])
        cute.arch.cp_async_commit_group()

        for k_tile in range(num_k_tiles):
            stage = k_tile % STAGES
            # issue the next tile into the other stage while this one is consumed
            if k_tile + 1 < num_k_tiles:
                nxt = (k_tile + 1) % STAGES
                cute.copy(copy_x, tXgX[None, None, None, k_tile + 1], tXsX[None, None, None, nxt])
                cute.copy(copy_w, tWgW[None, None, None, k_tile + 1], tWsW[None, None, None, nxt])
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(1)  # all but the newest group: this stage landed
            cute.arch.sync_threads()
            for k_block in cutlass.range(num_k_blocks, unroll_full=True):
                cute.copy(s2r_x, tSsX[None, None, k_block, stage], tSrX[None, None, k_block])
                cute.copy(s2r_w, tSsW[None, None, k_block, stage], tSrW[None, None, k_block])
                cute.gemm(tiled_mma, acc, tCrX[None, None, k_block], tCrW[None, None, k_block], acc)
            cute.arch.sync_threads()  # everyone is done reading before the stage is refilled

        cute.arch.cp_async_wait_group(0)
        out = cute.make_fragment_like(acc, mOut.element_type)
        out.store(acc.load().to(mOut.element_type))
        cute.autovec_copy(out, tCgOut)


@cute.jit
def grouped_gemm(
    mX: cute.Tensor,
    mW: cute.Tensor,
    mOut: cute.Tensor,
    mCounts: cute.Tensor,
    stream,
):
    """Launch on ``stream`` (a ``CUstream``; unannotated, as the DSL infers it, so this file
    needs only ``cutlass``): grid (M / 128, N / 128, G), 128 threads, two smem stages."""
    sX_layout = _smem_layout(TILE_M)
    sW_layout = _smem_layout(TILE_N)
    smem_bytes = cute.size_in_bytes(mX.element_type, sX_layout) + cute.size_in_bytes(
        mW.element_type, sW_layout
    )
    mma = cute.nvgpu.warp.MmaF16BF16Op(mX.element_type, cutlass.Float32, (16, 8, 16))
    # 2 x 2 warps; N permuted to 32 so each ldmatrix.x4 feeds two MMAs' B fragments
    tiled_mma = cute.make_tiled_mma(mma, cute.make_layout((2, 2, 1)), permutation_mnk=(32, 32, 16))
    grid = (
        cute.size(mX, mode=[1]) // TILE_M,
        cute.size(mW, mode=[1]) // TILE_N,
        cute.size(mX, mode=[0]),
    )
    _grouped_gemm_kernel(
        mX,
        mW,
        mOut,
        mCounts,
        sX_layout,
        sW_layout,
        _g2s_copy(mX.element_type),
        _g2s_copy(mW.element_type),
        tiled_mma,
    ).launch(grid=grid, block=(NUM_THREADS, 1, 1), smem=smem_bytes, stream=stream)


def fake_arguments():
    """Fake (G, M, K), (G, N, K), (G, M, N) bf16, (G,) int32 tensors and a stream."""
    g = cute.sym_int32(symbol="G")
    m = cute.sym_int32(divisibility=TILE_M, symbol="M")
    n = cute.sym_int32(divisibility=TILE_N, symbol="N")
    k = cute.sym_int32(divisibility=TILE_K, symbol="K")

    def fake(shape):
        return make_fake_compact_tensor(
            cutlass.BFloat16, shape, stride_order=(2, 1, 0), assumed_align=16
        )

    counts = make_fake_compact_tensor(cutlass.Int32, (g,), assumed_align=4)
    return fake((g, m, k)), fake((g, n, k)), fake((g, m, n)), counts, make_fake_stream()


@functools.cache
def compile_grouped_gemm(arch: str):
    """``cute.compile`` of ``grouped_gemm`` for ``arch``; works without a GPU (code generation
    only). Returns ``(compiled, ptx)``: the callable and the PTX text it was built from."""
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(
            f"compile_grouped_gemm: arch must be one of {SUPPORTED_ARCHS}, got {arch!r}"
        )
    with tempfile.TemporaryDirectory(prefix="dist_moe_cute_") as tmp:
        compiled = cute.compile(
            grouped_gemm,
            *fake_arguments(),
            options=f"--gpu-arch={arch} --keep-ptx --dump-dir={tmp}",
        )
        ptx = ""
        for name in os.listdir(tmp):
            if name.endswith(".ptx"):
                with open(os.path.join(tmp, name)) as f:
                    ptx = f.read()
    return compiled, ptx
