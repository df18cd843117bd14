"""Expert parallelism through symmetric memory: one-sided puts, signal flags, static shapes.

Shapes: ``ep`` ranks, ``E`` experts, ``L = E / ep`` local experts, ``C`` rows per (expert,
source rank) block, ``D`` model dim, ``T`` tokens on this rank.

Layout. Every rank owns one symmetric buffer of ``2 * E * C * D`` elements (and the counts) in
three regions:

* ``to_owner`` (L, ep, C, D): block ``[j, p]`` holds the tokens source rank ``p`` routed to
  my local expert ``j`` (in token order, then zero rows). Expert ``j``'s rows are contiguous
  (``ep * C`` of them), so the grouped GEMM reads them in place of a permuted buffer.
* ``to_source`` (ep, L, C, D) = (E, C, D): block ``[q, j]`` holds the expert outputs that owner
  ``q`` computed for my tokens routed to its expert ``j``: exactly the capacity-mode layout of
  ``permute.py`` over all ``E`` experts, so ``unpermute_and_combine`` finishes the layer.

* ``counts`` (ep, L) int32 (after both, 8-byte aligned): row ``p`` holds how many rows
  source ``p`` put into each block ``[j, p]`` (device values, written before the first flag).

``C`` is static: ``max_tokens`` (default: this call's ``T``, equal on every rank) rounded up to
the alignment when dropless, since a source sends a given expert at most ``T`` tokens; or
``PermuteConfig.capacity`` with a ``capacity_factor``, where assignments past ``C`` are dropped
in token order (``overflow="drop"``) or refused up front (``overflow="error"``, when ``C`` is
below the worst case ``T``). Nothing reads a count back to the host and every shape follows
from ``C``, so the layer captures in a CUDA graph.

Dropless, the owner regroups each chunk's received rows into the all-to-all dispatcher's
layout before its grouped GEMMs (``_Compaction``, from the received ``counts``): expert ``j``'s
rows are source 0's, then source 1's, ... (token order within each), then zero rows up to a
multiple of the alignment, and nothing else; the outputs are regrouped back into blocks.
Every GEMM then reduces over exactly the rows, in the order and the group lengths, that
``AllToAllDispatcher`` gives it, so expert-weight gradients are bitwise the all-to-all ones
(capacity-padded blocks would add zero rows between the sources and change the reduction's
length and blocking), and the GEMMs skip the blocks' padding. Capacity mode keeps the block
layout, which already is all-to-all's capacity layout.

Protocol of one forward (local experts cut into ``chunks`` contiguous runs; one signal
channel per chunk and direction):

1. dispatch: pack my tokens into (E, C, D); for each chunk, for each owner ``q``: write my
   blocks of that chunk into ``q``'s ``to_owner[j0:j1, me]``, then signal ``q`` (with Triton,
   one kernel per chunk gathers the tokens and stores them into every peer: no staging);
2. per chunk, as owner: wait for the chunk's signal from every source, copy the chunk's rows
   out of the buffer (dropless: regrouped, see above), run its experts (grouped GEMM), write
   each source's output blocks into its ``to_source[me, j0:j1]`` and signal it. Chunk
   ``c``'s GEMMs run while the peers are still writing chunks ``c+1...``: the flags are
   per-chunk readiness flags;
3. combine: wait for every owner's signals, copy ``to_source`` out, weight and sum each
   token's ``K`` rows in ``k`` order (bitwise what one process computes from the same rows).

Backward is the mirror image on the same buffers: the gradient of step 3 is step 1 on the
output gradients, that of step 2's outputs is its receive, and so on (four autograd
functions, each the adjoint of another). One buffer pair serves every forward and backward
in sequence: only rank ``p`` writes the ``[*, p]`` blocks of a peer's ``to_owner`` and the
``[p, *]`` blocks of its ``to_source``; ``p`` starts a round only after the previous round
returned everything from every peer, which each peer sent only after copying out what ``p``
had put into its buffer; and ``put_signal`` waits until the peer consumed the flag's last
value.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist

from dist_moe.dispatch import ExpertParallelDispatcher, check_num_experts
from dist_moe.kernels import combine_rows, permute_rows, put_rows_to_peers, resolve_backend
from dist_moe.permute import PermuteConfig, PermutePlan, plan_permutation
from dist_moe.permute import unpermute_and_combine as _unpermute_and_combine
from dist_moe.symm_heap import CudaSymmetricHeap, SharedMemoryHeap, SymmetricHeap

__all__ = ["SymmMemDispatcher"]

Overflow = Literal["drop", "error"]


@dataclass(slots=True)
class _PutIndex:
    """Where each row of one chunk's put goes: a static map, built once per buffer."""

    rows: torch.Tensor
    """(n,) int64: source row of each put row."""
    peer: torch.Tensor
    """(n,) int32: destination rank."""
    offset: torch.Tensor
    """(n,) int64: element offset of the row in the destination's buffer."""


@dataclass(slots=True)
class _Exchange:
    """One (C, D, dtype) buffer pair on a heap, and the chunking of the local experts."""

    heap: SymmetricHeap
    ep: int
    local: int
    capacity: int
    dim: int
    chunks: list[tuple[int, int]]
    kernels: Literal["torch", "triton"] = "torch"
    """"triton": each chunk goes to every peer in one kernel (``put_rows_to_peers``)."""
    to_owner_index: list[_PutIndex] | None = None
    to_source_index: list[_PutIndex] | None = None
    peer_table: torch.Tensor | None = None

    def build_put_index(self, device: torch.device) -> None:
        """The static row maps of both directions, and the table of peer buffer addresses."""
        ep, local, cap, d, me = self.ep, self.local, self.capacity, self.dim, self.heap.rank
        region = local * ep * cap * d
        kw = dict(device=device, dtype=torch.int64)
        self.to_owner_index, self.to_source_index = [], []
        for j0, j1 in self.chunks:
            # send row (q * L + j) * C + s  ->  rank q, to_owner[j, me, s]
            q = torch.arange(ep, **kw)[:, None, None]
            j = torch.arange(j0, j1, **kw)[None, :, None]
            s = torch.arange(cap, **kw)[None, None, :]
            shape = (ep, j1 - j0, cap)
            self.to_owner_index.append(
                _PutIndex(
                    rows=((q * local + j) * cap + s).expand(shape).reshape(-1),
                    peer=q.expand(shape).reshape(-1).to(torch.int32),
                    offset=(((j * ep + me) * cap + s) * d).expand(shape).reshape(-1),
                )
            )
            # chunk output row ((j - j0) * ep + q) * C + s  ->  rank q, to_source[me, j, s]
            j, q = j.reshape(-1, 1, 1), q.reshape(1, -1, 1)
            shape = (j1 - j0, ep, cap)
            self.to_source_index.append(
                _PutIndex(
                    rows=torch.arange((j1 - j0) * ep * cap, **kw),
                    peer=q.expand(shape).reshape(-1).to(torch.int32),
                    offset=(region + ((me * local + j) * cap + s) * d).expand(shape).reshape(-1),
                )
            )
        ptrs = [self.heap.peer_buffer(p).data_ptr() for p in range(ep)]
        self.peer_table = torch.tensor(ptrs, **kw)

    def to_owner(self, rank: int) -> torch.Tensor:
        n = self.local * self.ep * self.capacity * self.dim
        buf = self.heap.peer_buffer(rank)[:n]
        return buf.view(self.local, self.ep, self.capacity, self.dim)

    def to_source(self, rank: int) -> torch.Tensor:
        n = self.local * self.ep * self.capacity * self.dim
        buf = self.heap.peer_buffer(rank)[n : 2 * n]
        return buf.view(self.ep, self.local, self.capacity, self.dim)

    def counts(self, rank: int) -> torch.Tensor:
        """(ep, L) int32: rows each source put into each of ``rank``'s ``to_owner`` blocks."""
        buf = self.heap.peer_buffer(rank)
        start = _counts_offset(self.local * self.ep * self.capacity * self.dim, buf.dtype)
        elem = buf.element_size()
        n = -(-self.ep * self.local * 4 // elem)
        return (
            buf[start : start + n]
            .view(torch.int32)[: self.ep * self.local]
            .view(self.ep, self.local)
        )

    def owner_channel(self, c: int) -> int:
        return c

    def source_channel(self, c: int) -> int:
        return len(self.chunks) + c

    def peers(self) -> list[int]:
        me = self.heap.rank
        return [(me + i) % self.ep for i in range(self.ep)]  # spread: not everyone to rank 0


def _counts_offset(region_numel: int, dtype: torch.dtype) -> int:
    """Element offset of the counts, after both row regions, on an 8-byte boundary."""
    elem = torch.empty((), dtype=dtype).element_size()
    return -(-2 * region_numel * elem // 8) * 8 // elem


def _heap_numel(num_experts: int, ep: int, capacity: int, dim: int, dtype: torch.dtype) -> int:
    """Elements of one rank's buffer: ``to_owner``, ``to_source`` and the int32 counts."""
    elem = torch.empty((), dtype=dtype).element_size()
    local = num_experts // ep
    return _counts_offset(local * ep * capacity * dim, dtype) + -(-num_experts * 4 // elem)


# ---------------------------------------------------------------------------------------
# the four steps (plain tensor code over a heap) and their autograd pairing
# ---------------------------------------------------------------------------------------


def _put_to_owners(
    st: _Exchange, src: torch.Tensor, token_of_row: torch.Tensor | None = None
) -> None:
    """Send the (E * C, D) rows, chunk by chunk. With ``token_of_row`` (Triton only) row r
    is ``src[token_of_row[r]]`` (zeros for -1): packing and sending in one pass."""
    me = st.heap.rank
    for c, (j0, j1) in enumerate(st.chunks):
        if st.kernels == "triton":
            index, table = st.to_owner_index, st.peer_table
            assert index is not None and table is not None  # build_put_index ran
            idx = index[c]
            rows = idx.rows if token_of_row is None else token_of_row.index_select(0, idx.rows)
            put_rows_to_peers(src, rows, idx.peer, idx.offset, table)
        else:
            send = src.reshape(st.ep, st.local, st.capacity, st.dim)
            for q in st.peers():
                st.to_owner(q)[j0:j1, me].copy_(send[q, j0:j1])
        for q in st.peers():
            st.heap.put_signal(q, st.owner_channel(c))


def _take_chunk(st: _Exchange, c: int) -> torch.Tensor:
    j0, j1 = st.chunks[c]
    for p in st.peers():
        st.heap.wait_signal(p, st.owner_channel(c))
    return st.to_owner(st.heap.rank)[j0:j1].reshape(-1, st.dim).clone()


def _put_chunk_to_sources(st: _Exchange, c: int, y_RD: torch.Tensor) -> None:
    j0, j1 = st.chunks[c]
    me = st.heap.rank
    if st.kernels == "triton":
        index, table = st.to_source_index, st.peer_table
        assert index is not None and table is not None  # build_put_index ran
        idx = index[c]
        put_rows_to_peers(y_RD, idx.rows, idx.peer, idx.offset, table)
    else:
        y = y_RD.reshape(j1 - j0, st.ep, st.capacity, st.dim)
        for q in st.peers():
            st.to_source(q)[me, j0:j1].copy_(y[:, q])
    for q in st.peers():
        st.heap.put_signal(q, st.source_channel(c))


def _take_at_source(st: _Exchange) -> torch.Tensor:
    for c in range(len(st.chunks)):
        for p in st.peers():
            st.heap.wait_signal(p, st.source_channel(c))
    return st.to_source(st.heap.rank).reshape(-1, st.dim).clone()


class _PutToOwners(torch.autograd.Function):
    """Step 1 (pack and send); returns an empty token the chunk receives hang on.

    Backward: step 3's receive, then the adjoint of the packing (sum each token's rows).
    """

    @staticmethod
    def forward(ctx, x_TD: torch.Tensor, st: _Exchange, plan: PermutePlan) -> torch.Tensor:
        ctx.st, ctx.plan = st, plan
        me = st.heap.rank
        # rows in each of my blocks, before the first flag (the owners regroup by them)
        sent = plan.counts.clamp(max=st.capacity).to(torch.int32).reshape(st.ep, st.local)
        for q in st.peers():
            st.counts(q)[me].copy_(sent[q])
        ra, k = plan.row_assignment, plan.top_k
        if st.kernels == "triton":
            _put_to_owners(st, x_TD, torch.where(ra >= 0, ra // k, -1))
        else:
            _put_to_owners(st, permute_rows(x_TD, ra, k, backend="torch"))
        return x_TD.new_empty(0)

    @staticmethod
    def backward(ctx, _token_grad):  # pyrefly: ignore[bad-override]  # torch: one arg per output
        plan = ctx.plan
        grad_rows = _take_at_source(ctx.st)
        return combine_rows(grad_rows, plan.slot, plan.top_k, backend=ctx.st.kernels), None, None


class _TakeChunk(torch.autograd.Function):
    """Owner side of step 2: chunk ``c``'s rows. Backward: send their gradients back."""

    @staticmethod
    def forward(ctx, token: torch.Tensor, st: _Exchange, c: int) -> torch.Tensor:
        ctx.st, ctx.c = st, c
        return _take_chunk(st, c)

    @staticmethod
    def backward(ctx, grad_RD):  # pyrefly: ignore[bad-override]  # torch: one arg per output
        _put_chunk_to_sources(ctx.st, ctx.c, grad_RD.contiguous())
        return grad_RD.new_empty(0), None, None


class _PutChunkToSources(torch.autograd.Function):
    """Owner side of step 2: send chunk ``c``'s outputs. Backward: receive their gradients."""

    @staticmethod
    def forward(ctx, y_RD: torch.Tensor, st: _Exchange, c: int) -> torch.Tensor:
        ctx.st, ctx.c = st, c
        _put_chunk_to_sources(st, c, y_RD)
        return y_RD.new_empty(0)

    @staticmethod
    def backward(ctx, _token_grad):  # pyrefly: ignore[bad-override]  # torch: one arg per output
        return _take_chunk(ctx.st, ctx.c), None, None


class _TakeAtSource(torch.autograd.Function):
    """Step 3's receive: (E * C, D) expert outputs for my tokens. Backward: step 1."""

    @staticmethod
    def forward(ctx, st: _Exchange, *tokens: torch.Tensor) -> torch.Tensor:
        ctx.st, ctx.num_tokens = st, len(tokens)
        return _take_at_source(st)

    @staticmethod
    def backward(ctx, grad_RD):  # pyrefly: ignore[bad-override]  # torch: one arg per output
        _put_to_owners(ctx.st, grad_RD.contiguous())
        return (None, *(grad_RD.new_empty(0) for _ in range(ctx.num_tokens)))


@dataclass(slots=True)
class _Compaction:
    """Dropless: received blocks (J, ep, C) <-> all-to-all's expert layout of the same rows."""

    compact_of_block: torch.Tensor
    """(J * ep * C,) int64: regrouped row of each block row, -1 for the blocks' padding."""
    block_of_compact: torch.Tensor
    """(J * ep * C,) int64: block row of each regrouped row, -1 for alignment and slack."""
    group_ends: torch.Tensor
    """(J,) int32: end of each expert's group in the regrouped rows."""


def _compaction(counts_JP: torch.Tensor, capacity: int, alignment: int) -> _Compaction:
    """The regrouping of J experts' blocks from ``counts_JP`` (J, ep), on the device: expert
    ``j``'s rows from source 0, 1, ... back to back, then zeros to a multiple of
    ``alignment``; the same rows, order and group lengths as ``AllToAllDispatcher``."""
    counts = counts_JP.to(torch.int64)
    j, p = counts.shape
    padded = (counts.sum(1) + (alignment - 1)) // alignment * alignment
    ends = torch.cumsum(padded, 0)
    before = torch.cumsum(counts, 1) - counts  # rows of the earlier sources, per expert
    s = torch.arange(capacity, device=counts.device)
    valid = s < counts[:, :, None]
    dest = (ends - padded)[:, None, None] + before[:, :, None] + s
    n = j * p * capacity
    compact_of_block = torch.where(valid, dest, -1).reshape(-1)
    block_of_compact = torch.full((n + 1,), -1, dtype=torch.int64, device=counts.device)
    index = torch.where(valid, dest, n).reshape(-1)  # padding lands in a discarded extra row
    block_of_compact.scatter_(0, index, torch.arange(n, device=counts.device))
    return _Compaction(compact_of_block, block_of_compact[:n], ends.to(torch.int32))


class _Regroup(torch.autograd.Function):
    """``out[r] = x[index[r]]`` (0 for -1) where ``index`` is one-to-one on its valid rows
    and ``inverse`` its inverse: the backward is the same gather through ``inverse``."""

    @staticmethod
    def forward(ctx, x_RD, index, inverse, kernels):
        ctx.inverse, ctx.kernels = inverse, kernels
        return permute_rows(x_RD, index, 1, backend=kernels)

    @staticmethod
    def backward(ctx, grad_RD):  # pyrefly: ignore[bad-override]  # torch: one arg per output
        return permute_rows(grad_RD, ctx.inverse, 1, backend=ctx.kernels), None, None, None


def _to_experts(rows_RD: torch.Tensor, comp: _Compaction, st: _Exchange) -> torch.Tensor:
    return _Regroup.apply(rows_RD, comp.block_of_compact, comp.compact_of_block, st.kernels)


def _to_blocks(y_RD: torch.Tensor, comp: _Compaction, st: _Exchange) -> torch.Tensor:
    return _Regroup.apply(y_RD, comp.compact_of_block, comp.block_of_compact, st.kernels)


@dataclass(slots=True)
class _SymmContext:
    plan: PermutePlan
    exchange: _Exchange
    token: torch.Tensor
    compaction: _Compaction | None = None
    """``dispatch`` (dropless): the regrouping of all local experts' rows."""


# ---------------------------------------------------------------------------------------
# the dispatcher
# ---------------------------------------------------------------------------------------


def _group_backend(group: dist.ProcessGroup | None) -> str:
    try:
        return str(dist.get_backend(group))
    except Exception:
        return "unknown"


class SymmMemDispatcher(ExpertParallelDispatcher):
    """Expert parallelism through symmetric memory (see the module docstring).

    Args:
        num_experts: global number of experts E (divisible by the group size).
        group: the expert-parallel group (default: the default group).
        config: alignment, and ``capacity_factor`` (None: dropless with worst-case blocks).
        max_tokens: the most tokens any rank passes in one call; sizes the static blocks, so
            ranks may then hold different token counts. None: this call's T, which every
            rank must then share.
        overflow: ``"drop"`` assignments past the capacity (in token order) or ``"error"``:
            refuse a capacity below the worst case before any communication.
        chunks: runs of local experts that become ready together (1..L; L gives one
            readiness flag per expert). Default: min(L, 4).
        emulate: run the protocol on CPU tensors through shared-memory files between the
            processes of one host (a gloo group) instead of CUDA symmetric memory: for tests
            and development.

    ``dropped`` holds the number of assignments this rank dropped in its last dispatch
    (a device tensor: read it at your log interval, not every step).
    """

    def __init__(
        self,
        num_experts: int,
        group: dist.ProcessGroup | None = None,
        config: PermuteConfig | None = None,
        *,
        max_tokens: int | None = None,
        overflow: Overflow = "drop",
        chunks: int | None = None,
        emulate: bool = False,
    ) -> None:
        check_num_experts(num_experts)
        if overflow not in ("drop", "error"):
            raise ValueError(
                f"SymmMemDispatcher: overflow must be 'drop' or 'error', got {overflow!r}"
            )
        if max_tokens is not None and (
            isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1
        ):
            raise ValueError(
                f"SymmMemDispatcher: max_tokens must be None or an int >= 1, got {max_tokens!r}"
            )
        if not isinstance(emulate, bool):
            raise ValueError(f"SymmMemDispatcher: emulate must be a bool, got {emulate!r}")
        if not emulate:
            backend = _group_backend(group)
            if not torch.cuda.is_available() or "nccl" not in backend:
                raise ValueError(
                    "SymmMemDispatcher needs an expert-parallel group backed by CUDA symmetric "
                    "memory: CUDA devices and an NCCL process group (got backend "
                    f"{backend!r}, CUDA available: {torch.cuda.is_available()}); use "
                    "AllToAllDispatcher on gloo, or emulate=True for the CPU emulation"
                )
        super().__init__(num_experts, group, config)
        local = self.num_local_experts
        n_chunks = min(local, 4) if chunks is None else chunks
        if (
            isinstance(n_chunks, bool)
            or not isinstance(n_chunks, int)
            or not 1 <= n_chunks <= local
        ):
            raise ValueError(
                f"SymmMemDispatcher: chunks must be an int in [1, {local}] (local experts), "
                f"got {chunks!r}"
            )
        bounds = [round(i * local / n_chunks) for i in range(n_chunks + 1)]
        self.chunks = list(itertools.pairwise(bounds))
        self.max_tokens, self.overflow, self.emulate = max_tokens, overflow, emulate
        self.dropped: torch.Tensor | None = None
        self._exchanges: dict[tuple[Any, ...], _Exchange] = {}

    # ---- sizing ------------------------------------------------------------------------

    def capacity(self, num_tokens: int, top_k: int) -> int:
        """Rows per (expert, source) block for calls of ``num_tokens`` x ``top_k``."""
        t = self.max_tokens if self.max_tokens is not None else num_tokens
        if t < num_tokens:
            raise ValueError(
                f"SymmMemDispatcher: this rank got {num_tokens} tokens, more than "
                f"max_tokens={self.max_tokens}"
            )
        align = self.config.alignment
        worst = -(-max(t, 1) // align) * align  # a source sends an expert <= t tokens
        if self.config.capacity_factor is None:
            return worst
        cap = self.config.capacity(t * top_k, self.num_experts)
        if cap < min(t, worst) and self.overflow == "error":
            need = self.num_experts / top_k
            raise ValueError(
                f"SymmMemDispatcher: capacity {cap} rows per (expert, source) is below the "
                f"worst case of {t} tokens (capacity_factor={self.config.capacity_factor}, "
                f"T={t}, K={top_k}, E={self.num_experts}) and overflow='error'; set "
                f"capacity_factor >= E/K = {need:g}, capacity_factor=None (dropless), or "
                "overflow='drop'"
            )
        return min(cap, worst)

    def _exchange_for(self, capacity: int, x_TD: torch.Tensor) -> _Exchange:
        d = x_TD.shape[1]
        key = (capacity, d, x_TD.dtype, x_TD.device)
        if key not in self._exchanges:
            group = self.group if self.group is not None else dist.group.WORLD
            assert group is not None  # the default group exists once dist is initialized
            numel = _heap_numel(self.num_experts, self.placement.ep_size, capacity, d, x_TD.dtype)
            channels = 2 * len(self.chunks)
            if self.emulate:
                if x_TD.device.type != "cpu":
                    raise ValueError(
                        f"SymmMemDispatcher(emulate=True) runs on CPU tensors, got {x_TD.device}"
                    )
                heap: SymmetricHeap = SharedMemoryHeap(group, numel, x_TD.dtype, channels)
            else:
                if x_TD.device.type != "cuda":
                    raise ValueError(
                        f"SymmMemDispatcher: tensors must be on a CUDA device, got {x_TD.device}"
                    )
                heap = CudaSymmetricHeap(group, numel, x_TD.dtype, x_TD.device, channels)
            st = _Exchange(
                heap=heap,
                ep=self.placement.ep_size,
                local=self.num_local_experts,
                capacity=capacity,
                dim=d,
                chunks=self.chunks,
                kernels=resolve_backend(self.config.kernels, x_TD.device),
            )
            if st.kernels == "triton":
                st.build_put_index(x_TD.device)
            self._exchanges[key] = st
        return self._exchanges[key]

    # ---- the steps ----------------------------------------------------------------------

    def _send(
        self, x_TD: torch.Tensor, indices_TK: torch.Tensor, counts: torch.Tensor | None
    ) -> _SymmContext:
        cap = self.capacity(x_TD.shape[0], indices_TK.shape[1])
        st = self._exchange_for(cap, x_TD)
        plan = plan_permutation(
            indices_TK, self.num_experts, self.config, counts=counts, capacity=cap
        )
        self.dropped = (plan.counts - cap).clamp(min=0).sum()
        token = _PutToOwners.apply(x_TD, st, plan)
        return _SymmContext(plan=plan, exchange=st, token=token)

    def _group_ends(self, num_experts: int, st: _Exchange, device: torch.device) -> torch.Tensor:
        rows = st.ep * st.capacity
        return torch.arange(1, num_experts + 1, dtype=torch.int32, device=device) * rows

    def _finish(self, ctx: _SymmContext, tokens: list[torch.Tensor], weights_TK: torch.Tensor):
        y_buf = _TakeAtSource.apply(ctx.exchange, *tokens)
        return _unpermute_and_combine(y_buf, ctx.plan, weights_TK)

    def _compaction(self, st: _Exchange, j0: int, j1: int) -> _Compaction | None:
        """Dropless: the regrouping of local experts ``j0:j1`` (their rows have arrived)."""
        if self.config.capacity_factor is not None:
            return None
        counts_JP = st.counts(st.heap.rank)[:, j0:j1].t()
        return _compaction(counts_JP, st.capacity, self.config.alignment)

    def forward_experts(self, experts, x_TD, indices_TK, weights_TK, counts=None):
        ctx = self._send(x_TD, indices_TK, counts)
        st = ctx.exchange
        chunk_weights = experts.split_weights([j1 - j0 for j0, j1 in st.chunks])
        tokens = []
        for c, (j0, j1) in enumerate(st.chunks):
            rows = _TakeChunk.apply(ctx.token, st, c)
            comp = self._compaction(st, j0, j1)
            if comp is None:
                y = experts(rows, self._group_ends(j1 - j0, st, x_TD.device), chunk_weights[c])
            else:
                y = experts(_to_experts(rows, comp, st), comp.group_ends, chunk_weights[c])
                y = _to_blocks(y, comp, st)
            tokens.append(_PutChunkToSources.apply(y, st, c))
        return self._finish(ctx, tokens, weights_TK)

    def dispatch(self, x_TD, indices_TK, counts=None):
        ctx = self._send(x_TD, indices_TK, counts)
        st = ctx.exchange
        rows = torch.cat([_TakeChunk.apply(ctx.token, st, c) for c in range(len(st.chunks))])
        ctx.compaction = self._compaction(st, 0, st.local)
        if ctx.compaction is None:
            return rows, self._group_ends(st.local, st, x_TD.device), ctx
        return _to_experts(rows, ctx.compaction, st), ctx.compaction.group_ends, ctx

    def combine(self, y_RD, weights_TK, ctx: _SymmContext):
        st = ctx.exchange
        if ctx.compaction is not None:
            y_RD = _to_blocks(y_RD, ctx.compaction, st)
        block = st.ep * st.capacity
        pieces = y_RD.split([(j1 - j0) * block for j0, j1 in st.chunks])
        tokens = [_PutChunkToSources.apply(y, st, c) for c, y in enumerate(pieces)]
        return self._finish(ctx, tokens, weights_TK)
