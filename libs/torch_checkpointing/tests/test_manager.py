"""CheckpointManager in one process: round trips, async semantics, integrity, retention, errors."""

from __future__ import annotations

import errno
import itertools
import math
import os
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from torch_checkpointing import (
    CheckpointError,
    CheckpointManager,
    CheckpointNotFoundError,
    CheckpointPolicy,
    CheckpointWriteError,
    CorruptCheckpointError,
    FileSystemStorage,
    PerRank,
    StateMismatchError,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _checkpointing_cases import Chunked, CountingStorage, RNGHolder

from titan_testing import requires_gpus

MODES = ("off", "thread", "process")


# ----------------------------------------------------------------------------- helpers


class Loader:
    """A custom stateful object mixing tensors and plain values."""

    def __init__(self, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.order = torch.randperm(50, generator=g)
        self.position = seed
        self.epoch_log = [("start", 0.5, None)]
        self.weights = {"a": 1.0, 2: float("inf")}

    def state_dict(self):
        return {
            "order": self.order,
            "position": self.position,
            "epoch_log": list(self.epoch_log),
            "weights": dict(self.weights),
        }

    def load_state_dict(self, sd):
        self.order = sd["order"].clone()
        self.position = sd["position"]
        self.epoch_log = list(sd["epoch_log"])
        self.weights = dict(sd["weights"])


def row_chunks(full: torch.Tensor, bounds: list[int]) -> Chunked:
    chunks = [((a, 0), full[a:b].clone()) for a, b in itertools.pairwise(bounds)]
    return Chunked(full.shape, full.dtype, chunks)


def assemble(ch: Chunked) -> torch.Tensor:
    out = torch.full(ch.global_shape, float("nan"), dtype=ch.dtype)
    for offs, t in ch.local_chunks():
        out[tuple(slice(o, o + s) for o, s in zip(offs, t.shape, strict=True))] = t
    return out


def train_objects(seed: int = 0, steps: int = 3):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.GELU(), torch.nn.Linear(24, 5))
    model.register_buffer("counter", torch.tensor([seed], dtype=torch.int64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for _ in range(steps):
        model(torch.randn(7, 12)).square().mean().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    return model, opt, sched


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a, b)
        )
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    return type(a) is type(b) and a == b


def snapshot(model, opt, sched, loader):
    return {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "optim": _clone(opt.state_dict()),
        "sched": sched.state_dict(),
        "loader": _clone(loader.state_dict()),
    }


def _clone(x):
    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, dict):
        return {k: _clone(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_clone(v) for v in x]
    return x


def data_files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.glob("*.safetensors"))}


def only_dir(root: Path, step: int) -> Path:
    dirs = [p for p in root.iterdir() if p.name.startswith(f"step-{step:012d}.")]
    assert len(dirs) == 1, dirs
    return dirs[0]


class GatedStorage(FileSystemStorage):
    """Writes block until the test opens the gate (thread mode only)."""

    def __init__(self, root):
        super().__init__(root, fsync=False)
        self.gate = threading.Event()
        self.order: list[str] = []

    def write(self, path, chunks):
        self.gate.wait(30)
        if path.endswith(".json") and "manifest" in path:
            self.order.append(path.split("/")[0])
        super().write(path, chunks)


class FailingStorage(FileSystemStorage):
    """Fails data-file writes of one step with an OSError (disk full, read-only...)."""

    def __init__(self, root, fail_step: int, err: int = errno.ENOSPC):
        super().__init__(root, fsync=False)
        self.fail_step = fail_step
        self.err = err

    def write(self, path, chunks):
        if path.startswith(f"step-{self.fail_step:012d}.") and "optim" in path:
            list(chunks)[:1]
            raise OSError(self.err, os.strerror(self.err), path)
        super().write(path, chunks)


class NoRename:
    """A would-be storage that forgot ``rename``."""

    process_safe = True

    def __init__(self, root):
        self._fs = FileSystemStorage(root)
        for op in ("write", "read", "read_into", "size", "list", "exists", "delete"):
            setattr(self, op, getattr(self._fs, op))


# ---------------------------------------------------------------------------- round trip


@pytest.mark.parametrize("mode", MODES)
def test_round_trip_is_exact_and_files_identical_across_modes(tmp_path, mode):
    model, opt, sched = train_objects()
    loader = Loader(3)
    rng = RNGHolder()
    extra = {"step": 7, "nan": float("nan"), "tup": (1, "x", None), "blob": b"\x00\xff"}
    state = {
        "model": model,
        "optim": opt,
        "sched": sched,
        "loader": loader,
        "rng": PerRank(rng),
        "extra": extra,
    }
    ref = snapshot(model, opt, sched, loader)
    expected_draw = None
    with CheckpointManager(tmp_path / mode, async_mode=mode) as mgr:
        torch.manual_seed(1234)
        handle = mgr.save(7, state)
        expected_draw = torch.rand(5)
        handle.wait()
        assert handle.done()
        assert mgr.latest_step() == 7 and mgr.steps() == [7]
    # Load into brand-new objects (fresh optimizer with no state yet).
    model2, opt2, sched2 = train_objects(seed=99, steps=0)
    loader2 = Loader(0)
    extra2 = {"step": 0}
    state2 = {
        "model": model2,
        "optim": opt2,
        "sched": sched2,
        "loader": loader2,
        "rng": PerRank(RNGHolder()),
        "extra": extra2,
    }
    torch.manual_seed(0)
    mgr2 = CheckpointManager(tmp_path / mode, async_mode="off")
    assert mgr2.load(state2) == 7
    assert same(snapshot(model2, opt2, sched2, loader2), ref)
    assert same(extra2, extra)
    assert torch.equal(torch.rand(5), expected_draw)  # RNG restored
    # The same state written by every async mode gives byte-identical data files.
    with CheckpointManager(tmp_path / f"{mode}-again", async_mode="off") as sync:
        torch.manual_seed(1234)
        sync.save(7, state).wait()
    assert data_files(only_dir(tmp_path / mode, 7)) == data_files(
        only_dir(tmp_path / f"{mode}-again", 7)
    )


def test_data_files_are_safetensors_and_nothing_is_pickled(tmp_path):
    model, opt, sched = train_objects()
    with CheckpointManager(tmp_path, async_mode="off") as mgr:
        mgr.save(1, {"model": model, "optim": opt, "sched": sched, "loader": Loader()}).wait()
    folder = only_dir(tmp_path, 1)
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), "pt") as g:  # a real safetensors file
            meta = g.metadata()["torch_checkpointing"]
            assert '"tree"' in meta
            for k in g.keys():  # noqa: SIM118 - safe_open has no __iter__
                g.get_tensor(k)
        assert b"\x80\x04" not in f.read_bytes()[:16]  # no pickle protocol header
    with safe_open(str(folder / "model-00000.safetensors"), "pt") as g:
        assert torch.equal(g.get_tensor("0.weight@0,0"), model[0].weight)
    for f in folder.glob("*.json"):
        f.read_text()  # JSON text, not pickle


def test_mutating_right_after_save_does_not_change_what_is_written(tmp_path):
    storage = GatedStorage(tmp_path)
    model, opt, sched = train_objects()
    ref = snapshot(model, opt, sched, Loader())
    mgr = CheckpointManager(None, storage=storage, async_mode="thread")
    handle = mgr.save(1, {"model": model, "optim": opt})
    assert not handle.done()  # the writer is held at the gate
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-3).add_(1)
        for s in opt.state.values():
            s["exp_avg"].zero_()
    storage.gate.set()
    handle.wait()
    model2, opt2, _ = train_objects(seed=5, steps=1)
    mgr.load({"model": model2, "optim": opt2})
    assert same({k: v for k, v in model2.state_dict().items()}, ref["model"])
    assert same(opt2.state_dict(), ref["optim"])
    mgr.close()


def test_mutation_after_save_in_process_mode(tmp_path):
    t = torch.arange(1 << 18, dtype=torch.float32)
    with CheckpointManager(tmp_path, async_mode="process") as mgr:
        for step in range(3):
            mgr.save(step, {"w": {"t": t}})
            t.add_(1)  # straight after save() returns
        mgr.wait()
        for step in range(3):
            out = {"w": {"t": torch.empty_like(t)}}
            mgr.load(out, step)
            assert torch.equal(out["w"]["t"], torch.arange(1 << 18, dtype=torch.float32) + step)


def test_saves_queue_in_order_with_two_staging_slots(tmp_path):
    storage = GatedStorage(tmp_path)
    mgr = CheckpointManager(None, storage=storage, async_mode="thread", staging_slots=2)
    t = torch.zeros(1000)
    h1 = mgr.save(1, {"x": t})
    t.fill_(2)
    h2 = mgr.save(2, {"x": t})  # staged while step 1 is still in flight
    assert not h1.done() and not h2.done()
    storage.gate.set()
    mgr.wait()
    assert [p.split(".")[0] for p in storage.order] == [
        "step-000000000001",
        "step-000000000002",
    ]
    out = {"x": torch.empty(1000)}
    mgr.load(out, 1)
    assert torch.equal(out["x"], torch.zeros(1000))
    mgr.load(out, 2)
    assert torch.equal(out["x"], torch.full((1000,), 2.0))
    mgr.close()


# ---------------------------------------------------------------------------- retention


@pytest.mark.parametrize("mode", ["off", "thread", "process"])
def test_keep_last_keeps_newest_complete_and_removes_leftovers(tmp_path, mode):
    # A leftover of a crashed run: an incomplete folder of an older step.
    stale = tmp_path / "step-000000000002.aaaaaaaaaaaa-0"
    stale.mkdir(parents=True)
    (stale / "model-00000.safetensors").write_bytes(b"partial")
    with CheckpointManager(tmp_path, async_mode=mode, keep_last=2) as mgr:
        assert mgr.latest_step() is None
        for step in (3, 4, 5, 6):
            mgr.save(step, {"m": {"w": torch.full((4,), float(step))}})
        mgr.wait()
        assert mgr.steps() == [5, 6]
    names = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step-"))
    assert len(names) == 2 and not stale.exists()
    out = {"m": {"w": torch.empty(4)}}
    CheckpointManager(tmp_path, async_mode="off").load(out, 5)
    assert torch.equal(out["m"]["w"], torch.full((4,), 5.0))


def test_latest_step_skips_incomplete_checkpoints(tmp_path):
    mgr = CheckpointManager(tmp_path, async_mode="off")
    for step in (1, 2, 3):
        mgr.save(step, {"m": {"w": torch.full((3,), float(step))}})
    assert mgr.latest_step() == 3
    (only_dir(tmp_path, 3) / "done-00000.json").unlink()  # rank 0 never finished step 3
    (only_dir(tmp_path, 2) / "manifest.json").unlink()  # the manifest of step 2 never landed
    fresh = CheckpointManager(tmp_path, read_only=True)  # mgr still holds the root
    assert fresh.latest_step() == 1 and fresh.steps() == [1]
    out = {"m": {"w": torch.empty(3)}}
    assert fresh.load(out) == 1
    assert torch.equal(out["m"]["w"], torch.ones(3))
    with pytest.raises(CheckpointNotFoundError, match=r"step 3.*complete steps: \[1\]"):
        fresh.load(out, 3)


# ----------------------------------------------------------------------------- integrity


def _saved(tmp_path):
    model, opt, _ = train_objects()
    mgr = CheckpointManager(tmp_path, async_mode="off", block_size=4096)
    big = {"w": torch.randn(64, 64)}
    mgr.save(1, {"model": model, "optim": opt, "big": big})
    return mgr


@pytest.mark.parametrize("where", ["data", "header"])
def test_flipped_byte_fails_naming_the_file(tmp_path, where):
    mgr = _saved(tmp_path)
    f = only_dir(tmp_path, 1) / "big-00000.safetensors"
    data = bytearray(f.read_bytes())
    pos = len(data) - 100 if where == "data" else 20
    data[pos] ^= 0x01
    f.write_bytes(bytes(data))
    target = {"big": {"w": torch.zeros(64, 64)}}
    with pytest.raises(CorruptCheckpointError, match="big-00000.safetensors") as info:
        mgr.load(target)
    assert "checksum mismatch" in str(info.value)
    assert info.value.path.endswith("big-00000.safetensors")


def test_truncated_or_missing_file_fails_naming_it_before_touching_the_target(tmp_path):
    mgr = _saved(tmp_path)
    folder = only_dir(tmp_path, 1)
    f = folder / "model-00000.safetensors"
    f.write_bytes(f.read_bytes()[:-10])
    fresh, _, _ = train_objects(seed=4, steps=0)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(CorruptCheckpointError, match=r"model-00000\.safetensors.*truncated"):
        mgr.load({"model": fresh})
    assert same(dict(fresh.state_dict()), before)
    (folder / "big-00000.safetensors").unlink()
    with pytest.raises(CorruptCheckpointError, match=r"big-00000\.safetensors.*missing"):
        mgr.load({"big": {"w": torch.zeros(64, 64)}})


def test_corrupt_marker_is_named(tmp_path):
    mgr = _saved(tmp_path)
    marker = only_dir(tmp_path, 1) / "done-00000.json"
    marker.write_text(marker.read_text().replace("float32", "float64", 1))  # still valid JSON
    with pytest.raises(CorruptCheckpointError, match="done-00000.json"):
        mgr.load({"big": {"w": torch.zeros(64, 64)}})


# --------------------------------------------------------------------------- bad input


def test_mismatched_state_lists_every_difference_and_leaves_target_untouched(tmp_path):
    model, _, _ = train_objects()
    mgr = CheckpointManager(tmp_path, async_mode="off")
    mgr.save(1, {"model": model, "extra": {"a": torch.ones(3), "b": torch.ones(2, 2)}})
    other = torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.GELU(), torch.nn.Linear(24, 6))
    other.register_buffer("counter", torch.tensor([0]))
    other.register_buffer("new_buffer", torch.zeros(2))
    extra = {"a": torch.zeros(3), "c": torch.zeros(1)}
    before = ({k: v.clone() for k, v in other.state_dict().items()}, _clone(extra))
    with pytest.raises(StateMismatchError) as info:
        mgr.load({"model": other, "extra": extra})
    err = info.value
    assert "model.new_buffer" in err.missing and "extra.c" in err.missing
    assert err.unexpected == ["extra.b"]
    assert ("model.2.weight", "float32[6, 24]", "float32[5, 24]") in err.mismatched
    assert ("model.2.bias", "float32[6]", "float32[5]") in err.mismatched
    assert "model.2.weight" in str(err) and "[5, 24]" in str(err)
    assert same(dict(other.state_dict()), before[0]) and same(extra, before[1])
    with pytest.raises(StateMismatchError, match="not in the checkpoint"):
        mgr.load({"nothere": {"x": torch.zeros(1)}})
    # strict=False loads what matches and skips the rest (shapes must still agree).
    partial = {"a": torch.zeros(3)}
    mgr.load({"extra": partial}, strict=False)
    assert torch.equal(partial["a"], torch.ones(3))


def test_bad_arguments_are_rejected_before_any_work(tmp_path):
    with pytest.raises(
        ValueError, match=r"async_mode must be one of \('process', 'thread', 'off'\)"
    ):
        CheckpointManager(tmp_path, async_mode="fast")
    with pytest.raises(ValueError, match="keep_last must be None or an int >= 1"):
        CheckpointManager(tmp_path, keep_last=0)
    with pytest.raises(ValueError, match="block_size"):
        CheckpointManager(tmp_path, block_size=1000)
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['keep'\].*keep_last"):
        CheckpointManager(tmp_path, keep=2)
    with pytest.raises(TypeError, match=r"does not implement the Storage protocol.*'rename'"):
        CheckpointManager(None, storage=NoRename(tmp_path))
    policy = CheckpointPolicy(async_mode="off", keep_last=2)
    with CheckpointManager(tmp_path / "p", policy=policy, keep_last=5) as m:  # keywords win
        assert m.policy == CheckpointPolicy(async_mode="off", keep_last=5)
    mgr = CheckpointManager(tmp_path / "r", async_mode="off")
    with pytest.raises(ValueError, match="step must be an int >= 0"):
        mgr.save(-1, {"x": torch.zeros(1)})
    with pytest.raises(TypeError, match="state must be a non-empty dict"):
        mgr.save(1, [torch.zeros(1)])
    with pytest.raises(TypeError, match=r"cannot save x\.f: unsupported type .*function"):
        mgr.save(1, {"x": {"f": lambda: 0}})
    with pytest.raises(TypeError, match="dict key"):
        mgr.save(1, {"x": {torch.zeros(1): 1}})
    assert [p.name for p in (tmp_path / "r").iterdir()] == [".lock-00000.json"]  # the lock only
    with pytest.raises(CheckpointError, match="cannot be created"):
        (tmp_path / "afile").write_text("x")
        CheckpointManager(tmp_path / "afile" / "sub")
    with pytest.raises(CheckpointNotFoundError):
        mgr.load({"x": torch.zeros(1)})


@pytest.mark.parametrize(("err", "mode"), [(errno.ENOSPC, "thread"), (errno.EROFS, "off")])
def test_write_failure_surfaces_clearly_and_keeps_previous_checkpoints(tmp_path, err, mode):
    model, opt, _ = train_objects()
    storage = FailingStorage(tmp_path, fail_step=2, err=err)
    mgr = CheckpointManager(None, storage=storage, async_mode=mode)
    mgr.save(1, {"model": model, "optim": opt}).wait()
    ref = {k: v.clone() for k, v in model.state_dict().items()}
    if mode == "off":
        with pytest.raises(CheckpointWriteError, match=os.strerror(err)):
            mgr.save(2, {"model": model, "optim": opt})
    else:
        handle = mgr.save(2, {"model": model, "optim": opt})
        while not handle.done():
            time.sleep(0.01)
        with pytest.raises(CheckpointWriteError) as info:
            mgr.save(3, {"model": model, "optim": opt})  # the failure surfaces on the next call
        assert "optim-00000.safetensors" in str(info.value) and os.strerror(err) in str(info.value)
        assert "earlier checkpoints are untouched" in str(info.value)
        with pytest.raises(CheckpointWriteError):
            handle.wait()
        mgr.wait()  # already reported: does not raise again
    assert mgr.latest_step() == 1
    assert not list(tmp_path.rglob(".tmp-*"))  # temporary files cleaned up
    fresh, _, _ = train_objects(seed=3, steps=0)
    mgr.load({"model": fresh}, 1)
    assert same(dict(fresh.state_dict()), ref)
    mgr.close()


# ---------------------------------------------------------------------- sharded tensors


def test_sharded_protocol_reshards_and_reads_only_the_needed_ranges(tmp_path):
    full = torch.randn(256, 256)
    storage = CountingStorage(tmp_path)
    mgr = CheckpointManager(None, storage=storage, async_mode="off", block_size=4096)
    mgr.save(1, {"p": {"w": row_chunks(full, [0, 64, 128, 192, 256]), "b": torch.arange(10)}})
    # Load rows 100..130 into one owned chunk: only that byte range (plus block edges) is read.
    target = Chunked(full.shape, full.dtype, [((100, 0), torch.zeros(30, 256))])
    b = torch.zeros(10, dtype=torch.int64)
    storage.read_bytes.clear()
    mgr.load({"p": {"w": target, "b": b}})
    assert torch.equal(target.local_chunks()[0][1], full[100:130])
    assert torch.equal(b, torch.arange(10))
    data_reads = sum(n for p, n in storage.read_bytes.items() if p.endswith(".safetensors"))
    needed = 30 * 256 * 4
    header = (only_dir(tmp_path, 1) / "p-00000.safetensors").stat().st_size - 256 * 256 * 4 - 80
    assert data_reads <= needed + 2 * 4096 + header + 4096, (data_reads, needed)
    assert data_reads < full.numel() * 4 / 4
    # Column chunks, a replicated plain tensor, and an uneven owned layout all come back exact.
    cols = Chunked(
        full.shape, full.dtype, [((0, 0), torch.zeros(256, 100)), ((0, 100), torch.zeros(256, 156))]
    )
    plain = torch.zeros(256, 256)
    mgr.load({"p": {"w": cols, "b": b}})
    assert torch.equal(assemble(cols), full)
    mgr.load({"p": {"w": plain, "b": b}})
    assert torch.equal(plain, full)
    odd = Chunked(
        full.shape, full.dtype, [((7, 3), torch.zeros(200, 250)), ((0, 0), torch.zeros(1, 1))]
    )
    mgr.load({"p": {"w": odd, "b": b}})
    assert torch.equal(odd.local_chunks()[0][1], full[7:207, 3:253])
    assert odd.local_chunks()[1][1].item() == full[0, 0].item()


def test_incomplete_sharded_save_is_reported_on_load(tmp_path):
    full = torch.randn(8, 4)
    mgr = CheckpointManager(tmp_path, async_mode="off")
    mgr.save(1, {"p": {"w": row_chunks(full, [0, 4])}})  # rows 4..8 never saved
    with pytest.raises(CheckpointError, match=r"p\.w: the checkpoint's chunks cover 16 of the 32"):
        mgr.load({"p": {"w": torch.zeros(8, 4)}})


def test_dtypes_and_odd_shapes_round_trip(tmp_path):
    values = {
        "bf16": torch.randn(3, 5).to(torch.bfloat16),
        "f16": torch.randn(7).half(),
        "f64": torch.randn(2, 2, dtype=torch.float64),
        "i8": torch.randint(-100, 100, (9,), dtype=torch.int8),
        "u8": torch.randint(0, 255, (3,), dtype=torch.uint8),
        "bool": torch.rand(5) > 0.5,
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 4),
        "c64": torch.randn(3, dtype=torch.complex64),
        "c128": torch.randn(2, dtype=torch.complex128),
        "f8": torch.randn(4).to(torch.float8_e4m3fn),
        "noncontig": torch.randn(4, 6).t(),
        "i64": torch.arange(5),
    }
    mgr = CheckpointManager(tmp_path, async_mode="off")
    mgr.save(3, {"v": values})
    out = {
        k: torch.empty_like(v) if k != "noncontig" else torch.empty(4, 6).t()
        for k, v in values.items()
    }
    mgr.load({"v": out})
    for k, v in values.items():
        got, want = out[k].reshape(-1).contiguous(), v.reshape(-1).contiguous()
        assert got.dtype == want.dtype and got.shape == want.shape, k
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), k


def test_fresh_optimizer_and_layout_change(tmp_path):
    model, opt, _ = train_objects()
    mgr = CheckpointManager(tmp_path, async_mode="thread")
    mgr.save(1, {"model": model, "optim": opt})
    bigger = torch.nn.Linear(3, 3)
    mgr.save(2, {"model": bigger})  # a new layout: new plan, new staging buffers
    mgr.wait()
    assert mgr.collectives == 0  # single process: no collective at all
    fresh_model, fresh_opt, _ = train_objects(seed=8, steps=0)
    assert not fresh_opt.state
    mgr.load({"model": fresh_model, "optim": fresh_opt}, 1)
    assert same(fresh_opt.state_dict(), opt.state_dict())
    assert same(dict(fresh_model.state_dict()), dict(model.state_dict()))
    other = torch.nn.Linear(3, 3)
    mgr.load({"model": other}, 2)
    assert torch.equal(other.weight, bigger.weight)
    mgr.close()


@requires_gpus(1)
@pytest.mark.parametrize("mode", ["off", "thread", "process"])
def test_cuda_state_stages_into_pinned_buffers_and_round_trips(tmp_path, mode):
    w = torch.randn(1024, 1024, device="cuda")
    b = torch.arange(10, device="cuda")
    ref = (w.cpu(), b.cpu())
    with CheckpointManager(tmp_path, async_mode=mode) as mgr:
        handle = mgr.save(1, {"m": {"w": w, "b": b}})
        w.add_(1)  # same stream: runs after the asynchronous device-to-host staging copy
        handle.wait()
        out = {"m": {"w": torch.empty_like(w), "b": torch.empty_like(b)}}
        mgr.load(out)
    assert out["m"]["w"].is_cuda and torch.equal(out["m"]["w"].cpu(), ref[0])
    assert torch.equal(out["m"]["b"].cpu(), ref[1])
