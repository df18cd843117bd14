"""flexshard's parameter gather and gradient reduce-scatter, written as functional
collectives so that they are nodes of the step graph (SimpleFSDP style).

Each function reproduces, value for value, what flexshard's ``Shard(0)`` layout does with a
bucket (``flexshard/_layout.py``): the local rows are padded to ``ceil(n / world)`` rows,
all-gathered and cut back to ``n`` rows; a full gradient is cast to the reduce dtype, padded
to ``world`` chunks, summed by a reduce-scatter and divided by the data-parallel size (before
the sum for reduce dtypes under 32 bits, after it otherwise). The graph issues one collective
per parameter; the bucketing pass (``passes.bucket_collectives``) merges them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

_C10D = torch.ops._c10d_functional


@dataclass(frozen=True, slots=True)
class ShardSpec:
    """How one flexshard-sharded parameter is split over the data-parallel group."""

    rows: int
    """Rows of the full parameter (dim 0)."""
    chunk: int
    """Rows per rank, padded: ``ceil(rows / world)``."""
    length: int
    """Rows this rank holds (``chunk``, fewer or none at the end)."""
    world: int
    group_name: str
    divide: float
    predivide: bool
    param_dtype: torch.dtype
    reduce_dtype: torch.dtype
    local_dtype: torch.dtype


def shard_spec(param: torch.Tensor) -> ShardSpec | None:
    """The spec of a flexshard-sharded local parameter (None: not sharded). Raises
    ``ValueError`` for layouts the graph does not express (HSDP, Owned, BlockShard, Shard on
    a dim other than 0, rank-ordered sums)."""
    import flexshard

    info = flexshard.param_info(param)
    if info is None:
        return None
    bucket = info.bucket
    layout = bucket.layout
    g = layout.g
    where = f"parameter {info.fqn!r} (bucket {bucket.name!r}, {info.placement})"
    if not isinstance(info.placement, flexshard.Shard) or info.placement.dim != 0:
        raise ValueError(f"compile.mode='graph' shards Shard(0) buckets only, not {where}")
    if g.replicate_group is not None:
        raise ValueError(
            f"compile.mode='graph' does not express HSDP yet (parallel.dp_replicate > 1): {where}"
        )
    if layout.rank_ordered:
        raise ValueError(f"compile.mode='graph' does not express rank-ordered sums: {where}")
    if info.dtensor is not None:
        raise ValueError(
            f"compile.mode='graph' does not combine flexshard with tensor parallelism yet: {where}"
        )
    s = layout.specs[info.index]
    return ShardSpec(
        rows=s.n,
        chunk=s.chunk,
        length=s.length,
        world=g.world,
        group_name=g.group.group_name,
        divide=g.divide,
        predivide=bucket.predivide,
        param_dtype=bucket.param_dtype,
        reduce_dtype=bucket.reduce_dtype,
        local_dtype=info.dtype,
    )


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    if x.shape[0] == rows:
        return x
    pad = x.new_zeros((rows - x.shape[0], *x.shape[1:]))
    return torch.cat([x, pad])


def gather(local: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    """The full parameter from this rank's rows (one all-gather in the graph)."""
    x = local if local.dtype == spec.param_dtype else local.to(spec.param_dtype)
    x = _pad_rows(x, spec.chunk)
    out = _C10D.all_gather_into_tensor(x, spec.world, spec.group_name)
    out = _C10D.wait_tensor(out)
    return out if out.shape[0] == spec.rows else out.narrow(0, 0, spec.rows)


def reduce_scatter(full_grad: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    """This rank's rows of the data-parallel mean of ``full_grad`` (one reduce-scatter)."""
    g = full_grad if full_grad.dtype == spec.reduce_dtype else full_grad.to(spec.reduce_dtype)
    g = _pad_rows(g, spec.chunk * spec.world)
    if spec.predivide:
        g = g.div(spec.divide)
    out = _C10D.reduce_scatter_tensor(g, "sum", spec.world, spec.group_name)
    out = _C10D.wait_tensor(out)
    if not spec.predivide:
        out = out.div(spec.divide)
    if spec.length != spec.chunk:
        out = out.narrow(0, 0, spec.length)
    if out.dtype != spec.local_dtype:
        out = out.to(spec.local_dtype)
    return out.contiguous()


def is_collective(node: Any) -> bool:
    """Whether an FX node is a functional collective (not its wait)."""
    t = getattr(node, "target", None)
    ns = getattr(t, "namespace", None)
    return ns == "_c10d_functional" and "wait_tensor" not in str(t)


def count_collectives(gm: torch.fx.GraphModule) -> dict[str, int]:
    """Functional collectives in ``gm`` by op name (``all_gather_into_tensor``: 3)."""
    out: dict[str, int] = {}
    for n in gm.graph.nodes:
        if n.op == "call_function" and is_collective(n):
            name = n.target._schema.name.split("::")[-1]
            out[name] = out.get(name, 0) + 1
    return out
