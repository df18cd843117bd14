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
the window alone, so a step reads no device value. Scores are computed in tiles of at most
``ContextParallel.tile_scores`` elements with an online softmax (flash-attention style: only
``q, k, v``, the output and its log-sum-exp are saved; backward recomputes the tiles).

The tiles run as plain torch ops on any device (a fused kernel per block that returns its
log-sum-exp, such as flash attention, is where ``_tile_forward`` / ``_tile_backward`` would
plug in). Under a sliding window the blocks still travel round the whole ring; only the tiles
the window cannot see are skipped.

Model code holds no communication: the caller sets ``model.context_parallel`` to a
``ContextParallel`` over its group, and the backend runs three collectives on it
(``context_parallel_comm``).

Shapes: B batch, S local queries (``seq_len / cp``), H query heads, K kv heads, G = H / K,
M = S·G query rows (position-major: row ``s·G + g``), E q/k head dim, V value dim, L keys of
a tile, Tq queries of a tile.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from .attention_metadata import AttentionMetadata, document_starts
from .context_parallel_comm import GroupComm

ALGORITHMS = ("ring", "allgather")
"""The context-parallel attention algorithms (``ContextParallel.algorithm``)."""


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
    tile_scores: int = 1 << 22
    """Most score elements (batch x heads x queries x keys) one tile computes at a time
    (square tiles; 2^22: 16 MiB of fp32 scores)."""
    comm: GroupComm = field(init=False, repr=False, compare=False)
    """The group's collectives (built from ``group``)."""

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise ValueError(
                f"ContextParallel.algorithm={self.algorithm!r} must be one of {list(ALGORITHMS)}"
            )
        if not isinstance(self.tile_scores, int) or self.tile_scores < 1:
            raise ValueError(
                f"ContextParallel.tile_scores={self.tile_scores!r} must be an int >= 1"
            )
        object.__setattr__(self, "comm", GroupComm(self.group))

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


@dataclass(frozen=True, slots=True)
class _Item:
    """One tile: local queries ``[q0, q1)`` against keys ``[k0, k1)`` of a rank's block
    (each range inside one chunk, so its global indices are contiguous)."""

    q0: int
    q1: int
    qg0: int
    """Global index of query ``q0`` (a tile lies inside one chunk: indices are contiguous)."""
    k0: int
    k1: int
    kg0: int
    """Global index of key ``k0``."""
    masked: bool
    """Some (query, key) pair of the tile is hidden: build its mask."""


def _plan(
    rank: int, size: int, local_len: int, window: int | None, documents: bool, tile: int
) -> list[list[_Item]]:
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
                        masked = documents or b > i0 or (window is not None and i1 - a >= window)
                        items.append(
                            _Item(
                                q0=hq * c + t0,
                                q1=hq * c + t1,
                                qg0=i0,
                                k0=hk * c + a - gk,
                                k1=hk * c + b - gk + 1,
                                kg0=a,
                                masked=masked,
                            )
                        )
        steps.append(items)
    return steps


# --- tiles -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Options:
    groups: int
    """G: query heads per kv head."""
    key_dim: int
    """E: where values start in a packed ``[k, v]`` block."""
    scale: float
    softcap: float | None
    window: int | None
    starts: torch.Tensor | None
    acc: torch.dtype
    """Scores, softmax and accumulators: fp32, or the inputs' dtype when wider."""


def _scores(
    q_BKTE: torch.Tensor, k_BKLE: torch.Tensor, item: _Item, opt: _Options
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scores ``(B, K, Tq·G, L)`` (in ``opt.acc``) of a tile with its mask applied (-inf), and the tanh
    of the soft cap (for its gradient)."""
    s = (q_BKTE @ k_BKLE.transpose(-1, -2)).to(opt.acc) * opt.scale
    tanh = None
    if opt.softcap is not None:
        tanh = torch.tanh(s / opt.softcap)
        s = opt.softcap * tanh
    if item.masked:
        device = s.device
        qi = torch.arange(item.qg0, item.qg0 + item.q1 - item.q0, device=device)[:, None]
        kj = torch.arange(item.kg0, item.kg0 + item.k1 - item.k0, device=device)[None, :]
        visible_TL = kj <= qi
        if opt.window is not None:
            visible_TL = visible_TL & (qi - kj < opt.window)
        visible = visible_TL[None]
        if opt.starts is not None:
            visible = visible & (kj[None] >= opt.starts[:, item.q0 : item.q1, None])
        B, K, _, L = s.shape
        s.view(B, K, -1, opt.groups, L).masked_fill_(~visible[:, None, :, None, :], float("-inf"))
    return s, tanh


def _finite(x: torch.Tensor) -> torch.Tensor:
    """``x`` with -inf (rows that see no key) replaced by 0, so exponentials give 0, not nan."""
    return torch.where(x == float("-inf"), 0.0, x)


def _tile_forward(q, kv, item, opt, o_acc, lse_acc) -> None:
    G, E = opt.groups, opt.key_dim
    rows = slice(item.q0 * G, item.q1 * G)
    k, v = kv[:, :, item.k0 : item.k1, :E], kv[:, :, item.k0 : item.k1, E:]
    s, _ = _scores(q[:, :, rows], k, item, opt)
    m = _finite(s.amax(-1))
    p = torch.exp(s - m[..., None])
    o_tile = (p.to(v.dtype) @ v).to(opt.acc)  # unnormalised: sum of exp(s - m) v
    lse_tile = m + torch.log(p.sum(-1))
    lse_old = lse_acc[:, :, rows]
    lse_new = torch.logaddexp(lse_old, lse_tile)
    ref = _finite(lse_new)
    o_acc[:, :, rows] = (
        o_acc[:, :, rows] * torch.exp(lse_old - ref)[..., None]
        + o_tile * torch.exp(m - ref)[..., None]
    )
    lse_acc[:, :, rows] = lse_new


def _tile_backward(q, kv, item, opt, do, lse, delta, dq, dkv) -> None:
    """Gradients of one tile given the *final* log-sum-exp: p = exp(s - lse) is the tile's
    share of the full softmax, so tiles add up to the full gradient."""
    G, E = opt.groups, opt.key_dim
    rows = slice(item.q0 * G, item.q1 * G)
    cols = slice(item.k0, item.k1)
    q_t, k, v = q[:, :, rows], kv[:, :, cols, :E], kv[:, :, cols, E:]
    s, tanh = _scores(q_t, k, item, opt)
    p = torch.exp(s - lse[:, :, rows, None])
    do_t = do[:, :, rows]
    acc = opt.acc
    dkv[:, :, cols, E:] += p.transpose(-1, -2) @ do_t.to(acc)
    ds = p * ((do_t @ v.transpose(-1, -2)).to(acc) - delta[:, :, rows, None])
    if tanh is not None:
        ds = ds * (1 - tanh * tanh)
    dq[:, :, rows] += (ds @ k.to(acc)) * opt.scale
    dkv[:, :, cols, :E] += (ds.transpose(-1, -2) @ q_t.to(acc)) * opt.scale


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


class _Attention(torch.autograd.Function):
    """Context-parallel attention of this rank's queries over every rank's keys: output and
    log-sum-exp ``(B, K, M, ·)``; saves only its inputs, output and log-sum-exp."""

    @staticmethod
    def forward(ctx, q, k, v, shard, plan, opt):
        B, K, M, _ = q.shape
        kv = torch.cat([k, v], dim=-1)
        o = torch.zeros(B, K, M, v.shape[-1], dtype=opt.acc, device=q.device)
        lse = torch.full((B, K, M), float("-inf"), dtype=opt.acc, device=q.device)
        for step, block in _blocks(shard.cp, kv):
            for item in plan[step]:
                _tile_forward(q, block, item, opt, o, lse)
        out = o.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.shard, ctx.plan, ctx.opt = shard, plan, opt
        return out, lse

    @staticmethod
    def backward(ctx, do, dlse):  # pyrefly: ignore[bad-override]  # torch: one arg per output
        q, k, v, o, lse = ctx.saved_tensors
        cp, plan, opt = ctx.shard.cp, ctx.plan, ctx.opt
        delta = (do.to(opt.acc) * o.to(opt.acc)).sum(-1)
        if dlse is not None:  # the log-sum-exp is an output too (sinks use it)
            delta = delta - dlse
        lse = _finite(lse)
        dq = torch.zeros(q.shape, dtype=opt.acc, device=q.device)
        kv = torch.cat([k, v], dim=-1)
        if cp.algorithm == "allgather":
            dkv = _backward_allgather(cp, plan, opt, q, kv, do, lse, delta, dq)
        else:
            dkv = _backward_ring(cp, plan, opt, q, kv, do, lse, delta, dq)
        E = k.shape[-1]
        return dq.to(q.dtype), dkv[..., :E].to(k.dtype), dkv[..., E:].to(v.dtype), None, None, None


def _backward_ring(cp, plan, opt, q, kv, do, lse, delta, dq) -> torch.Tensor:
    """Blocks go round again; each block's gradient travels with it, gathering every rank's
    share, and reaches its owner one shift after the last step."""
    comm, size = cp.comm, cp.size
    pending = None
    for s in range(size):
        handle = comm.ring_shift(kv) if s < size - 1 else None
        dkv = torch.zeros(kv.shape, dtype=opt.acc, device=kv.device)
        for item in plan[s]:
            _tile_backward(q, kv, item, opt, do, lse, delta, dq, dkv)
        if pending is not None:
            dkv += pending.wait()  # the shares of the ranks before this one
        if size == 1:
            return dkv
        pending = comm.ring_shift(dkv)
        if handle is not None:
            kv = handle.wait()
    assert pending is not None  # size > 1 here
    return pending.wait()


def _backward_allgather(cp, plan, opt, q, kv, do, lse, delta, dq) -> torch.Tensor:
    """Gradients of every rank's block, summed on their owners by one reduce-scatter."""
    dkv = torch.zeros((cp.size, *kv.shape), dtype=opt.acc, device=kv.device)
    for s, block in _blocks(cp, kv):
        for item in plan[s]:
            _tile_backward(q, block, item, opt, do, lse, delta, dq, dkv[(cp.rank - s) % cp.size])
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
    B, S, H, E = q_BSHE.shape
    K, V = k_BSKE.shape[2], v_BSKV.shape[-1]
    if k_BSKE.shape[1] != S:
        raise ValueError(
            f"attention backend 'context_parallel' attends a shard to the whole sequence: got "
            f"{S} queries and {k_BSKE.shape[1]} keys per row"
        )
    G = H // K
    cp = shard.cp
    tile = max(1, min(S // 2, math.isqrt(cp.tile_scores // (B * H))))  # square tiles
    documents = shard.starts is not None
    plan = meta.prepared(
        ("context_parallel-plan", window, tile),
        lambda: _plan(cp.rank, cp.size, S, window, documents, tile),
    )
    opt = _Options(
        groups=G,
        key_dim=E,
        scale=scale,
        softcap=softcap,
        window=window,
        starts=shard.starts,
        acc=torch.promote_types(q_BSHE.dtype, torch.float32),
    )
    q_BKME = q_BSHE.view(B, S, K, G, E).permute(0, 2, 1, 3, 4).reshape(B, K, S * G, E)
    k_BKSE = k_BSKE.transpose(1, 2).contiguous()
    v_BKSV = v_BSKV.transpose(1, 2).contiguous()
    o_BKMV, lse_BKM = _Attention.apply(q_BKME, k_BKSE, v_BKSV, shard, plan, opt)
    o_BSHV = o_BKMV.view(B, K, S, G, V).permute(0, 2, 1, 3, 4).reshape(B, S, H, V)
    if sinks is None:
        return o_BSHV
    # A sink adds exp(sink) to the softmax denominator: rescale by sigmoid(lse - sink).
    lse_BSH = lse_BKM.view(B, K, S, G).permute(0, 2, 1, 3).reshape(B, S, H)
    keep_BSH = torch.sigmoid(lse_BSH - sinks.to(lse_BSH.dtype)[None, None, :])
    return o_BSHV * keep_BSH[..., None].to(o_BSHV.dtype)
