"""Layout-independent initialisation: initial values are a function of (seed, FQN, index).

Every parameter's values come from counter-style random blocks: the global tensor is cut
along dim 0 into blocks of rows (about ``_BLOCK_ELEMENTS`` elements each, fixed by the global
shape), and block ``b`` of parameter ``fqn`` is drawn from a generator seeded with
``hash(seed, fqn, b)``. A rank that holds any piece of the parameter (a data-parallel shard,
a tensor-parallel slice, some experts, a pipeline stage's layers) draws only the blocks its
piece overlaps and copies its part. One process and every layout therefore hold, bit for bit,
the same full weights on a given device type, and no rank ever allocates more than one block
beyond what it holds.

Modules say how their parameters start with ``param_init(std=, out_std=) -> {name: Init}``
(names relative to the module, covering its subtree); ``Transformer.param_inits()`` collects
them under full FQNs, with every buffer at zero.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "ONES",
    "Constant",
    "HashRoutes",
    "Init",
    "InverseSoftplusLogUniform",
    "LogUniform",
    "Normal",
    "Uniform",
    "init_state",
    "local_chunks",
    "prefixed",
]

_BLOCK_ELEMENTS = 1 << 20
"""Elements per random block (4 MiB in fp32): the most any rank draws beyond its piece."""


@dataclass(frozen=True, slots=True)
class Normal:
    """N(0, std²) in fp32, cast to the parameter's dtype. ``seed``: draw from this seed
    instead of the one ``init_state`` is given (values that must not depend on the model's
    seed, as LoRA adapters added to a checkpoint's weights)."""

    std: float
    seed: int | None = None

    def sample(self, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
        out = torch.randn(shape, generator=generator, device=generator.device)
        return out.mul_(self.std)


@dataclass(frozen=True, slots=True)
class Constant:
    """Every element ``value`` (no random draw)."""

    value: float


@dataclass(frozen=True, slots=True)
class Uniform:
    """U(low, high) in fp32 (``nn.Conv1d``'s default for a depthwise kernel of fan-in W is
    ``Uniform(-1/√W, 1/√W)``)."""

    low: float
    high: float

    def sample(self, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
        out = torch.rand(shape, generator=generator, device=generator.device)
        return out.mul_(self.high - self.low).add_(self.low)


@dataclass(frozen=True, slots=True)
class LogUniform:
    """``log(U(low, high))``: a decay rate stored as its log (linear attention's ``A_log``)."""

    low: float
    high: float

    def sample(self, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
        return Uniform(self.low, self.high).sample(shape, generator).log_()


@dataclass(frozen=True, slots=True)
class InverseSoftplusLogUniform:
    """``softplus⁻¹(dt)`` with ``dt = max(exp(U(log low, log high)), floor)``: a bias whose
    softplus spreads time steps log-uniformly over ``[low, high]`` (Mamba / KDA ``dt_bias``)."""

    low: float
    high: float
    floor: float = 1e-4

    def sample(self, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
        log_range = Uniform(math.log(self.low), math.log(self.high))
        dt = log_range.sample(shape, generator).exp_().clamp_(min=self.floor)
        return dt + torch.log(-torch.expm1(-dt))


@dataclass(frozen=True, slots=True)
class HashRoutes:
    """A hash-routing table ``(V, K)``: every row ``K`` distinct experts of ``num_experts``,
    uniformly at random (int64; dist_moe's ``expert_table``)."""

    num_experts: int

    def sample(self, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
        rows, k = shape
        keys = torch.rand(rows, self.num_experts, generator=generator, device=generator.device)
        return keys.topk(k, dim=-1).indices


Init = Normal | Constant | Uniform | LogUniform | InverseSoftplusLogUniform | HashRoutes
ONES = Constant(1.0)


def prefixed(prefix: str, inits: Mapping[str, Init]) -> dict[str, Init]:
    """``inits`` of a submodule under its name in the parent."""
    return {f"{prefix}.{name}": init for name, init in inits.items()}


def local_chunks(value: Any) -> tuple[tuple[int, ...], list[tuple[tuple[int, ...], torch.Tensor]]]:
    """``(global shape, [(global offset, local tensor), ...])`` of a state-dict value: a plain
    tensor (the whole of it) or an object of the sharded-tensor protocol (``global_shape`` and
    ``local_chunks()``, as flexshard's ``ShardedParam``; model code never imports
    torch.distributed, so a caller holding DTensors wraps them in that protocol)."""
    if hasattr(value, "local_chunks") and hasattr(value, "global_shape"):
        return tuple(value.global_shape), list(value.local_chunks())
    if isinstance(value, torch.Tensor) and not hasattr(value, "device_mesh"):
        return tuple(value.shape), [((0,) * value.dim(), value)]
    raise TypeError(
        f"cannot initialise a {type(value).__name__}: pass plain tensors or objects with "
        "global_shape and local_chunks() (wrap DTensors)"
    )


@torch.no_grad()
def init_state(state: Mapping[str, Any], inits: Mapping[str, Init], *, seed: int) -> None:
    """Fill every entry of ``state`` (FQN → tensor or sharded-tensor object, as a module's
    ``state_dict(keep_vars=True)`` or flexshard's ``sharded_state_dict``) in place:
    parameters from ``inits`` (keyed by FQN), everything else zero. A tensor reachable under
    two keys (a tied weight) is filled once, from the first key. Meta tensors are skipped
    (nothing to fill)."""
    done: set[tuple[int, int, tuple[int, ...]]] = set()
    for key, value in state.items():
        global_shape, chunks = local_chunks(value)
        todo = []
        for offset, chunk in chunks:
            where = (chunk.data_ptr(), int(chunk.storage_offset()), tuple(chunk.shape))
            if not chunk.is_meta and chunk.numel() and where not in done:
                todo.append((offset, chunk))
                done.add(where)
        if not todo:
            continue
        if key not in inits:
            raise ValueError(f"{key!r} has no initialiser (add it to its module's param_init)")
        for offset, chunk in todo:
            _fill(chunk, offset, global_shape, inits[key], key, seed)


def _fill(
    chunk: torch.Tensor,
    offset: tuple[int, ...],
    global_shape: tuple[int, ...],
    init: Init,
    key: str,
    seed: int,
) -> None:
    if isinstance(init, Constant):
        chunk.fill_(init.value)
        return
    own_seed = getattr(init, "seed", None)  # an Init with its own seed
    if own_seed is not None:
        seed = own_seed
    rows, row_shape = (global_shape[0], global_shape[1:]) if global_shape else (1, ())
    per_block = max(1, _BLOCK_ELEMENTS // max(1, math.prod(row_shape)))
    view = chunk.reshape(1) if not global_shape else chunk
    first, count = (offset[0], view.shape[0]) if global_shape else (0, 1)
    inner = tuple(slice(o, o + n) for o, n in zip(offset[1:], view.shape[1:], strict=True))
    for block, lo, hi in _blocks(first, first + count, rows, per_block):
        generator = torch.Generator(device=chunk.device).manual_seed(_block_seed(seed, key, block))
        values = init.sample((hi - lo, *row_shape), generator)
        start, stop = max(lo, first), min(hi, first + count)
        piece = values[(slice(start - lo, stop - lo), *inner)]
        view[start - first : stop - first].copy_(piece)


def _blocks(first: int, stop: int, rows: int, per_block: int) -> Iterator[tuple[int, int, int]]:
    """(block index, first row, end row) of every block overlapping rows [first, stop)."""
    for block in range(first // per_block, -(-stop // per_block)):
        yield block, block * per_block, min((block + 1) * per_block, rows)


def _block_seed(seed: int, key: str, block: int) -> int:
    digest = hashlib.blake2b(f"{seed}/{key}/{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)
