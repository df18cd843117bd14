"""The streaming load path (``_stream``): straight into targets, staging reused and bounded,
copies overlapping the next read, checksums before use, load statistics."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest
import torch

from torch_checkpointing import (
    CheckpointManager,
    CorruptCheckpointError,
    FileSystemStorage,
    LoadStats,
)
from torch_checkpointing import _stream as st

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _checkpointing_cases import Chunked, flip_byte

from titan_testing import requires_gpus


def _state(n: int = 6, rows: int = 64, cols: int = 96) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"w{i}": torch.randn(rows, cols, generator=g) for i in range(n)}


def _data_file(root: Path, item: str = "m") -> Path:
    (folder,) = [p for p in root.iterdir() if p.name.startswith("step-")]
    return folder / f"{item}-00000.safetensors"


def test_contiguous_targets_are_read_in_place_with_stats(tmp_path):
    full = _state()
    mgr = CheckpointManager(tmp_path, async_mode="off", block_size=4096)
    mgr.save(1, {"m": full})
    out = {k: torch.zeros_like(v) for k, v in full.items()}
    ptrs = {k: v.data_ptr() for k, v in out.items()}
    stats = LoadStats()
    mgr.load({"m": out}, stats=stats)
    assert all(torch.equal(out[k], full[k]) and out[k].data_ptr() == ptrs[k] for k in full)
    nbytes = sum(v.numel() * 4 for v in full.values())
    assert stats.bytes_direct == nbytes and stats.bytes_copied == 0
    assert stats.files == 1 and stats.attempts == 1 and stats.bytes_read >= nbytes
    assert stats.staging_peak_bytes <= st.SCRATCH + 4096  # headers and padding only
    assert stats.total_s > 0 and stats.read_s > 0 and stats.checksum_s > 0
    assert "straight into targets" in stats.breakdown()
    with pytest.raises(TypeError, match="stats must be a LoadStats or None, got dict"):
        mgr.load({"m": out}, stats={})
    mgr.close()


def test_staged_copies_reuse_bounded_buffers(tmp_path, monkeypatch):
    # Small chunks: many chunks and tensors go through the same two staging buffers.
    monkeypatch.setattr(st, "CHUNK", 64 << 10)
    monkeypatch.setattr(st, "PIECE", 16 << 10)
    monkeypatch.setattr(st, "UNIT", 1 << 30)
    monkeypatch.setattr(st, "SCRATCH", 16 << 10)
    full = _state(n=16, rows=256, cols=96)
    mgr = CheckpointManager(tmp_path, async_mode="off", block_size=4096, io_threads=1)
    mgr.save(1, {"m": full})
    out = {k: torch.zeros(v.shape[1], v.shape[0]).t() for k, v in full.items()}  # strided
    stats = LoadStats()
    mgr.load({"m": out}, stats=stats)
    assert all(torch.equal(out[k], full[k]) for k in full)
    nbytes = sum(v.numel() * 4 for v in full.values())
    assert stats.bytes_copied == nbytes and stats.bytes_direct == 0
    bound = 2 * (64 << 10) + 2 * (16 << 10) + 4 * 4096 + 2 * 65536 + st.SCRATCH
    assert stats.staging_peak_bytes <= bound < nbytes // 2
    mgr.close()


def test_copy_of_one_chunk_overlaps_the_next_read(tmp_path, monkeypatch):
    """The CPU (and CUDA) logic: the copy of chunk k is still running when chunk k+1 is read."""
    monkeypatch.setattr(st, "CHUNK", 64 << 10)
    monkeypatch.setattr(st, "PIECE", 16 << 10)
    monkeypatch.setattr(st, "UNIT", 1 << 30)
    full = _state(n=4, rows=128, cols=96)
    CheckpointManager(tmp_path, async_mode="off", block_size=4096).save(1, {"m": full})

    read_while_copying = threading.Event()
    copying = threading.Event()
    events: list[str] = []

    class Recording(FileSystemStorage):
        def read_into(self, path, offset, buffer):
            if copying.is_set():
                read_while_copying.set()
            events.append(f"read {offset}")
            super().read_into(path, offset, buffer)

    real = st.Streamer._copy_cpu

    def slow_copy(self, pairs):
        copying.set()
        events.append("copy")
        if len(events) < 40:
            read_while_copying.wait(timeout=10)  # the reader goes on meanwhile
        copying.clear()
        real(self, pairs)

    monkeypatch.setattr(st.Streamer, "_copy_cpu", slow_copy)
    mgr = CheckpointManager(None, storage=Recording(tmp_path), read_only=True, io_threads=1)
    out = {k: torch.zeros(v.shape[1], v.shape[0]).t() for k, v in full.items()}
    mgr.load({"m": out})
    assert read_while_copying.is_set(), events
    assert all(torch.equal(out[k], full[k]) for k in full)


def test_damage_in_place_is_an_error_saying_so_and_fallback_overwrites(tmp_path):
    old, new = _state(), {k: v + 1 for k, v in _state().items()}
    mgr = CheckpointManager(tmp_path, async_mode="off", block_size=4096)
    mgr.save(1, {"m": old})
    mgr.save(2, {"m": new})
    folders = sorted(p for p in tmp_path.iterdir() if p.name.startswith("step-"))
    data = folders[-1] / "m-00000.safetensors"
    flip_byte(data, data.stat().st_size - 10)  # in the last tensor
    out = {k: torch.zeros_like(v) for k, v in old.items()}
    with pytest.raises(CorruptCheckpointError, match="partly overwritten by this load"):
        mgr.load({"m": out})
    assert torch.equal(out["w0"], new["w0"])  # read in place before the damage was found
    with pytest.warns(UserWarning, match="instead of step 2"):
        assert mgr.load({"m": out}, fallback=True) == 1
    assert all(torch.equal(out[k], old[k]) for k in old)
    mgr.close()


def test_overlapping_targets_and_column_slices(tmp_path):
    full = torch.randn(64, 200)
    mgr = CheckpointManager(tmp_path, async_mode="off", block_size=4096)
    mgr.save(1, {"p": {"w": full}})
    both = Chunked(
        full.shape,
        full.dtype,
        [
            ((0, 0), torch.zeros(40, 200)),
            ((20, 0), torch.zeros(44, 200)),
            ((3, 7), torch.zeros(5, 9)),
        ],
    )
    mgr.load({"p": {"w": both}})
    (_, a), (_, b), (_, c) = both.local_chunks()
    assert (
        torch.equal(a, full[:40]) and torch.equal(b, full[20:]) and torch.equal(c, full[3:8, 7:16])
    )
    cols = Chunked(full.shape, full.dtype, [((0, 190), torch.zeros(64, 10))])
    stats = LoadStats()
    mgr.load({"p": {"w": cols}}, stats=stats)
    assert torch.equal(cols.local_chunks()[0][1], full[:, 190:])
    mgr.close()


def test_split_copy_covers_every_element_once():
    t = torch.zeros(6, 5, 7)
    strides = (5 * 9, 9, 1)  # a (6, 5, 9) source, 7 of its 9 columns
    for limit in (4, 64, 1 << 20):
        for sparse in (True, False):
            pieces = st.split_copy(100, t, strides, 4, limit, sparse=sparse)
            seen = torch.zeros_like(t)
            for p in pieces:
                p.view.add_(1)  # views of t: each element counted once
                assert p.end - p.start <= max(limit, 7 * 4)
            seen.copy_(t)
            t.zero_()
            assert torch.equal(seen, torch.ones_like(t)), (limit, sparse)


@requires_gpus(1)
def test_cuda_targets_stage_through_reused_pinned_buffers(tmp_path):
    full = _state(n=8, rows=512, cols=512)
    mgr = CheckpointManager(tmp_path, async_mode="off")
    mgr.save(1, {"m": full})
    out = {k: torch.empty(v.shape, device="cuda") for k, v in full.items()}
    stats = LoadStats()
    mgr.load({"m": out}, stats=stats)
    assert all(torch.equal(out[k].cpu(), full[k]) for k in full)
    nbytes = sum(v.numel() * 4 for v in full.values())
    assert stats.bytes_copied == nbytes and stats.staging_peak_bytes < nbytes
    mgr.close()


def test_shard_box_matches_torch_for_even_and_uneven_splits():
    import itertools

    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    from torch_checkpointing._exchange import shard_box

    cases = [
        ((10,), (4,), [Shard(0)]),
        ((3,), (4,), [Shard(0)]),
        ((9, 7), (2, 3), [Shard(0), Shard(0)]),
        ((9, 7), (2, 3), [Shard(1), Shard(0)]),
        ((5, 11), (3, 2), [Replicate(), Shard(1)]),
        ((8, 6, 5), (2, 2), [Shard(2), Shard(2)]),
    ]
    for shape, mesh, placements in cases:
        for coord in itertools.product(*(range(n) for n in mesh)):
            want = _compute_local_shape_and_global_offset(shape, mesh, list(coord), placements)
            got = shard_box(shape, mesh, coord, placements)
            assert got == (tuple(want[0]), tuple(want[1])), (shape, mesh, placements, coord)
