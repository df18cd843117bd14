"""Real gloo process groups (2 and 4 ranks): collectives counted, round trips, N->M resharding.

Three ``run_distributed`` calls share one folder:

1. 4 ranks save ``ckpt4`` (collectives counted), reload it in four other shardings, export HF;
2. 2 ranks train/save/load a DTensor model + optimizer + RNG + custom state (collectives
   counted, mutation after save, async == sync files), load ``ckpt4`` (4 -> 2) in four
   shardings reading only the files they need, save ``ckpt2``, import the HF export in place;
3. 4 ranks load ``ckpt2`` (2 -> 4) in four shardings.

The pytest process itself then loads both checkpoints into 1 rank.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from titan_testing import run_distributed
from torch_checkpointing import (
    CheckpointError,
    CheckpointManager,
    CheckpointWarning,
    FsspecStorage,
    PerRank,
    load_hf,
    save_hf,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _checkpointing_cases import Chunked, CountingStorage, RNGHolder

# ---------------------------------------------------------------------- test-only helpers


class CountingGroup:
    """Wraps a process group and records every method called on it but rank/size/name."""

    def __init__(self, inner):
        self._inner = inner
        self.calls: list[str] = []

    def rank(self):
        return self._inner.rank()

    def size(self):
        return self._inner.size()

    def name(self):
        return self._inner.name()

    def __getattr__(self, name):
        attr = getattr(self._inner, name)
        if not callable(attr):
            return attr

        def counted(*args, **kwargs):
            self.calls.append(name)
            return attr(*args, **kwargs)

        return counted


_DIST_COLLECTIVES = (
    "all_gather", "all_gather_object", "all_gather_into_tensor", "all_reduce", "all_to_all",
    "all_to_all_single", "barrier", "broadcast", "broadcast_object_list", "gather",
    "gather_object", "monitored_barrier", "recv", "reduce", "reduce_scatter",
    "reduce_scatter_tensor", "scatter", "scatter_object_list", "send", "isend", "irecv",
)  # fmt: skip


@contextlib.contextmanager
def count_module_collectives():
    """Also count collectives issued through ``torch.distributed`` functions (expected: 0)."""
    calls: list[str] = []
    saved = {}
    for name in _DIST_COLLECTIVES:
        fn = getattr(dist, name, None)
        if fn is None:
            continue
        saved[name] = fn

        def counted(*args, __fn=fn, __name=name, **kwargs):
            calls.append(__name)
            return __fn(*args, **kwargs)

        setattr(dist, name, counted)
    try:
        yield calls
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


@contextlib.contextmanager
def count_offset_computations():
    """Count calls of torch's DTensor offset computation (an arange over the sharded dim)."""
    import torch.distributed.tensor._utils as dt_utils

    calls: list[int] = []
    real = dt_utils.compute_local_shape_and_global_offset

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    dt_utils.compute_local_shape_and_global_offset = counted
    try:
        yield calls
    finally:
        dt_utils.compute_local_shape_and_global_offset = real


class Progress:
    """A replicated custom stateful object."""

    def __init__(self):
        self.tokens = torch.zeros((), dtype=torch.int64)
        self.history: list = []

    def state_dict(self):
        return {"tokens": self.tokens, "history": list(self.history), "name": "run-a"}

    def load_state_dict(self, sd):
        self.tokens = sd["tokens"].clone()
        self.history = list(sd["history"])


def global_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w1": torch.randn(16, 12, generator=g),
        "w2": torch.randn(10, 7, generator=g).to(torch.bfloat16),
        "w3": torch.randn(9, 5, generator=g, dtype=torch.float64),
        "e": torch.arange(6, dtype=torch.int64) * 7,
        "s": torch.tensor(2.5),
    }


SAVE4 = {"w1": "shard1", "w2": "owned", "w3": "tiles", "e": "replicate", "s": "plain"}
SAVE2 = {"w1": "shard0", "w2": "shard1", "w3": "plain", "e": "rows", "s": "replicate"}
LOADS = [
    {"w1": "shard0", "w2": "rows", "w3": "owned", "e": "plain", "s": "replicate"},
    {"w1": "tiles", "w2": "shard0", "w3": "shard1", "e": "shard0", "s": "plain"},
    {"w1": "replicate", "w2": "tiles", "w3": "rows", "e": "owned", "s": "plain"},
    {"w1": "shard1", "w2": "plain", "w3": "shard0", "e": "replicate", "s": "replicate"},
]


def _from_full(full, mesh, placements):
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, off = compute_local_shape_and_global_offset(full.shape, mesh, placements)
    local = full[tuple(slice(o, o + s) for o, s in zip(off, shape, strict=True))].clone()
    return DTensor.from_local(
        local, mesh, placements, run_check=False, shape=full.shape, stride=full.stride()
    )


def _split(n: int, parts: int, weighted: bool) -> list[int]:
    weights = [r + 1 for r in range(parts)] if weighted else [1] * parts
    bounds = [0]
    for r in range(parts):
        bounds.append(round(n * sum(weights[: r + 1]) / sum(weights)))
    return bounds


def build(full, layout, mesh, rank, world, empty=False):
    """``full`` laid out as ``layout`` on this rank (``empty``: same layout, sentinel values)."""
    from torch.distributed.tensor import Replicate, Shard

    src = full
    if empty:
        src = torch.full_like(full, -7 if not full.dtype.is_floating_point else -999.0)
    if layout == "plain":
        return src.clone()
    if layout in ("shard0", "shard1", "replicate"):
        placements = {"shard0": [Shard(0)], "shard1": [Shard(1)], "replicate": [Replicate()]}
        return _from_full(src, mesh, placements[layout])
    nd = full.dim()
    chunks = []
    if layout == "owned":
        if full.numel() % world == rank:
            chunks = [((0,) * nd, src.clone())]
    elif layout == "rows":
        b = _split(full.shape[0], world, weighted=True)
        if b[rank + 1] > b[rank]:
            chunks = [((b[rank],) + (0,) * (nd - 1), src[b[rank] : b[rank + 1]].clone())]
    elif layout == "tiles":
        rb, cb = _split(full.shape[0], 2, False), _split(full.shape[1], 2, False)
        for t, (i, j) in enumerate([(0, 0), (0, 1), (1, 0), (1, 1)]):
            if t % world == rank:
                tile = src[rb[i] : rb[i + 1], cb[j] : cb[j + 1]].clone()
                chunks.append(((rb[i], cb[j]), tile))
    else:
        raise ValueError(layout)
    return Chunked(full.shape, full.dtype, chunks)


def boxes(obj):
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if isinstance(obj, DTensor):
        _, off = compute_local_shape_and_global_offset(obj.shape, obj.device_mesh, obj.placements)
        return [(tuple(off), obj.to_local())]
    if isinstance(obj, Chunked):
        return obj.local_chunks()
    return [((0,) * obj.dim(), obj)]


def check_layout(obj, full, what):
    for off, t in boxes(obj):
        want = full[tuple(slice(o, o + s) for o, s in zip(off, t.shape, strict=True))]
        assert torch.equal(t, want), f"{what}: box at {off} differs"


def build_state(layouts, mesh, rank, world, empty=False):
    full = global_tensors()
    return {n: build(full[n], layouts[n], mesh, rank, world, empty) for n in full}


def reload_all(mgr, mesh, rank, world, what, extra=None):
    full = global_tensors()
    for i, layouts in enumerate(LOADS):
        target = build_state(layouts, mesh, rank, world, empty=True)
        state = {"g": target, **(extra or {})}
        mgr.load(state)
        for n in full:
            check_layout(target[n], full[n], f"{what} load #{i} {n} as {layouts[n]}")


def local_snapshot(x):
    from torch.distributed.tensor import DTensor

    if isinstance(x, DTensor):
        return x.to_local().clone()
    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, dict):
        return {k: local_snapshot(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return type(x)(local_snapshot(v) for v in x)
    return x


def same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(map(same, a, b))
    return a == b


def build_model(mesh, seed):
    from torch.distributed.tensor import Shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Linear(6, 4))
    for mod in model:
        for pname, p in list(mod.named_parameters(recurse=False)):
            setattr(mod, pname, torch.nn.Parameter(_from_full(p.detach(), mesh, [Shard(0)])))
    return model


def fake_step(model, opt, seed):
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = _from_full(torch.randn(p.shape, generator=g), p.device_mesh, p.placements)
    opt.step()
    opt.zero_grad(set_to_none=True)


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dist.get_world_size(),))


def _rank_files(folder: Path, rank: int) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.glob(f"*-{rank:05d}.safetensors"))}


def _only_dir(root: Path) -> Path:
    (d,) = [p for p in root.iterdir() if p.name.startswith("step-")]
    return d


# ----------------------------------------------------------------- rank functions (4 ranks)


def _four_rank_save(root: str) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = _mesh()
    root_p = Path(root)
    state = {"g": build_state(SAVE4, mesh, rank, world), "meta": {"step": 0, "who": "four"}}
    big = torch.arange(256 * 64, dtype=torch.float32).view(256, 64)
    state["only_w"] = {"w": build(big, "shard0", mesh, rank, world)}
    pg = CountingGroup(dist.group.WORLD)
    with count_module_collectives() as module_calls:
        mgr = CheckpointManager(
            root_p / "ckpt4",
            process_group=pg,
            async_mode="process",
            keep_last=3,
            block_size=4096,
        )
        mgr.save(1, state)
        after_first = list(pg.calls)
        for step in range(2, 7):
            state["meta"]["step"] = step
            mgr.save(step, state)
        mgr.wait()
        after_six = list(pg.calls)
    dist.barrier()
    assert mgr.steps() == [4, 5, 6], mgr.steps()
    meta: dict = {}
    reload_all(mgr, mesh, rank, world, "4->4", {"meta": meta})
    assert meta == {"step": 6, "who": "four"}
    mgr.close()
    # HF export from 4 ranks: each writes its own pieces (column shards, a whole tensor on its
    # owner, tiles, replicas once, a key only rank 3 holds as a pipeline stage would) in place;
    # one tensor gets a layout transform after its pieces are written.
    full = global_tensors()
    hf_in = {f"model.{n}": build(full[n], SAVE4[n], mesh, rank, world) for n in full}
    if rank == 3:
        hf_in["model.stage3"] = full["w1"][:5].clone()
    transform = {"model.w3": hf_transform}
    index = save_hf(hf_in, root_p / "hf", max_shard_size=300, transforms=transform)
    # Pieces spread over ranks need a storage that writes at offsets; every rank says so.
    memory = FsspecStorage(f"memory://hf-{rank}")
    with pytest.raises(CheckpointError, match="cannot write at an offset"):
        save_hf(hf_in, storage=memory)
    # One rank's bad input: that rank raises it, the others name it (nobody hangs).
    bad = {**hf_in, "model.z": torch.zeros(2, dtype=torch.complex128)} if rank == 1 else hf_in
    with pytest.raises((TypeError, ValueError), match="complex128|rank 1 refused"):
        save_hf(bad, root_p / "hf-bad")
    dist.barrier()
    return {"first": after_first, "six": after_six, "module": module_calls, "index": index}


def hf_transform(w):
    """A layout change as an HF adapter makes one: rows reversed, then transposed."""
    return w.flip(0).t()


def _four_rank_load(root: str) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = _mesh()
    mgr = CheckpointManager(Path(root) / "ckpt2", read_only=True)
    meta: dict = {}
    reload_all(mgr, mesh, rank, world, "2->4", {"meta": meta})
    assert meta["who"] == "two"
    with pytest.raises(CheckpointError, match=r"PerRank items \['rng'\] were saved by 2 ranks"):
        mgr.load({"g": build_state(SAVE4, mesh, rank, world, True), "rng": PerRank(RNGHolder())})
    return {"ok": True}


# ----------------------------------------------------------------- rank functions (2 ranks)


def _two_rank(root: str) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = _mesh()
    root_p = Path(root)
    out: dict = {}

    # -- a DTensor model + optimizer + RNG + custom state, 6 saves, collectives counted.
    model = build_model(mesh, seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    progress = Progress()
    full = global_tensors()
    owned = {"emb": build(full["w1"], "owned", mesh, rank, world)}
    torch.manual_seed(500 + rank)
    fake_step(model, opt, seed=0)
    state = {
        "model": model,
        "optim": opt,
        "progress": progress,
        "owned": owned,
        "rng": PerRank(RNGHolder()),
    }
    pg = CountingGroup(dist.group.WORLD)
    snaps = {}
    with count_module_collectives() as module_calls:
        mgr = CheckpointManager(
            root_p / "train", process_group=pg, async_mode="process", keep_last=2
        )
        out["offset_calls"] = []
        for step in range(1, 7):
            progress.tokens += 100
            progress.history.append(step)
            with count_offset_computations() as calls:
                mgr.save(step, state)
            out["offset_calls"].append(len(calls))
            snaps[step] = (local_snapshot(model.state_dict()), local_snapshot(opt.state_dict()))
            expected_draw = torch.rand(3)  # what the restored RNG must produce next
            fake_step(model, opt, seed=step)  # mutate right after save() returned
            if step == 1:
                out["first"] = list(pg.calls)
        mgr.wait()
        out["six"] = list(pg.calls)
    out["module"] = module_calls
    dist.barrier()
    assert mgr.steps() == [5, 6], mgr.steps()
    model2 = build_model(mesh, seed=9)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=0.05, weight_decay=0.1)
    progress2 = Progress()
    owned2 = {"emb": build(full["w1"], "owned", mesh, rank, world, empty=True)}
    torch.manual_seed(0)
    assert (
        mgr.load(
            {
                "model": model2,
                "optim": opt2,
                "progress": progress2,
                "owned": owned2,
                "rng": PerRank(RNGHolder()),
            }
        )
        == 6
    )
    assert same(local_snapshot(model2.state_dict()), snaps[6][0])
    assert same(local_snapshot(opt2.state_dict()), snaps[6][1])
    assert torch.equal(torch.rand(3), expected_draw)
    assert progress2.tokens.item() == 600 and progress2.history == [1, 2, 3, 4, 5, 6]
    check_layout(owned2["emb"], full["w1"], "owned emb")
    mgr.load({"model": model2}, 5)
    assert same(local_snapshot(model2.state_dict()), snaps[5][0])
    # -- damage that only rank 1 reads: with fallback=True both ranks load step 5, not just 1.
    folder6 = next((root_p / "train").glob("step-000000000006.*"))
    dist.barrier()
    if rank == 1:
        f = folder6 / "model-00001.safetensors"
        data = bytearray(f.read_bytes())
        data[-5] ^= 0x10
        f.write_bytes(bytes(data))
    dist.barrier()
    model3 = build_model(mesh, seed=11)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert mgr.load({"model": model3}, fallback=True) == 5
    assert same(local_snapshot(model3.state_dict()), snaps[5][0])
    said = " ".join(str(w.message) for w in caught if w.category is CheckpointWarning)
    assert "loaded step 5" in said and folder6.name in said, said
    assert ("model-00001.safetensors" if rank == 1 else "ranks [1] found it damaged") in said
    assert folder6.exists()  # left in place
    mgr.close()

    # -- async and sync writers produce identical data files.
    contents = {}
    for mode in ("process", "thread", "off"):
        with CheckpointManager(root_p / f"same-{mode}", async_mode=mode) as m:
            m.save(3, {"model": model, "optim": opt, "owned": owned})
        contents[mode] = _rank_files(_only_dir(root_p / f"same-{mode}"), rank)
    assert contents["process"] == contents["thread"] == contents["off"]
    assert len(contents["off"]) >= 2  # model, optim (+ owned where this rank owns it)

    # -- 4 -> 2 resharding, reading only the files that hold needed bytes.
    storage = CountingStorage(root_p / "ckpt4")
    mgr4 = CheckpointManager(None, storage=storage, read_only=True)
    meta: dict = {}
    reload_all(mgr4, mesh, rank, world, "4->2", {"meta": meta})
    assert meta == {"step": 6, "who": "four"}
    big = torch.arange(256 * 64, dtype=torch.float32).view(256, 64)
    target = {"w": build(big, "shard0", mesh, rank, world, empty=True)}
    storage.read_bytes.clear()
    mgr4.load({"only_w": target})
    check_layout(target["w"], big, "only_w")
    out["read"] = {p.rsplit("/", 1)[1]: n for p, n in storage.read_bytes.items()}

    # -- save the 2-rank checkpoint (other shardings, a PerRank item).
    with CheckpointManager(root_p / "ckpt2", async_mode="thread") as m2:
        m2.save(
            1,
            {
                "g": build_state(SAVE2, mesh, rank, world),
                "meta": {"who": "two"},
                "rng": PerRank(RNGHolder()),
            },
        )

    # -- HF import of the 4-rank export, in place, into shardings.
    hf_full = {**full, "w3": hf_transform(full["w3"]), "stage3": full["w1"][:5]}
    layouts = {**LOADS[1], "stage3": "rows"}
    hf_target = {
        f"model.{n}": build(t, layouts[n], mesh, rank, world, empty=True)
        for n, t in hf_full.items()
    }
    load_hf(root_p / "hf", hf_target)
    for n, t in hf_full.items():
        check_layout(hf_target[f"model.{n}"], t, f"hf {n}")
    dist.barrier()
    return out


# ------------------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    return tmp_path_factory.mktemp("dist")


@pytest.fixture(scope="module")
def four_saved(shared):
    return run_distributed(_four_rank_save, 4, str(shared), timeout=300)


@pytest.fixture(scope="module")
def two_ran(shared, four_saved):
    return run_distributed(_two_rank, 2, str(shared), timeout=300)


def test_four_ranks_one_collective_then_none_and_reshard(four_saved):
    for r in four_saved:
        assert r["first"] == ["allgather"], r["first"]  # exactly one metadata exchange
        assert r["six"] == ["allgather"], r["six"]  # and none for the next five saves
        assert r["module"] == []  # nothing through torch.distributed's default group


def test_two_ranks_round_trip_counts_and_4_to_2(two_ran):
    for r in two_ran:
        assert r["first"] == ["allgather"] and r["six"] == ["allgather"]
        assert r["module"] == []
        # Shard offsets depend only on the layout: computed at the first save, never again.
        assert r["offset_calls"][0] > 0 and r["offset_calls"][1:] == [0] * 5, r["offset_calls"]
    for rank, r in enumerate(two_ran):
        # Rank r needs rows [128 r, 128 r + 128): the files of saved ranks 2r and 2r+1. From
        # any other file it reads at most one checksum block (rank 0's file: the header).
        mine = {f"only_w-{2 * rank + i:05d}.safetensors" for i in (0, 1)}
        assert all(r["read"].get(f, 0) >= 128 * 64 * 4 // 2 for f in mine), r["read"]
        others = {
            f: n for f, n in r["read"].items() if f.endswith(".safetensors") and f not in mine
        }
        assert all(n <= 4096 for n in others.values()), r["read"]
        assert set(others) <= {"only_w-00000.safetensors"}, r["read"]


def test_four_ranks_load_two_rank_checkpoint(shared, two_ran):
    assert run_distributed(_four_rank_load, 4, str(shared), timeout=300) == [{"ok": True}] * 4


def test_one_process_loads_both_and_hf_files_are_standard(shared, two_ran, four_saved):
    full = global_tensors()
    for name in ("ckpt2", "ckpt4"):
        mgr = CheckpointManager(shared / name, read_only=True)
        for layouts in (
            dict.fromkeys(full, "plain"),
            {"w1": "rows", "w2": "tiles", "w3": "owned", "e": "rows", "s": "plain"},
        ):
            target = {n: build(full[n], layouts[n], None, 0, 1, empty=True) for n in full}
            mgr.load({"g": target})
            for n in full:
                check_layout(target[n], full[n], f"{name} -> 1 rank {n} {layouts[n]}")
    index = four_saved[0]["index"]
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 4 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    loaded = {}
    for f in files:
        loaded.update(load_file(str(shared / "hf" / f)))  # the reference safetensors reader
    assert sorted(loaded) == sorted([*(f"model.{n}" for n in full), "model.stage3"])
    for n in full:
        want = hf_transform(full[n]) if n == "w3" else full[n]
        assert torch.equal(loaded[f"model.{n}"], want), n
    assert torch.equal(loaded["model.stage3"], full["w1"][:5])
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in loaded.values()
    )
    assert not list((shared / "hf").glob(".tmp-*")) and not (shared / "hf-bad").exists()
