"""torch_checkpointing vs torch.distributed.checkpoint (DCP), same state, same run.

Each rank holds ``--gib`` GiB of model + AdamW state as Shard(0) DTensors (params, exp_avg,
exp_avg_sq in equal thirds, plus the step counters). Per repetition, interleaved:

* blocking: how long ``save()`` blocks the trainer in async mode, vs ``dcp.async_save``;
* write: ``save()`` until ``handle.wait()`` returns (the files, marker and manifest are on
  disk, fsynced), vs ``dcp.save`` (its FileSystemWriter also fsyncs);
* load: ``manager.load(state)`` (every block's XXH3-64 digest verified; and again with
  ``verify=False``, since DCP verifies nothing), vs ``dcp.load(state)``; both in place,
  both cold: every checkpoint file is dropped from the page cache first (``posix_fadvise``),
  as when a job restarts on fresh nodes.

* load, warm: the same loads again right after, with the files in the page cache (a job
  restarted on the same nodes);
* raw floors, the best any library could do with the same bytes on the same machine: a
  ``copy_`` of every local tensor into a reused buffer (staging), one sequential write + fsync
  of those bytes per rank (write) and one sequential cold read of them back (load), all ranks
  at once; for the resharding loads, the cold read of the bytes each rank needs, laid out as
  the source ranks wrote them. ``floor / DCP`` is the smallest ratio reachable here.

Cold reads take turns going first (a read right after the saves can share the disk with
their write-back): ours, DCP's and the raw floor rotate by one place each repetition, the
resharding loads the same way.

A first untimed round warms both up (our metadata exchange + staging buffers + writer
process; DCP's planner caches and executor). Times are the max over ranks of each
repetition, then the median over repetitions.

    python benchmarks/vs_dcp.py --gib 1 --reps 3
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _meminfo_available_gib() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return float("inf")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_state(
    gib: float,
    mesh,
    layout: str = "2d",
    shard_numel: int = 16 << 20,
    cols: int = 4096,
    ranks: int | None = None,
) -> dict:
    """Local bytes ~= gib GiB per rank of ``ranks`` (default: the mesh's size): params +
    exp_avg + exp_avg_sq, fp32, Shard(0) over the mesh, on its device. ``layout="2d"``: 24
    (rows, 4096) matrices; ``"1d"``: as many 1-D tensors as fit, each of the ``ranks`` shards
    holding ``shard_numel`` elements (flat parameters, large vectors: where torch's offset
    computation costs most). A mesh of another size holds the same global tensors
    (resharding)."""
    from torch.distributed.tensor import DTensor, Shard

    world = mesh.size()
    ranks = ranks or world
    local_elems = int(gib * 2**30 / 4 / 3)
    if layout == "1d":
        n_tensors = max(1, local_elems // shard_numel)
        global_shape = (shard_numel * ranks,)
        local_shape, stride = (global_shape[0] // world,), (1,)
    else:
        n_tensors = 24
        rows = max(1, local_elems // (n_tensors * cols))
        global_shape = (rows * ranks, cols)
        local_shape, stride = (global_shape[0] // world, cols), (cols, 1)
    g = torch.Generator().manual_seed(dist.get_rank())

    def dt(scale: float):
        local = (torch.randn(*local_shape, generator=g) * scale).to(mesh.device_type)
        return DTensor.from_local(
            local, mesh, [Shard(0)], run_check=False, shape=global_shape, stride=stride
        )

    model = {f"layers.{i}.weight": dt(0.02) for i in range(n_tensors)}
    optim = {
        "state": {
            f"layers.{i}.weight": {
                "step": torch.tensor(10.0),
                "exp_avg": dt(1e-3),
                "exp_avg_sq": dt(1e-6),
            }
            for i in range(n_tensors)
        },
        "param_groups": [{"lr": 3e-4, "betas": (0.9, 0.95), "weight_decay": 0.1}],
    }
    return {"model": model, "optim": optim}


def local_tensors(state: dict) -> list[torch.Tensor]:
    """Every tensor a rank holds (the local shard of each DTensor)."""
    from torch.distributed.tensor import DTensor

    out: list[torch.Tensor] = []

    def walk(x):
        if isinstance(x, DTensor):
            out.append(x.to_local())
        elif isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)

    walk(state)
    return out


def _nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class RawFloor:
    """Staging copy, write + fsync and cold read of a rank's bytes with no library around them.

    ``segments``: where the bytes live, ``(path, file offset, first byte, end byte)`` of this
    rank's bytes; by default one file of its own. The resharding floors use several (N -> 1:
    one process reads the N ranks' files) or one shared file (1 -> N: each rank reads its
    part of the single rank's file)."""

    def __init__(
        self,
        tensors: list[torch.Tensor],
        folder: str,
        rank: int,
        segments: list[tuple[str, int, int, int]] | None = None,
    ) -> None:
        self.tensors = [t.reshape(-1).view(torch.uint8) for t in tensors]
        self.nbytes = sum(t.numel() for t in self.tensors)
        self.cuda = any(t.is_cuda for t in self.tensors)
        self.buffer = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=self.cuda)
        self.buffer.fill_(0)  # fault the pages in once, as a reused staging buffer is
        self.path = os.path.join(folder, f"raw_floor_{rank}.bin")
        self.segments = segments or [(self.path, 0, 0, self.nbytes)]
        self.paths = sorted({seg[0] for seg in self.segments})

    def stage(self) -> None:
        pos = 0
        for t in self.tensors:
            self.buffer[pos : pos + t.numel()].copy_(t, non_blocking=self.cuda)
            pos += t.numel()
        if self.cuda:
            torch.cuda.synchronize()

    def write(self) -> None:
        mv = memoryview(self.buffer.numpy())
        for path, off, lo, hi in self.segments:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)  # a shared file: no O_TRUNC
            try:
                for a in range(lo, hi, _RAW_IO):
                    os.pwrite(fd, mv[a : min(hi, a + _RAW_IO)], off + a - lo)
                os.fsync(fd)
            finally:
                os.close(fd)

    def read(self) -> None:
        mv = memoryview(self.buffer.numpy())
        for path, off, lo, hi in self.segments:
            fd = os.open(path, os.O_RDONLY)
            try:
                for a in range(lo, hi, _RAW_IO):
                    os.preadv(fd, [mv[a : min(hi, a + _RAW_IO)]], off + a - lo)
            finally:
                os.close(fd)

    def remove(self) -> None:
        for path in self.paths:
            if os.path.exists(path):
                os.remove(path)


_RAW_IO = 16 << 20


def _max(t: float) -> float:
    x = torch.tensor([t], dtype=torch.float64)
    dist.all_reduce(x, op=dist.ReduceOp.MAX)
    return float(x.item())


def _evict(path: str) -> None:
    """Drop ``path`` (a file, or a folder's files) from the page cache: loads run cold."""
    walk = os.walk(path) if os.path.isdir(path) else [(os.path.dirname(path), [], [path])]
    for dirpath, _, names in walk:
        for n in names:
            fd = os.open(os.path.join(dirpath, n), os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _proc_status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _rss_reset() -> int | None:
    """Reset this process's peak RSS (VmHWM) to its current RSS (Linux ``clear_refs`` 5, for
    this benchmark process only) and return the current RSS; ``None`` where not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _proc_status("VmRSS")
    except (OSError, KeyError):
        return None


_PHASES = ("metadata_s", "open_s", "deserialize_s", "read_s", "checksum_s", "copy_s", "wait_s")


def _timed(res: dict, name: str, fn, stats=None) -> None:
    """Run ``fn`` on every rank at once; record its time, the peak RSS above the RSS before
    it (``name + "_mem"``) and, with a ``LoadStats``, each phase; all max over ranks."""
    dist.barrier()
    base = _rss_reset()
    t0 = time.perf_counter()
    fn()
    res.setdefault(name, []).append(_max(time.perf_counter() - t0))
    extra = -1.0 if base is None else float(max(0, _proc_status("VmHWM") - base))
    res.setdefault(name + "_mem", []).append(_max(extra))
    if stats is not None:
        for k in (*_PHASES, "total_s", "staging_peak_bytes", "bytes_direct", "bytes_copied"):
            res.setdefault(f"{name}.{k}", []).append(_max(float(getattr(stats, k))))


def _timed_max(fn) -> float:
    """``fn`` on every rank at once; its time, max over ranks."""
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    return _max(time.perf_counter() - t0)


def _rotated(items: tuple, rep: int) -> tuple:
    """``items`` rotated by ``rep``: over ``len(items)`` reps each goes first, second, ..."""
    k = rep % len(items)
    return items[k:] + items[:k]


def _rmtree(path: str) -> None:
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
    dist.barrier()


def _join(rank: int, world: int, port: int, args: argparse.Namespace) -> Any:
    """This rank in the gloo group of ``world`` ranks; its 1-D device mesh."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh

    if args.device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    return init_device_mesh(args.device, (world,))


def worker(rank: int, world: int, port: int, args: argparse.Namespace, out_q) -> None:
    mesh = _join(rank, world, port, args)
    import torch.distributed.checkpoint as dcp

    from torch_checkpointing import CheckpointManager, LoadStats

    state = build_state(args.gib, mesh, args.layout, args.shard_numel)
    nbytes = _nbytes(local_tensors(state))
    base = args.dir
    ours_root = os.path.join(base, "ours")
    extra = {} if args.io_threads is None else {"io_threads": args.io_threads}
    mgr = CheckpointManager(ours_root, async_mode=args.mode, keep_last=1, **extra)
    res: dict[str, list[float]] = {k: [] for k in (
        "ours_block", "ours_write", "ours_load", "ours_load_noverify", "dcp_async_block", "dcp_async_total",
        "dcp_save", "dcp_load", "ours_first_block", "dcp_first_async_block", "ours_load_warm",
        "dcp_load_warm", "raw_stage", "raw_write", "raw_read")}  # fmt: skip
    raw = RawFloor(local_tensors(state), base, rank)

    def ours_save(step: int) -> tuple[float, float]:
        dist.barrier()
        t0 = time.perf_counter()
        h = mgr.save(step, state)
        t1 = time.perf_counter()
        h.wait()
        t2 = time.perf_counter()
        return t1 - t0, t2 - t0

    def dcp_async(step: int) -> tuple[float, float]:
        path = os.path.join(base, f"dcp_async_{step}")
        dist.barrier()
        t0 = time.perf_counter()
        fut = dcp.async_save(state, checkpoint_id=path)
        t1 = time.perf_counter()
        fut.result()
        t2 = time.perf_counter()
        _rmtree(path)
        return t1 - t0, t2 - t0

    # Warm-up round (not in the medians, reported as "first").
    b, _ = ours_save(0)
    res["ours_first_block"].append(_max(b))
    b, _ = dcp_async(0)
    res["dcp_first_async_block"].append(_max(b))
    for rep in range(1, args.reps + 1):
        b, w = ours_save(rep)
        res["ours_block"].append(_max(b))
        res["ours_write"].append(_max(w))
        b, w = dcp_async(rep)
        res["dcp_async_block"].append(_max(b))
        res["dcp_async_total"].append(_max(w))
        path = os.path.join(base, f"dcp_sync_{rep}")
        dist.barrier()
        t0 = time.perf_counter()
        dcp.save(state, checkpoint_id=path)
        res["dcp_save"].append(_max(time.perf_counter() - t0))
        res["raw_stage"].append(_timed_max(raw.stage))
        res["raw_write"].append(_timed_max(raw.write))
        for p in (ours_root, path, raw.path):
            _evict(p)

        def ours_loads() -> None:
            stats = LoadStats()
            _timed(res, "ours_load", lambda s=stats: mgr.load(state, stats=s), stats)
            res["ours_load_warm"].append(_timed_max(lambda: mgr.load(state)))

        def dcp_loads(p: str = path) -> None:
            _timed(res, "dcp_load", lambda: dcp.load(state, checkpoint_id=p))
            res["dcp_load_warm"].append(_timed_max(lambda: dcp.load(state, checkpoint_id=p)))

        def raw_read() -> None:
            res["raw_read"].append(_timed_max(raw.read))

        # A cold read right after the writes may share the disk with their write-back (the
        # host's, which no fsync here waits for): the three take turns going first.
        for cold in _rotated((ours_loads, dcp_loads, raw_read), rep):
            cold()
        _evict(ours_root)
        res["ours_load_noverify"].append(_timed_max(lambda: mgr.load(state, verify=False)))
        if rep == args.reps:  # kept for the resharding loads
            dist.barrier()
            if rank == 0:
                os.replace(path, os.path.join(base, "dcp_keep"))
        _rmtree(path)
        dist.barrier()
        raw.remove()
    mgr.close()
    largest = max(t.numel() * t.element_size() for t in local_tensors(state))
    if rank == 0:
        out_q.put({"res": res, "bytes": nbytes, "largest": largest})
    dist.barrier()
    dist.destroy_process_group()


def reshard_worker(rank: int, world: int, port: int, args: argparse.Namespace, out_q) -> None:
    """Cold loads of the other world size's checkpoints, ours and DCP's, interleaved.

    ``world == 1``: load the ``--ranks``-rank checkpoints of the main run (N -> 1), then save
    this state for the next job. Otherwise: load those 1-rank checkpoints (1 -> N)."""
    mesh = _join(rank, world, port, args)
    import torch.distributed.checkpoint as dcp

    from torch_checkpointing import CheckpointManager, LoadStats

    state = build_state(args.gib, mesh, args.layout, args.shard_numel, ranks=args.ranks)
    src = "" if world == 1 else "_1"
    ours_root, dcp_path = (os.path.join(args.dir, n + src) for n in ("ours", "dcp_keep"))
    tag = f"rs_{args.ranks}to1" if world == 1 else f"rs_1to{world}"
    res: dict[str, list[float]] = {}
    extra = {} if args.io_threads is None else {"io_threads": args.io_threads}
    mgr = CheckpointManager(ours_root, read_only=True, **extra)
    # The resharding load's floor: the same bytes read with no library, laid out as the source
    # ranks wrote them (N -> 1: the N files in turn; 1 -> N: each rank its part of one file).
    tensors = local_tensors(state)
    nb = _nbytes(tensors)
    if world == 1:
        cuts = [i * nb // args.ranks for i in range(args.ranks + 1)]
        segs = [(os.path.join(args.dir, f"rs_raw_{i}.bin"), 0, cuts[i], cuts[i + 1])
                for i in range(args.ranks)]  # fmt: skip
    else:
        segs = [(os.path.join(args.dir, "rs_raw_shared.bin"), rank * nb, 0, nb)]
    raw = RawFloor(tensors, args.dir, rank, segs)
    raw.stage()
    raw.write()
    for rep in range(args.reps):
        dist.barrier()
        for p in (ours_root, dcp_path, *raw.paths):
            _evict(p)
        stats = LoadStats()
        runs = (
            lambda s=stats: _timed(res, f"{tag}_ours", lambda: mgr.load(state, stats=s), s),
            lambda: _timed(res, f"{tag}_dcp", lambda: dcp.load(state, checkpoint_id=dcp_path)),
            lambda: res.setdefault(f"{tag}_raw", []).append(_timed_max(raw.read)),
        )
        for run in _rotated(runs, rep):  # each goes first once every three reps
            run()
    dist.barrier()
    if rank == 0:
        raw.remove()
    mgr.close()
    if world == 1:
        with CheckpointManager(ours_root + "_1", async_mode="off") as m1:
            m1.save(1, state)
        dcp.save(state, checkpoint_id=dcp_path + "_1")
    if rank == 0:
        out_q.put(res)
    dist.barrier()
    dist.destroy_process_group()


def _spawn(ctx, target, world: int, args: argparse.Namespace):
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, args, q)) for r in range(world)]
    for p in procs:
        p.start()
    out = q.get()
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs):
        sys.exit(f"a rank failed: exit codes {[p.exitcode for p in procs]}")
    return out


def _mib(x: float) -> str:
    return "n/a" if x < 0 else f"{x / 2**20:.1f} MiB"


def _positive(kind):
    def parse(text: str):
        value = kind(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{text!r}: must be > 0")
        return value

    return parse


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--gib", type=_positive(float), default=1.0, help="state GiB per rank")
    ap.add_argument("--ranks", type=_positive(int), default=2)
    ap.add_argument(
        "--reps", type=_positive(int), default=3, help="3 or more for medians; 1: a smoke run"
    )
    ap.add_argument("--mode", default="process", choices=["process", "thread"])
    ap.add_argument("--dir", default=None, help="local-disk folder for the checkpoints")
    ap.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="where the state lives (cuda: staging is a device-to-host copy; gloo either way)",
    )
    ap.add_argument("--io-threads", type=_positive(int), help="our load threads per rank")
    ap.add_argument(
        "--layout",
        default="2d",
        choices=["2d", "1d"],
        help="2d: 24 (rows, 4096) matrices; 1d: 1-D tensors of --shard-numel local elements",
    )
    ap.add_argument("--shard-numel", type=_positive(int), default=16 << 20, help="1d: per shard")
    ap.add_argument(
        "--no-reshard",
        dest="reshard",
        action="store_false",
        help="skip the resharding loads (N -> 1 and 1 -> N ranks)",
    )
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device is visible")
    need = args.ranks * args.gib * 4.2 + 1
    avail = _meminfo_available_gib()
    if avail < need:
        sys.exit(
            f"need about {need:.1f} GiB of free memory, {avail:.1f} GiB available; lower --gib"
        )
    base = tempfile.mkdtemp(prefix="tcp_vs_dcp_", dir=args.dir)
    args.dir = base
    ctx = mp.get_context("spawn")
    try:
        out = _spawn(ctx, worker, args.ranks, args)
        if args.reshard and args.ranks > 1:
            out["res"].update(_spawn(ctx, reshard_worker, 1, args))
            out["res"].update(_spawn(ctx, reshard_worker, args.ranks, args))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    res = {k: statistics.median(v) for k, v in out["res"].items()}
    gib = out["bytes"] / 2**30
    shape = f"1-D shards of {args.shard_numel:,} elements" if args.layout == "1d" else "2-D"
    print(
        f"\n{args.ranks} ranks (gloo), {gib:.2f} GiB of model+optimizer state per rank ({shape}), "
        f"median of {args.reps} reps, our async_mode={args.mode!r}, state on {args.device}, "
        f"torch {torch.__version__}\n"
    )
    if args.reps < 3:
        print(f"--reps {args.reps}: a check that every path runs, not a measurement\n")
    rows = [
        ("trainer blocking, async save", "ours_block", "dcp.async_save", "dcp_async_block",
         0.2, "raw_stage"),
        ("total write (until durable)", "ours_write", "dcp.save", "dcp_save", 0.7, "raw_write"),
        ("load (in place, cold cache)", "ours_load", "dcp.load", "dcp_load", 0.5, "raw_read"),
        ("load, checks off (DCP has none)", "ours_load_noverify", "dcp.load", "dcp_load", 0.5,
         "raw_read"),
        ("load (in place, warm cache)", "ours_load_warm", "dcp.load", "dcp_load_warm", 0.5,
         None),
    ]  # fmt: skip
    n = args.ranks
    for tag, what in ((f"rs_{n}to1", f"{n} -> 1 ranks"), (f"rs_1to{n}", f"1 -> {n} ranks")):
        if f"{tag}_ours" in res:
            rows.append((f"load resharding {what} (cold)", f"{tag}_ours", "dcp.load",
                         f"{tag}_dcp", 0.8, f"{tag}_raw"))  # fmt: skip
    print(
        "| metric | torch_checkpointing | DCP | DCP call | ratio | goal | raw floor | floor / DCP |"
    )
    print("|---|---:|---:|---|---:|---:|---:|---:|")
    for name, ours, dname, theirs, goal, floor in rows:
        r = res[ours] / res[theirs]
        fl = f"{res[floor]:.3f} s | {res[floor] / res[theirs]:.2f}x" if floor else "- | -"
        print(
            f"| {name} | {res[ours]:.3f} s | {res[theirs]:.3f} s | `{dname}` | {r:.2f}x "
            f"| <= {goal}x | {fl} |"
        )
    print(
        f"\nblocking vs the raw copy floor: {res['ours_block']:.3f} s / {res['raw_stage']:.3f} s "
        f"= {res['ours_block'] / res['raw_stage']:.2f}x (goal <= 1.3x)"
    )
    print(
        f"first save (warm-up) blocking: ours {res['ours_first_block']:.3f} s, "
        f"dcp.async_save {res['dcp_first_async_block']:.3f} s; dcp.async_save until done: "
        f"{res['dcp_async_total']:.3f} s"
    )
    largest = out["largest"]
    print(
        "\nour cold load, where the time went (LoadStats, median of the max over ranks; I/O "
        "phases summed over I/O threads):"
    )
    for _, ours, _, _, _, _ in rows:
        if f"{ours}.total_s" not in res:
            continue
        parts = ", ".join(f"{k[:-2]} {res[f'{ours}.{k}']:.3f}" for k in _PHASES)
        print(
            f"  {ours}: total {res[f'{ours}.total_s']:.3f} s = {parts} s; "
            f"{_mib(res[f'{ours}.bytes_direct'])} straight into targets, "
            f"{_mib(res[f'{ours}.bytes_copied'])} copied"
        )
    print(
        f"\npeak extra memory during a load (RSS high-water above the RSS before it, reset "
        f"with /proc/self/clear_refs; max over ranks; median), largest local tensor "
        f"{_mib(largest)}:"
    )
    for _, ours, _, theirs, _, _ in rows:
        if f"{ours}_mem" not in res:
            continue
        mine, dcps = res[f"{ours}_mem"], res[f"{theirs}_mem"]
        ratio = "n/a" if mine < 0 else f"{mine / largest:.2f}x"
        print(
            f"  {ours}: ours {_mib(mine)} ({ratio} the largest tensor; loader buffers "
            f"{_mib(res[f'{ours}.staging_peak_bytes'])}), DCP {_mib(dcps)}"
        )
    print("raw (max over ranks, per rep):")
    for k, v in out["res"].items():
        if "." not in k:
            print(f"  {k}: {[round(x, 3) for x in v]}")


if __name__ == "__main__":
    main()
