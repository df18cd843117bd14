"""The ``context_parallel`` attention backend: one sequence split over the ranks of a group.

Layout (head-tail, "zig-zag"): a row of ``S`` tokens is cut into ``2·cp`` chunks of
``c = S / (2·cp)``; rank ``r`` holds chunks ``r`` and ``2·cp - 1 - r`` side by side (``S / cp``
tokens). Under a causal mask a rank's early chunk sees few keys and its late chunk many, so
every rank computes the same number of scores (exactly, for plain causal attention).

Everything except attention is per token, so a model runs on its shard unchanged; only
attention reads other ranks' keys and values (linear-attention layers pass their recurrent
state and conv inputs along the chunks instead: ``linear_attention.context_parallel``). Two algorithms:

- ``ring``: the ``K/V`` blocks travel round the ring (rank r sends to r + 1), the next block's
  transfer overlapping the current block's compute: memory O(S / cp). In backward the blocks
  travel again with their gradient accumulators, which arrive home after one more shift.
- ``allgather``: every rank gathers all ``K/V`` (its own block is computed while the gather
  runs) and reduce-scatters their gradients: O(S) keys and values per rank, fewer and larger
  messages: good for GQA models and moderate S.

Masks follow the global indices: query ``i`` sees key ``j`` iff ``start[i] <= j <= i`` and, in
a sliding-window layer, ``i - j < window``, where ``start[i]`` is where ``i``'s document
begins in the whole row (the shard's ``AttentionMetadata`` holds these for its queries:
``shard_metadata`` gathers the document ids once per batch). Which (query tile, key chunk)
pairs can see anything, and which need no mask, is decided on the host from the layout and
the window alone, so a step reads no device value.

Each (query tile, key tile) pair is one call of a tile kernel that returns the tile's output
and log-sum-exp (``context_parallel_tiles``: ``sdpa`` flash-attention ops, ``flex``
FlexAttention, or ``torch`` ops); the tiles are merged by their log-sum-exp (flash-attention
style: only ``q, k, v``, the output and its log-sum-exp are saved), and backward runs each
tile's backward from the final output and log-sum-exp. The fused kernels take whole chunks
(17 tiles per layer per rank at CP 8 under a causal mask); the ``torch`` kernel's tiles hold
at most ``ContextParallel.tile_scores`` scores. Under a sliding window the blocks still
travel round the whole ring; only the tiles the window cannot see are skipped. Sinks are a
key with no value in every row's softmax: folded into the merged log-sum-exp.

Model code holds no communication: the caller sets ``model.context_parallel`` to a
``ContextParallel`` over its group, and the backend runs three collectives on it
(``context_parallel_comm``).

Shapes: B batch, S local queries (``seq_len / cp``), H query heads, K kv heads, E q/k head
dim, V value dim; inside, rows are head-major (``(B, H, S, ·)``, views of the inputs).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from . import context_parallel_tiles as tiles
from .attention_metadata import AttentionMetadata, document_starts
from .context_parallel_comm import GroupComm
from .context_parallel_tiles import KERNELS, Tile

ALGORITHMS = ("ring", "allgather")
"""The context-parallel attention algorithms (``ContextParallel.algorithm``)."""


@dataclass(slots=True)
class TileStats:
    """Tiles the context-parallel attention has run (counted on the host from its plans)."""

    calls: int = 0
    """Attention calls (forward; a rematerialised forward counts again)."""
    tiles: int = 0
    """Tiles over all those calls."""
    most: int = 0
    """Most tiles in one call: one layer's forward on this rank."""

    def record(self, tiles: int) -> None:
        """Count one attention call of ``tiles`` tiles."""
        self.calls += 1
        self.tiles += tiles
        self.most = max(self.most, tiles)


@dataclass(frozen=True, slots=True)
class ContextParallel:
    """How a model runs on one shard of its sequences: set ``model.context_parallel`` to one
    of these and feed the model ``shard(...)`` of its tokens, positions and document ids."""

    group: Any = None
    """The ``torch.distributed`` process group the sequences are split over (the ``cp`` axis
    of a device mesh: ``mesh["cp"].get_group()``); ``None``: the default group."""
    algorithm: Literal["ring", "allgather"] = "ring"
    """``ring`` (memory O(S/cp), K/V passed round the ring) or ``allgather`` (see the module
    docstring)."""
    tile_kernel: Literal["torch", "flex", "sdpa"] = "sdpa"
    """What computes a tile: ``sdpa`` (flash-attention ops returning the log-sum-exp; fused
    on every device without a compile), ``flex`` (FlexAttention with a block mask per tile;
    compiled on accelerators) or ``torch`` (plain ops, the reference): see
    ``context_parallel_tiles``."""
    tile_size: int = 0
    """Queries (and keys) per tile; 0 picks it from the shard (``context_parallel_tiles.
    tile_size``: a whole chunk for the fused kernels, ``tile_scores`` for ``torch``)."""
    tile_scores: int = 1 << 22
    """Most score elements (batch x heads x queries x keys) one ``torch`` tile computes at a
    time (square tiles; 2^22: 16 MiB of fp32 scores)."""
    comm: GroupComm = field(init=False, repr=False, compare=False)
    """The group's collectives (built from ``group``)."""
    stats: TileStats = field(init=False, repr=False, compare=False)
    """Tiles run per attention call (host counters: no sync)."""

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise ValueError(
                f"ContextParallel.algorithm={self.algorithm!r} must be one of {list(ALGORITHMS)}"
            )
        if not isinstance(self.tile_scores, int) or self.tile_scores < 1:
            raise ValueError(
                f"ContextParallel.tile_scores={self.tile_scores!r} must be an int >= 1"
            )
        if self.tile_kernel not in KERNELS:
            raise ValueError(
                f"ContextParallel.tile_kernel={self.tile_kernel!r} must be one of {list(KERNELS)}"
            )
        if not isinstance(self.tile_size, int) or self.tile_size < 0:
            raise ValueError(
                f"ContextParallel.tile_size={self.tile_size!r} must be an int >= 0 (0: picked)"
            )
        object.__setattr__(self, "comm", GroupComm(self.group))
        object.__setattr__(self, "stats", TileStats())

    @property
    def rank(self) -> int:
        """This rank's index in the context-parallel group."""
        return self.comm.rank

    @property
    def size(self) -> int:
        """The context-parallel degree."""
        return self.comm.size

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's tokens of full sequences along ``dim`` (see ``zigzag_shard``)."""
        return zigzag_shard(x, self.rank, self.size, dim)

    def token_index(self, local_len: int, device: torch.device | str) -> torch.Tensor:
        """``(local_len,)`` index in the whole sequence of each of this rank's tokens."""
        c = local_len // 2
        first = chunk_start(self.rank, 0, self.size, c)
        second = chunk_start(self.rank, 1, self.size, c)
        return torch.cat(
            [
                torch.arange(first, first + c, device=device),
                torch.arange(second, second + c, device=device),
            ]
        )


@dataclass(frozen=True, slots=True)
class ContextParallelShard:
    """What the ``AttentionMetadata`` of one shard adds: the group, and where each query's
    document begins in the whole row."""

    cp: ContextParallel
    starts: torch.Tensor | None
    """``(B, S)`` global index where each local query's document begins; ``None`` when every
    row is one document."""


def zigzag_shard(x: torch.Tensor, rank: int, size: int, dim: int = 1) -> torch.Tensor:
    """Chunks ``rank`` and ``2·size - 1 - rank`` of ``x`` cut into ``2·size`` along ``dim``."""
    length = x.shape[dim]
    if length % (2 * size):
        raise ValueError(
            f"context parallelism over {size} ranks splits a sequence into {2 * size} equal "
            f"chunks: its length {length} must be divisible by {2 * size}"
        )
    chunks = x.chunk(2 * size, dim)
    return torch.cat([chunks[rank], chunks[2 * size - 1 - rank]], dim)


def zigzag_unshard(shards: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """The full sequences from every rank's shard stacked on a new leading dimension
    (``(size, ...)``, as ``all_gather`` returns them); ``dim`` is the sequence dimension of
    one shard."""
    size = shards.shape[0]
    halves = [shards[rank].chunk(2, dim) for rank in range(size)]
    # rank r's halves are chunks r and 2 * size - 1 - r
    return torch.cat([h[0] for h in halves] + [h[1] for h in reversed(halves)], dim)


def shard_metadata(
    cp: ContextParallel,
    batch_size: int,
    seq_len: int,
    device: torch.device | str,
    *,
    positions: torch.Tensor | None,
    document_ids: torch.Tensor | None,
) -> AttentionMetadata:
    """The ``AttentionMetadata`` of one shard of ``seq_len`` local tokens per row: documents
    and positions in global terms (one all-gather of the document ids; no host sync)."""
    if seq_len % 2:
        raise ValueError(
            f"a context-parallel shard holds two equal chunks: its length {seq_len} must be even"
        )
    index = cp.token_index(seq_len, device)
    starts = None
    if document_ids is not None:
        if tuple(document_ids.shape) != (batch_size, seq_len):
            raise ValueError(
                f"document_ids must have shape {(batch_size, seq_len)}, "
                f"got {tuple(document_ids.shape)}"
            )
        full = zigzag_unshard(cp.comm.all_gather(document_ids.contiguous()).wait(), dim=1)
        starts = cp.shard(document_starts(full), dim=1)
    if positions is None:
        positions = index - starts if starts is not None else index.expand(batch_size, -1)
    elif tuple(positions.shape) != (batch_size, seq_len):
        raise ValueError(
            f"positions must have shape {(batch_size, seq_len)}, got {tuple(positions.shape)}"
        )
    cu = torch.arange(batch_size + 1, device=device, dtype=torch.int32) * seq_len
    return AttentionMetadata(
        batch_size=batch_size,
        seq_len=seq_len,
        positions=positions,
        starts=None,
        boundaries=cu,
        backend="context_parallel",
        context_parallel=ContextParallelShard(cp=cp, starts=starts),
    )


# --- the plan: which tiles meet which key chunks ---------------------------------------------


def chunk_start(rank: int, half: int, size: int, c: int) -> int:
    """Global index of the first token of ``rank``'s first (``half=0``) or second chunk."""
    return (rank if half == 0 else 2 * size - 1 - rank) * c


def _plan(
    rank: int, size: int, local_len: int, window: int | None, documents: bool, tile: int
) -> list[list[Tile]]:
    """Per ring step ``s`` (the block of rank ``(rank - s) % size``), the tiles to compute:
    every ``tile``-query tile of this rank against ``tile``-key tiles of the part of each key
    chunk it can see (keys after the tile's last query, or a window behind its first, are
    cut off)."""
    c = local_len // 2
    steps = []
    for s in range(size):
        j = (rank - s) % size
        items = []
        for hq in (0, 1):
            gq = chunk_start(rank, hq, size, c)
            for t0 in range(0, c, tile):
                t1 = min(c, t0 + tile)
                i0, i1 = gq + t0, gq + t1 - 1
                for hk in (0, 1):
                    gk = chunk_start(j, hk, size, c)
                    lo, hi = gk, min(gk + c - 1, i1)
                    if window is not None:
                        lo = max(lo, i0 - window + 1)
                    for a in range(lo, hi + 1, tile):
                        b = min(hi, a + tile - 1)
                        cut = window is not None and i1 - a >= window
                        items.append(
                            Tile(
                                q0=hq * c + t0,
                                q1=hq * c + t1,
                                qg0=i0,
                                k0=hk * c + a - gk,
                                k1=hk * c + b - gk + 1,
                                kg0=a,
                                masked=documents or b > i0 or cut,
                                causal=not documents and not cut and a == i0 and b == i1,
                            )
                        )
        steps.append(items)
    return steps


def tile_count(
    rank: int, size: int, local_len: int, window: int | None, documents: bool, tile: int
) -> int:
    """Tiles one rank computes in one attention call (forward) of a layer: the length of the
    plan the backend executes."""
    return sum(len(step) for step in _plan(rank, size, local_len, window, documents, tile))


# --- the blocks of every rank, by ring or by gather --------------------------------------------


def _blocks(cp: ContextParallel, kv: torch.Tensor):
    """``(step, block)`` for every rank's packed ``[k, v]`` block, own block first; the next
    block's transfer is in flight while the caller computes on the current one."""
    comm, size = cp.comm, cp.size
    if cp.algorithm == "allgather":
        handle = comm.all_gather(kv) if size > 1 else None
        yield 0, kv
        if handle is not None:
            gathered = handle.wait()
            for s in range(1, size):
                yield s, gathered[(cp.rank - s) % size]
        return
    for s in range(size):
        handle = comm.ring_shift(kv) if s < size - 1 else None
        yield s, kv
        if handle is not None:
            kv = handle.wait()


def _merge(o, lse, rows, o_tile, lse_tile) -> None:
    """Fold a tile's normalised output and log-sum-exp into the rows' running ones."""
    lse_old = lse[:, :, rows]
    lse_new = torch.logaddexp(lse_old, lse_tile)
    ref = tiles.finite(lse_new)
    o[:, :, rows] = (
        o[:, :, rows] * torch.exp(lse_old - ref)[..., None]
        + o_tile * torch.exp(lse_tile - ref)[..., None]
    )
    lse[:, :, rows] = lse_new


def _tile_backward(q, block, tile, opt, out, do, lse, delta, dq, dkv) -> None:
    """One tile's gradients added to ``dq`` and to its block's packed ``dkv``."""
    E = q.shape[-1]
    rows, cols = slice(tile.q0, tile.q1), slice(tile.k0, tile.k1)
    dq_t, dk_t, dv_t = tiles.backward(
        q[:, :, rows], block[:, :, cols, :E], block[:, :, cols, E:], out[:, :, rows],
        lse[:, :, rows], do[:, :, rows], None if delta is None else delta[:, :, rows], tile, opt,
    )  # fmt: skip
    dq[:, :, rows] += dq_t
    dkv[:, :, cols, :E] += dk_t
    dkv[:, :, cols, E:] += dv_t


class _Attention(torch.autograd.Function):
    """Context-parallel attention of this rank's queries ``(B, H, S, E)`` over every rank's
    keys, sinks folded in: the output ``(B, H, S, V)`` (a view of a ``(B, S, H, V)`` tensor);
    saves only its inputs, the output and the log-sum-exp."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, shard, plan, opt):
        B, H, S, _ = q.shape
        E, V = k.shape[-1], v.shape[-1]
        kv = torch.cat([k, v], dim=-1)
        o = torch.zeros(B, S, H, V, dtype=opt.acc, device=q.device).transpose(1, 2)
        lse = torch.full((B, H, S), float("-inf"), dtype=opt.acc, device=q.device)
        for step, block in _blocks(shard.cp, kv):
            for tile in plan[step]:
                rows = slice(tile.q0, tile.q1)
                o_t, lse_t = tiles.forward(
                    q[:, :, rows], block[:, :, tile.k0 : tile.k1, :E],
                    block[:, :, tile.k0 : tile.k1, E:], tile, opt,
                )  # fmt: skip
                _merge(o, lse, rows, o_t, lse_t)
        if sinks is not None:
            # A sink adds exp(sink) to each softmax's denominator: a key with no value.
            lse_sunk = torch.logaddexp(lse, sinks.to(opt.acc)[None, :, None])
            o = o * torch.exp(lse - lse_sunk)[..., None]
            lse = lse_sunk
        out = o.to(q.dtype)
        ctx.save_for_backward(q, k, v, sinks, out, lse)
        ctx.shard, ctx.plan, ctx.opt = shard, plan, opt
        return out

    @staticmethod
    def backward(ctx, do):  # pyrefly: ignore[bad-override]  # torch: one arg per output
        q, k, v, sinks, out, lse = ctx.saved_tensors
        cp, plan, opt = ctx.shard.cp, ctx.plan, ctx.opt
        lse = tiles.finite(lse)
        delta = None
        if opt.kernel == "torch" or sinks is not None:
            delta = (do.to(opt.acc) * out.to(opt.acc)).sum(-1)
        dq = torch.zeros(q.shape, dtype=opt.acc, device=q.device)
        kv = torch.cat([k, v], dim=-1)
        if cp.algorithm == "allgather":
            dkv = _backward_allgather(cp, plan, opt, q, kv, out, do, lse, delta, dq)
        else:
            dkv = _backward_ring(cp, plan, opt, q, kv, out, do, lse, delta, dq)
        dsinks = None
        if sinks is not None:  # the sink's share of each softmax is exp(sink - lse)
            assert delta is not None
            share = torch.exp(sinks.to(opt.acc)[None, :, None] - lse)
            dsinks = -(share * delta).sum((0, 2)).to(sinks.dtype)
        E = k.shape[-1]
        return (
            dq.to(q.dtype),
            dkv[..., :E].to(k.dtype),
            dkv[..., E:].to(v.dtype),
            dsinks,
            None,
            None,
            None,
        )


def _backward_ring(cp, plan, opt, q, kv, out, do, lse, delta, dq) -> torch.Tensor:
    """Blocks go round again; each block's gradient travels with it, gathering every rank's
    share, and reaches its owner one shift after the last step."""
    comm, size = cp.comm, cp.size
    pending = None
    for s in range(size):
        handle = comm.ring_shift(kv) if s < size - 1 else None
        dkv = torch.zeros(kv.shape, dtype=opt.acc, device=kv.device)
        for tile in plan[s]:
            _tile_backward(q, kv, tile, opt, out, do, lse, delta, dq, dkv)
        if pending is not None:
            dkv += pending.wait()  # the shares of the ranks before this one
        if size == 1:
            return dkv
        pending = comm.ring_shift(dkv)
        if handle is not None:
            kv = handle.wait()
    assert pending is not None  # size > 1 here
    return pending.wait()


def _backward_allgather(cp, plan, opt, q, kv, out, do, lse, delta, dq) -> torch.Tensor:
    """Gradients of every rank's block, summed on their owners by one reduce-scatter."""
    dkv = torch.zeros((cp.size, *kv.shape), dtype=opt.acc, device=kv.device)
    for s, block in _blocks(cp, kv):
        for tile in plan[s]:
            owner = dkv[(cp.rank - s) % cp.size]
            _tile_backward(q, block, tile, opt, out, do, lse, delta, dq, owner)
    return cp.comm.reduce_scatter(dkv).wait() if cp.size > 1 else dkv[0]


# --- the backend -------------------------------------------------------------------------------


def prepare(meta: AttentionMetadata, window: int | None) -> None:
    """Nothing ahead of the forward: the tile plan depends on the layer's head count."""
    return None


@torch.compiler.disable
def forward(
    q_BSHE: torch.Tensor,
    k_BSKE: torch.Tensor,
    v_BSKV: torch.Tensor,
    meta: AttentionMetadata,
    prepared: None,
    *,
    window: int | None,
    sinks: torch.Tensor | None,
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    """The ``context_parallel`` backend's forward (see the module docstring)."""
    shard = meta.context_parallel
    if shard is None:
        raise ValueError(
            "attention backend 'context_parallel' runs on a context-parallel shard: set the "
            "model's context_parallel (a titan_models.ContextParallel) and feed it its shard"
        )
    B, S, H, _ = q_BSHE.shape
    K = k_BSKE.shape[2]
    if k_BSKE.shape[1] != S:
        raise ValueError(
            f"attention backend 'context_parallel' attends a shard to the whole sequence: got "
            f"{S} queries and {k_BSKE.shape[1]} keys per row"
        )
    cp = shard.cp
    kernel = tiles.resolve_kernel(cp.tile_kernel, q_BSHE.device.type, softcap)
    tile = cp.tile_size or tiles.tile_size(kernel, S, B, H, window, cp.tile_scores)
    documents = shard.starts is not None
    plan = meta.prepared(
        ("context_parallel-plan", window, tile),
        lambda: _plan(cp.rank, cp.size, S, window, documents, tile),
    )
    cp.stats.record(sum(len(step) for step in plan))
    block_masks = None
    if kernel == "flex":
        block_masks = meta.prepared(
            ("context_parallel-flex", window, tile),
            lambda: tiles.flex_block_masks(plan, window, shard.starts, q_BSHE.device),
        )
    opt = tiles.TileOptions(
        kernel=kernel,
        groups=H // K,
        scale=scale,
        softcap=softcap,
        window=window,
        starts=shard.starts,
        acc=torch.promote_types(q_BSHE.dtype, torch.float32),
        block_masks=block_masks,
    )
    o_BHSV = _Attention.apply(
        q_BSHE.transpose(1, 2),
        k_BSKE.transpose(1, 2),
        v_BSKV.transpose(1, 2),
        sinks,
        shard,
        plan,
        opt,
    )
    return o_BHSV.transpose(1, 2)
