"""Gated DeltaNet / KDA layers on a context-parallel shard (``components.context_parallel``).

Rank ``r`` of ``cp`` holds chunks ``r`` and ``2·cp - 1 - r`` of every row (``c = S / 2cp``
tokens each). A linear-attention layer is a chain over the chunks in sequence order: chunks
``0 .. cp-1`` are the first chunks of ranks ``0 .. cp-1``, chunks ``cp .. 2cp-1`` the second
chunks of ranks ``cp-1 .. 0``. Two things cross a chunk edge:

- the short conv's window: each chunk is convolved behind a halo of the ``W - 1`` conv inputs
  before it (one small all-gather of every rank's chunk tails, its gradient one
  reduce-scatter; zeros before the row, and inputs of an earlier document masked as in one
  process);
- the delta-rule state: a chunk starts from the previous chunk's final state (zeros for
  chunk 0, and for a row whose chunk begins a new document) and passes its own on, point to
  point. Backward walks the chain in reverse: a chunk receives the gradient of its final state,
  recomputes its delta rule with the incoming state and sends the incoming state's gradient
  back. Only the inputs and the incoming states are saved.

Limit: the chain is sequential, so the delta rule of a layer takes ``2·cp`` chunk times on the
critical path (the same work as one process, split over the ranks' memory, not their time),
plus one recompute of each chunk in backward. The rest of the layer (projections, gates,
norm) is per token and parallel.

Shapes: B batch, S local tokens (two chunks of c), C channels, W conv kernel, H heads,
K key dim, V value dim.
"""

from __future__ import annotations

import torch

from ..context_parallel import ContextParallelShard, chunk_start
from .delta_rule import chunk_delta_rule
from .short_conv import ShortConvolution


class _GatherTails(torch.autograd.Function):
    """Every rank's ``x`` ``(cp, ...)``; the gradient is summed back on each owner."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return comm.all_gather(x).wait()

    @staticmethod
    def backward(ctx, grad):  # pyrefly: ignore[bad-override]  # torch: one arg per output
        return ctx.comm.reduce_scatter(grad).wait(), None


@torch.compiler.disable
def sharded_short_convs(
    shard: ContextParallelShard,
    modules: tuple[ShortConvolution, ...],
    inputs: tuple[torch.Tensor, ...],
) -> list[torch.Tensor]:
    """``module(x)`` for each (module, input ``(B, S, C)``) on this rank's two chunks, each
    convolved behind the ``W - 1`` inputs that precede it in the whole row."""
    cp = shard.cp
    B, S, _ = inputs[0].shape
    c, halo = S // 2, modules[0].kernel_size - 1
    if halo == 0:
        return [m(x) for m, x in zip(modules, inputs, strict=True)]
    if c < halo:
        raise ValueError(
            f"a context-parallel chunk of {c} tokens is shorter than the conv window's "
            f"{halo} earlier inputs: use a sequence of at least {2 * cp.size * halo} tokens"
        )
    x_all = torch.cat(inputs, dim=-1)
    tails = torch.stack([x_all[:, c - halo : c], x_all[:, S - halo :]], dim=1)  # (B, 2, W-1, C)
    gathered = _GatherTails.apply(tails, cp.comm)  # (cp, B, 2, W-1, C)
    r, n = cp.rank, cp.size
    first = torch.zeros_like(tails[:, 0]) if r == 0 else gathered[r - 1][:, 0]
    second = gathered[r][:, 0] if r == n - 1 else gathered[r + 1][:, 1]
    segments = None
    if shard.starts is not None:  # a halo token belongs to the chunk's first document or none
        parts = []
        for half in (0, 1):
            start_B = shard.starts[:, half * c]
            index = chunk_start(r, half, n, c) + torch.arange(-halo, 0, device=x_all.device)
            inside = index[None] >= start_B[:, None]
            parts += [torch.where(inside, start_B[:, None], -2), shard.starts[:, half * c :][:, :c]]
        segments = torch.cat(parts, dim=1)
    outs, offset = [], 0
    for module, x in zip(modules, inputs, strict=True):
        width = x.shape[-1]
        halos = [h[..., offset : offset + width] for h in (first, second)]
        offset += width
        x_ext = torch.cat([halos[0], x[:, :c], halos[1], x[:, c:]], dim=1)
        y = module(x_ext, segments_BS=segments)
        outs.append(y.view(B, 2, c + halo, width)[:, :, halo:].reshape(B, S, width))
    return outs


@torch.compiler.disable
def sharded_delta_rule(
    shard: ContextParallelShard,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float,
    chunk_size: int,
    backend: str,
) -> torch.Tensor:
    """``chunk_delta_rule`` of this rank's two chunks as part of the whole rows (outputs
    ``(B, S, H, V)``): the state passes along the chain of chunks (module docstring)."""
    options = {"scale": scale, "chunk_size": chunk_size, "backend": backend}
    return _DeltaRuleChain.apply(q, k, v, g, beta, shard, options)


def _incoming(shard: ContextParallelShard, half: int, c: int) -> torch.Tensor | None:
    """``(B,)`` whether each row's chunk ``half`` continues the previous chunk's document
    (``None``: always, no documents)."""
    if shard.starts is None:
        return None
    return shard.starts[:, half * c] < chunk_start(shard.cp.rank, half, shard.cp.size, c)


def _halves(inputs, half: int) -> list[torch.Tensor]:
    c = inputs[0].shape[1] // 2
    return [t[:, half * c : (half + 1) * c] for t in inputs]


def _chunk(parts, shard, options, half, state, final: bool):
    """The delta rule of chunk ``half`` (its inputs ``parts``) from ``state`` (``None``:
    zeros)."""
    c = parts[0].shape[1]
    keep = _incoming(shard, half, c)
    if state is not None and keep is not None:
        state = state * keep[:, None, None, None].to(state.dtype)
    documents = None if shard.starts is None else shard.starts[:, half * c : (half + 1) * c]
    return chunk_delta_rule(
        *parts,
        scale=options["scale"],
        chunk_size=options["chunk_size"],
        initial_state=state,
        document_ids=documents,
        output_final_state=final,
        backend=options["backend"],
    )


class _DeltaRuleChain(torch.autograd.Function):
    """The delta rule over the chain of chunks; saves the inputs and incoming states."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, shard, options):
        comm, r, n = shard.cp.comm, shard.cp.rank, shard.cp.size
        inputs = (q, k, v, g, beta)
        B, _, H, K = k.shape
        acc = torch.promote_types(v.dtype, torch.float32)
        like = torch.empty(B, H, K, v.shape[-1], dtype=acc, device=v.device)
        sends = []
        state0 = None if r == 0 else comm.recv(like, r - 1).wait()
        o0, final0 = _chunk(_halves(inputs, 0), shard, options, 0, state0, final=True)
        if r < n - 1:
            sends.append(comm.send(final0, r + 1))
            state1 = comm.recv(like, r + 1).wait()
        else:
            state1 = final0
        o1, final1 = _chunk(_halves(inputs, 1), shard, options, 1, state1, final=r > 0)
        if r > 0:
            sends.append(comm.send(final1, r - 1))
        for pending in sends:
            pending.wait()
        ctx.save_for_backward(q, k, v, g, beta, state0, state1)
        ctx.shard, ctx.options, ctx.like = shard, options, like
        return torch.cat([o0, o1], dim=1)

    @staticmethod
    def backward(ctx, do):  # pyrefly: ignore[bad-override]  # torch: one arg per output
        q, k, v, g, beta, state0, state1 = ctx.saved_tensors
        shard, options = ctx.shard, ctx.options
        comm, r, n = shard.cp.comm, shard.cp.rank, shard.cp.size
        inputs, do_halves = (q, k, v, g, beta), _halves([do], 0) + _halves([do], 1)
        sends = []
        dfinal1 = None if r == 0 else comm.recv(ctx.like, r - 1).wait()
        grads1, dstate1 = _chunk_backward(
            _halves(inputs, 1), shard, options, 1, state1, do_halves[1], dfinal1
        )
        if r < n - 1:
            sends.append(comm.send(dstate1, r + 1))
            dfinal0 = comm.recv(ctx.like, r + 1).wait()
        else:
            dfinal0 = dstate1
        grads0, dstate0 = _chunk_backward(
            _halves(inputs, 0), shard, options, 0, state0, do_halves[0], dfinal0
        )
        if r > 0:
            sends.append(comm.send(dstate0, r - 1))
        for pending in sends:
            pending.wait()
        grads = [torch.cat([a, b], dim=1) for a, b in zip(grads0, grads1, strict=True)]
        return (*grads, None, None)


def _chunk_backward(parts, shard, options, half, state, do, dfinal):
    """Gradients of chunk ``half`` w.r.t. its inputs and its incoming state (``None`` when it
    has none), recomputing its delta rule."""
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_() for t in parts]
        state_leaf = None if state is None else state.detach().requires_grad_()
        o, final = _chunk(leaves, shard, options, half, state_leaf, final=dfinal is not None)
        outputs, grad_outputs = [o], [do]
        if dfinal is not None:
            assert final is not None  # asked for with final=True
            outputs.append(final)
            grad_outputs.append(dfinal)
        wrt = leaves + ([state_leaf] if state_leaf is not None else [])
        grads = torch.autograd.grad(outputs, wrt, grad_outputs, allow_unused=True)
    grads = [torch.zeros_like(t) if d is None else d for t, d in zip(wrt, grads, strict=True)]
    return grads[: len(leaves)], (grads[-1] if state_leaf is not None else None)
