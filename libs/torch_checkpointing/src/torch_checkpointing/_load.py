"""Loading one complete checkpoint folder into a state, in place.

The manifest and every rank's done-marker give each stored chunk's global box and byte range.
Target entries are checked first (missing / unexpected / mismatched, all listed, nothing
touched), file sizes next; then every target box is filled from the overlapping stored boxes
(``_reshard``), reading only the checksum blocks that hold them.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from . import _format as fmt
from . import _reshard as rs
from . import _tree as tr
from ._errors import CheckpointError, CorruptCheckpointError, StateMismatchError
from ._exchange import LayoutCache, allgather_int64
from ._retention import Attempt
from ._stats import LoadStats
from ._validate import check_marker

if TYPE_CHECKING:  # pragma: no cover
    from .storage import Storage


def load_folder(
    storage: Storage,
    state: dict[str, Any],
    folder: str,
    manifest: dict[str, Any],
    *,
    rank: int,
    world_size: int,
    strict: bool,
    verify: bool,
    io_threads: int,
    layout: LayoutCache,
    stats: LoadStats | None = None,
) -> int:
    """Fill ``state`` from the checkpoint in ``folder``; returns its step.

    Tensor bytes land in the targets before their checksums are checked (``_stream``); a
    mismatch then raises ``CorruptCheckpointError`` saying the state was partly overwritten,
    before any non-tensor state is applied.
    """
    stats = stats if stats is not None else LoadStats()
    stats.add(attempts=1)
    t_start = time.perf_counter()
    world = manifest["world_size"]
    markers = [_read_marker(storage, folder, manifest, r) for r in range(world)]
    items_m = manifest["items"]
    missing_items = [item for item in state if item not in items_m]
    if missing_items:
        raise StateMismatchError(
            f"load: items {missing_items} are not in the checkpoint at {folder} (it has "
            f"{sorted(items_m)})",
            missing_items,
            [],
            [],
        )
    per_rank_items = [i for i in state if items_m[i]["per_rank"]]
    if per_rank_items and world != world_size:
        raise CheckpointError(
            f"load: PerRank items {per_rank_items} were saved by {world} ranks and cannot "
            f"be loaded by {world_size}; leave them out of the state to load the rest"
        )
    # Stored chunks by (item, key) and file table.
    stored: dict[tuple[str, str], list[rs.StoredChunk]] = {}
    files: dict[str, rs.FileInfo] = {}
    tree_files: dict[str, tuple[str, int]] = {}
    chunk_lists: dict[str, list[list[Any]]] = {}
    data_starts: dict[str, int] = {}
    for r, m in enumerate(markers):
        for name, info in m.items():
            path = f"{folder}/{name}"
            files[path] = rs.FileInfo(path, info["size"], info["block_size"], info["block_xxh3_64"])
            chunk_lists[path] = [c[:4] for c in info["chunks"]]
            data_starts[path] = info["data_start"]
            item = info["item"]
            per_rank = items_m.get(item, {}).get("per_rank")
            if info["tree"] and ((per_rank and r == rank) or (not per_rank and r == 0)):
                tree_files[item] = (path, info["data_start"])
            if per_rank and r != rank:
                continue
            start0 = info["data_start"]
            for key, offs, shape, dtype, rel, _end in info["chunks"]:
                stored.setdefault((item, key), []).append(
                    rs.StoredChunk(path, tuple(offs), tuple(shape), dtype, start0 + rel)
                )
    # Optimizers restored into a fresh optimizer need their lazily created state first.
    for item, value in state.items():
        target = value.value if isinstance(value, tr.PerRank) else value
        if _is_empty_optimizer(target) and any(
            k.startswith("state.") for k, _ in _stored_keys(item, items_m, stored)
        ):
            _init_optimizer_state(target)
    with torch.no_grad():
        flats = {
            item: tr.flatten(item, _as_target(value, items_m[item]["per_rank"]), record_sds=True)
            for item, value in state.items()
        }
        _check_coverage(flats, items_m, stored)
        _check_entries(flats, items_m, stored, folder, strict)
        # Check sizes of every file we will read before touching the target.
        plan = rs.ReadPlan()
        for item, flat in flats.items():
            for key, leaf in flat.leaves.items():
                if (item, key) in stored:
                    targets = layout.local_chunks(leaf)
                    rs.plan_leaf(plan, item, leaf, stored[(item, key)], targets)
        t_open = time.perf_counter()
        stats.add(metadata_s=t_open - t_start)
        for path in sorted(plan.paths() | {p for p, _ in tree_files.values()}):
            try:
                size = storage.size(path)
            except FileNotFoundError as e:
                raise CorruptCheckpointError(
                    f"{path}: file of a complete checkpoint is missing", path
                ) from e
            if size != files[path].size:
                raise CorruptCheckpointError(
                    f"{path}: file is {size} bytes, its done-marker says {files[path].size}; "
                    "it is truncated or was replaced",
                    path,
                )
        t_tree = time.perf_counter()
        stats.add(open_s=t_tree - t_open)
        for item in flats:
            if item not in tree_files:
                raise CorruptCheckpointError(
                    f"{folder}: no file holds the non-tensor state of item {item!r}"
                )
        tree_paths = {p: item for item, (p, _) in tree_files.items() if item in flats}
        trees = {}
        for path in sorted(plan.paths() | set(tree_paths)):
            meta = _read_header(
                storage, path, files[path], data_starts[path], chunk_lists[path], stats
            )
            if path in tree_paths:
                trees[tree_paths[path]] = meta["tree"]
        stats.add(deserialize_s=time.perf_counter() - t_tree)
        if not verify:
            files = {p: rs.FileInfo(p, f.size, None, None) for p, f in files.items()}
        try:
            rs.execute(storage, plan, files, threads=io_threads, stats=stats)
        except CorruptCheckpointError as e:
            e.args = (
                f"{e.args[0]}; the tensors of the state were partly overwritten by this load: "
                "do not use them (load(..., fallback=True) loads an older checkpoint over them)",
                *e.args[1:],
            )
            raise
        t_fill = time.perf_counter()
        for item, flat in flats.items():
            value = state[item]
            if isinstance(value, tr.PerRank):
                value.value = tr.fill(value.value, trees[item], flat)
            else:
                state[item] = tr.fill(value, trees[item], flat)
        stats.add(deserialize_s=time.perf_counter() - t_fill)
    return int(manifest["step"])


def load_first_intact(
    pg: Any, candidates: list[Attempt], load_one: Callable[[Attempt], None]
) -> tuple[Attempt | None, list[tuple[Attempt, str]]]:
    """Try ``candidates`` (newest first) until every rank has loaded one without finding damage.

    Returns the attempt loaded (``None`` when every one is damaged) and those skipped, with
    why. With a group, one small allgather per try keeps the ranks on the same step: a
    checkpoint damaged in a file only some ranks read is skipped by all of them, and an error
    that is not damage (a mismatched state, ...) is raised on every rank.
    """
    newest = candidates[0].step if candidates else -1
    if pg is not None:
        rows = allgather_int64(pg, [len(candidates), newest])
        if any(r != rows[0] for r in rows):
            raise CheckpointError(
                f"load: the ranks list different checkpoints (count, newest step per rank: "
                f"{rows}); is the root on a filesystem every rank sees alike?"
            )
    skipped: list[tuple[Attempt, str]] = []
    for a in candidates:
        error: BaseException | None = None
        code = 0
        try:
            load_one(a)
        except CorruptCheckpointError as e:
            error, code = e, 1
        except Exception as e:
            error, code = e, 2
        rows = [[code, a.step]] if pg is None else allgather_int64(pg, [code, a.step])
        if any(r[1] != a.step for r in rows):
            raise CheckpointError(f"load: the ranks tried different steps (code, step): {rows}")
        worst = max(r[0] for r in rows)
        if worst == 2:
            if error is not None and code == 2:
                raise error
            failed = [i for i, r in enumerate(rows) if r[0] == 2]
            raise CheckpointError(
                f"load: ranks {failed} failed loading {a.name} (step {a.step}); see their error"
            )
        if worst == 0:
            return a, skipped
        if error is None:
            bad = [i for i, r in enumerate(rows) if r[0] == 1]
            skipped.append((a, f"ranks {bad} found it damaged"))
        else:
            skipped.append((a, str(error)))
    return None, skipped


def _check_coverage(
    flats: dict[str, tr.Flat],
    items_m: dict[str, Any],
    stored: dict[tuple[str, str], list[rs.StoredChunk]],
) -> None:
    """Every replicated entry to load is stored whole: its chunks hold as many elements as its
    global shape (fewer: saved incompletely, or a marker is forged; more: forged)."""
    for item, flat in flats.items():
        entries = items_m[item]["entries"]
        for key in flat.leaves:
            if key not in entries:
                continue
            shape = entries[key][2]
            have = sum(math.prod(c.shape) for c in stored.get((item, key), ()))
            if have != math.prod(shape):
                raise CorruptCheckpointError(
                    f"{tr.display(item, key)}: the checkpoint's chunks cover {have} of the "
                    f"{math.prod(shape)} elements of its shape {shape}; it was saved "
                    "incompletely (a sharded tensor whose chunks did not tile it) or its "
                    "metadata is forged"
                )


def _check_entries(
    flats: dict[str, tr.Flat],
    items_m: dict[str, Any],
    stored: dict[tuple[str, str], list[rs.StoredChunk]],
    folder: str,
    strict: bool,
) -> None:
    """Raise a ``StateMismatchError`` listing every difference between target and checkpoint."""
    missing, unexpected, mismatched = [], [], []
    for item, flat in flats.items():
        have = dict(_stored_keys(item, items_m, stored))
        for key, leaf in flat.leaves.items():
            name = tr.display(item, key)
            if key not in have:
                missing.append(name)
                continue
            dtype, shape = have[key]
            if dtype != leaf.dtype or tuple(shape) != leaf.shape:
                mismatched.append(
                    (name, f"{leaf.dtype}{list(leaf.shape)}", f"{dtype}{list(shape)}")
                )
        unexpected.extend(tr.display(item, k) for k in have if k not in flat.leaves)
    if mismatched or (strict and (missing or unexpected)):
        raise StateMismatchError.listing(
            f"the checkpoint at {folder}", missing, unexpected, mismatched
        )


def _read_marker(
    storage: Storage, folder: str, manifest: dict[str, Any], rank: int
) -> dict[str, dict[str, Any]]:
    """Rank ``rank``'s done-marker, read within its size cap and range-checked: its files."""
    path = f"{folder}/{fmt.marker_file(rank)}"
    limit = fmt.MARKER_BASE_MAX_BYTES
    try:
        if storage.size(path) > limit:  # a rank with much data: its own files size the cap
            suffix = f"-{rank:05d}.safetensors"
            names = [n for n in storage.list(folder) if n.endswith(suffix)]
            data = sum(storage.size(f"{folder}/{n}") for n in names)
            limit = fmt.marker_max_bytes(len(json.dumps(manifest["items"])), data)
    except FileNotFoundError:
        raise
    except OSError as e:  # a symlink loop, ...: damage
        raise CorruptCheckpointError(f"{path}: unreadable ({e})", path) from e
    marker = fmt.load_checked(fmt.read_small(storage, path, limit), path)
    return check_marker(marker, manifest, rank, path)


def _read_header(
    storage: Storage,
    path: str,
    info: rs.FileInfo,
    data_start: int,
    chunks: list[list[Any]],
    stats: LoadStats,
) -> dict[str, Any]:
    """The ``torch_checkpointing`` metadata of a data file's safetensors header (verified by its
    block checksums), which must list the chunks its done-marker lists, in the same order."""
    buf = bytearray(data_start)
    scratch = -(-data_start // info.block_size) * info.block_size if info.block_size else 0
    stats.buffer(data_start + scratch)  # the header and read_verified's block scratch
    stats.buffer(-(data_start + scratch))
    fmt.read_verified(
        storage,
        path,
        [fmt.ReadRequest(0, data_start, memoryview(buf))],
        size=info.size,
        block_size=info.block_size,
        crcs=info.crcs,
    )
    try:
        if int.from_bytes(buf[:8], "little") + 8 != data_start:
            raise ValueError(f"its header ends at {int.from_bytes(buf[:8], 'little') + 8}")
        head = json.loads(bytes(buf[8:]))
        meta = json.loads(head["__metadata__"][fmt.META_KEY])
        if meta["chunks"] != chunks:
            raise ValueError("it lists other chunks than its done-marker")
        if not isinstance(meta, dict) or "tree" not in meta:
            raise ValueError("no tree in its metadata")
    except Exception as e:  # RecursionError, ... : damage, whatever the bytes are
        raise CorruptCheckpointError(
            f"{path}: unreadable header or not the file its done-marker describes "
            f"({type(e).__name__}: {str(e)[:200]})",
            path,
        ) from None
    return meta


def _stored_keys(
    item: str, items_m: dict[str, Any], stored: dict[tuple[str, str], list[rs.StoredChunk]]
) -> list[tuple[str, tuple[str, tuple[int, ...]]]]:
    if items_m[item]["per_rank"]:
        out = {}
        for (it, key), chunks in stored.items():
            if it == item:
                out[key] = (chunks[0].dtype, chunks[0].shape)
        return list(out.items())
    return [(k, (e[1], tuple(e[2]))) for k, e in items_m[item]["entries"].items()]


def _as_target(value: Any, per_rank: bool) -> Any:
    if per_rank and not isinstance(value, tr.PerRank):
        return tr.PerRank(value)
    if not per_rank and isinstance(value, tr.PerRank):
        return value.value
    return value


def _is_empty_optimizer(obj: Any) -> bool:
    return isinstance(obj, torch.optim.Optimizer) and not obj.state


def _init_optimizer_state(opt: torch.optim.Optimizer) -> None:
    """Create a fresh optimizer's lazy state (one step with zero gradients and lr 0), so a
    checkpoint's state has tensors to load into. Parameters are unchanged."""
    grads = []
    for group in opt.param_groups:
        for p in group["params"]:
            if p.requires_grad:
                grads.append((p, p.grad))
                p.grad = torch.zeros_like(p)
    lrs = []
    for group in opt.param_groups:
        lrs.append(group.get("lr"))
        if "lr" in group:
            group["lr"] = torch.tensor(0.0) if isinstance(group["lr"], torch.Tensor) else 0.0
    opt.step()
    for group, lr in zip(opt.param_groups, lrs, strict=True):
        if lr is not None:
            group["lr"] = lr
    for p, g in grads:
        p.grad = g
