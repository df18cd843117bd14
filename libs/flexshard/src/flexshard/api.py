"""``flexshard.shard``: validate buckets, build layouts and local shards, install hooks."""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence
from typing import Any, Literal, cast

import torch
from torch import nn

from flexshard._groups import group_info
from flexshard._layout import make_layout
from flexshard._runtime import (
    BucketRuntime,
    FlexShardModule,
    FlexShardState,
    ParamInfo,
    register_param,
    swap_class,
)
from flexshard.fqn import fqn_matches
from flexshard.placements import BlockShard, Bucket, MixedPrecision, Owned, Placement, Shard

__all__ = ["default_buckets", "shard"]

_NS_STEPS = 5


def _has_forward(m: nn.Module) -> bool:
    return type(m).forward is not nn.Module.forward


def default_buckets(
    module: nn.Module,
    placement: Placement | None = None,
    *,
    ignored_params: Iterable[nn.Parameter] | set[int] = (),
) -> list[Bucket]:
    """One bucket per child block plus one for the rest (the root), like FSDP per-block
    wrapping. Blocks are the children of every ``nn.ModuleList`` / ``nn.ModuleDict`` in the
    tree (outermost ones); a module without any gets one bucket per direct child.
    ``ignored_params`` (parameters or their ``id``s) are left out of every bucket."""
    placement = placement if placement is not None else Shard(0)
    blocks: list[tuple[str, nn.Module]] = []

    def visit(m: nn.Module, prefix: str) -> None:
        for name, child in m.named_children():
            fq = f"{prefix}{name}"
            if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
                blocks.extend((f"{fq}.{n2}", blk) for n2, blk in child.named_children())
            else:
                visit(child, fq + ".")

    visit(module, "")
    if not blocks:
        blocks = list(module.named_children())
    seen: set[int] = {p if isinstance(p, int) else id(p) for p in ignored_params}
    buckets = []
    for fq, blk in blocks:
        ps = [p for p in blk.parameters() if id(p) not in seen]
        if ps:
            seen.update(id(p) for p in ps)
            buckets.append(Bucket(match=ps, placement=placement, name=fq))
    rest = [p for p in module.parameters() if id(p) not in seen]
    if rest:
        buckets.append(Bucket(match=rest, placement=placement, name="<root>"))
    return buckets


def _matches(match: Any, fqns: list[str], param: nn.Parameter) -> bool:
    if isinstance(match, str):
        return any(fqn_matches(match, f) for f in fqns)
    if isinstance(match, nn.Module):
        return any(p is param for p in match.parameters())
    if isinstance(match, torch.Tensor):
        return match is param
    if isinstance(match, (list, tuple, set, frozenset)):
        return any(_matches(m, fqns, param) for m in match)
    if callable(match):
        return any(bool(match(f, param)) for f in fqns)
    raise ValueError(
        f"flexshard.shard: Bucket.match must be a glob string, a module, a parameter, a list of "
        f"those, or a callable (fqn, param) -> bool; got {type(match).__name__}"
    )


def _ns_flops(shape: Sequence[int]) -> float:
    if len(shape) < 2:
        return float(math.prod(shape))
    a, b = shape[0], math.prod(shape[1:])
    m, n = min(a, b), max(a, b)
    return float(_NS_STEPS * (4 * m * m * n + 2 * m**3))


def _check_placement(fqn: str, shape: torch.Size, placement: Placement, world: int) -> None:
    nd = len(shape)
    if isinstance(placement, Shard):
        if not -nd <= placement.dim < nd:
            raise ValueError(
                f"flexshard.shard: parameter {fqn!r} of shape {tuple(shape)} cannot take "
                f"Shard(dim={placement.dim}): dim must be in [{-nd}, {nd - 1}]"
            )
    elif isinstance(placement, BlockShard):
        r, c = placement.block
        if nd != 2:
            raise ValueError(
                f"flexshard.shard: parameter {fqn!r} of shape {tuple(shape)} cannot take "
                f"BlockShard(block={placement.block}): BlockShard needs a 2-D parameter"
            )
        if shape[0] % r or shape[1] % c:
            raise ValueError(
                f"flexshard.shard: BlockShard(block={placement.block}) does not tile parameter "
                f"{fqn!r} of shape {tuple(shape)}: each dim must be divisible by the block's"
            )
    elif isinstance(placement, Owned) and placement.owner is not None and placement.owner >= world:
        raise ValueError(
            f"flexshard.shard: parameter {fqn!r} has Owned(owner={placement.owner}) but the "
            f"mesh has only {world} ranks (owner must be in [0, {world - 1}])"
        )


def shard(
    module: nn.Module,
    mesh: Any = None,
    *,
    buckets: Sequence[Bucket] | None = None,
    mp: MixedPrecision | None = None,
    reshard_after_forward: bool = True,
    prefetch: int = 1,
    ignored_params: Iterable[nn.Parameter] = (),
    reduce_order: Literal["backend", "rank"] = "backend",
    gradient_divide_factor: float | None = None,
) -> nn.Module:
    """Shard ``module``'s parameters over ``mesh`` (a 1-D DeviceMesh, a ProcessGroup or None
    for the default group; a 2-D DeviceMesh ``(replicate, shard)`` for HSDP), in place;
    returns ``module``.

    Each parameter must be matched by exactly one of ``buckets`` (default:
    :func:`default_buckets`). Afterwards ``module.parameters()`` are the local shards (hand
    them to any ``torch.optim`` optimizer), forward/backward gather and reduce per bucket,
    and the module gains ``set_requires_gradient_sync``, ``no_sync``, ``unshard``,
    ``reshard`` and ``flexshard_state``. ``ignored_params`` stay as they are: never gathered,
    never reduced, in no bucket (e.g. experts already sharded by expert parallelism, whose
    gradients are complete on their rank). ``reduce_order="rank"`` sums gradients in rank
    order (an all-to-all instead of a reduce-scatter; all-gather instead of all-reduce):
    bitwise the same sums on every backend and world size, the sums one process would make.
    ``gradient_divide_factor``: reduced gradients are divided by it (default: the number of
    data-parallel ranks, replicas included, i.e. an average; 1.0 gives the sum, for losses
    already normalised by the global token count).

    Submodules sharded by an earlier call (e.g. experts over their own mesh) keep their
    parameters: they are left out here, as FSDP2's nested ``fully_shard`` does, and
    ``set_requires_gradient_sync`` on the outer module reaches them.
    Every check happens before any communication.
    """
    if isinstance(module, FlexShardModule):
        raise ValueError("flexshard.shard: module is already sharded")
    sharded = [n for n, sub in module.named_modules() if isinstance(sub, FlexShardModule)]
    outermost = [n for n in sharded if not any(n.startswith(o + ".") for o in sharded)]
    nested = [module.get_submodule(n) for n in outermost]
    if gradient_divide_factor is not None and not (
        isinstance(gradient_divide_factor, (int, float)) and gradient_divide_factor > 0
    ):
        raise ValueError(
            f"flexshard.shard: gradient_divide_factor must be a number > 0 or None, got "
            f"{gradient_divide_factor!r}"
        )
    if reduce_order not in ("backend", "rank"):
        raise ValueError(
            f"flexshard.shard: reduce_order must be 'backend' or 'rank', got {reduce_order!r}"
        )
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(f"flexshard.shard: prefetch must be an int >= 0, got {prefetch!r}")
    if not isinstance(reshard_after_forward, bool):
        raise ValueError(
            f"flexshard.shard: reshard_after_forward must be a bool, got {reshard_after_forward!r}"
        )
    mp = mp if mp is not None else MixedPrecision()
    if not isinstance(mp, MixedPrecision):
        raise ValueError(f"flexshard.shard: mp must be a MixedPrecision, got {mp!r}")
    g = group_info(mesh)
    if gradient_divide_factor is not None:
        g.divide = float(gradient_divide_factor)
    ignored = {id(p) for p in ignored_params}
    ignored.update(id(p) for sub in nested for p in sub.parameters())
    if buckets is None:
        buckets = default_buckets(module, ignored_params=ignored)
    buckets = list(buckets)
    for i, b in enumerate(buckets):
        if not isinstance(b, Bucket):
            raise ValueError(f"flexshard.shard: buckets[{i}] must be a flexshard.Bucket, got {b!r}")
    names = [b.name or f"bucket{i}" for i, b in enumerate(buckets)]

    # Parameters with every place they are registered (tied parameters have several).
    params: dict[int, nn.Parameter] = {}
    fqns: dict[int, list[str]] = {}
    locs: dict[int, list[tuple[str, str]]] = {}
    for fqn, p in module.named_parameters(remove_duplicate=False):
        if id(p) in ignored:
            continue
        params.setdefault(id(p), p)
        fqns.setdefault(id(p), []).append(fqn)
        mod_path, _, attr = fqn.rpartition(".")
        locs.setdefault(id(p), []).append((mod_path, attr))
    if not params:
        raise ValueError("flexshard.shard: module has no parameters")

    # Match: every parameter in exactly one bucket.
    owner_bucket: dict[int, int] = {}
    members: list[list[int]] = [[] for _ in buckets]
    for pid, p in params.items():
        for bi, b in enumerate(buckets):
            if _matches(b.match, fqns[pid], p):
                if pid in owner_bucket:
                    j = owner_bucket[pid]
                    raise ValueError(
                        f"flexshard.shard: parameter {fqns[pid][0]!r} is matched by bucket "
                        f"{j} ({names[j]!r}) and bucket {bi} ({names[bi]!r}); every parameter "
                        f"must be matched by exactly one bucket"
                    )
                owner_bucket[pid] = bi
                members[bi].append(pid)
        if pid not in owner_bucket:
            raise ValueError(
                f"flexshard.shard: parameter {fqns[pid][0]!r} is matched by no bucket; every "
                f"parameter must be matched by exactly one bucket (add a catch-all bucket, or "
                f"start from flexshard.default_buckets(module))"
            )
    for bi, m in enumerate(members):
        if not m:
            raise ValueError(
                f"flexshard.shard: bucket {bi} ({names[bi]!r}, match={buckets[bi].match!r:.80}) "
                f"matches no parameter"
            )

    # Shapes, placements, dtypes.
    from torch.distributed.tensor import DTensor

    def local_view(p: nn.Parameter) -> torch.Tensor:
        return p.to_local() if isinstance(p, DTensor) else p

    for bi, b in enumerate(buckets):
        dtypes = set()
        for pid in members[bi]:
            t = local_view(params[pid])
            _check_placement(fqns[pid][0], t.shape, b.placement, g.world)
            dtypes.add(t.dtype)
            if not t.is_floating_point():
                raise ValueError(
                    f"flexshard.shard: parameter {fqns[pid][0]!r} has dtype {t.dtype}; only "
                    f"floating-point parameters can be sharded"
                )
        if len(dtypes) > 1 and mp.param_dtype is None:
            raise ValueError(
                f"flexshard.shard: bucket {bi} ({names[bi]!r}) mixes dtypes {sorted(map(str, dtypes))}; "
                f"set MixedPrecision(param_dtype=...) or split the bucket"
            )

    # Owners of Owned parameters: greedy largest-first to the least-loaded rank.
    loads = [0.0] * g.world
    owners: dict[int, int] = {}
    for bi, b in enumerate(buckets):
        pl = b.placement
        if not isinstance(pl, Owned):
            continue
        costs = []
        for pid in members[bi]:
            t = local_view(params[pid])
            c = float(t.numel() * t.element_size()) if pl.balance == "bytes" else _ns_flops(t.shape)
            costs.append((c, pid))
        if pl.owner is not None:
            for c, pid in costs:
                owners[pid] = pl.owner
                loads[pl.owner] += c
            continue
        for c, pid in sorted(costs, key=lambda x: -x[0]):
            r = min(range(g.world), key=lambda k: (loads[k], k))
            owners[pid] = r
            loads[r] += c

    # The module around each bucket's forward.
    scopes = []
    for bi in range(len(buckets)):
        scope = _scope(module, [loc for pid in members[bi] for loc in locs[pid]])
        if not _has_forward(scope):
            raise ValueError(
                f"flexshard.shard: bucket {bi} ({names[bi]!r}) has no module with a forward "
                f"around all its parameters (the root {type(module).__name__} has none): "
                f"shard a module whose forward runs them"
            )
        scopes.append(scope)

    # Build runtime.
    state = FlexShardState(module, g, mp, reshard_after_forward, prefetch)
    state.nested = [cast(FlexShardModule, sub).flexshard_state for sub in nested]
    root_has_forward = _has_forward(module)
    for bi, b in enumerate(buckets):
        infos: list[ParamInfo] = []
        for pid in members[bi]:
            p = params[pid]
            t = local_view(p)
            info = ParamInfo(
                fqn=fqns[pid][0],
                fqns=list(fqns[pid]),
                locations=[(module.get_submodule(mp_), attr) for mp_, attr in locs[pid]],
                shape=t.shape,
                dtype=t.dtype,
                requires_grad=p.requires_grad,
                placement=b.placement,
                bucket_name=names[bi],
                index=len(infos),
                owner=owners.get(pid),
            )
            if isinstance(p, DTensor):
                info.dtensor = (p.device_mesh, tuple(p.placements), p.shape, p.stride())
            infos.append(info)
        layout = make_layout(b.placement, infos, g)
        layout.rank_ordered = reduce_order == "rank"
        scope = scopes[bi]
        rt = BucketRuntime(
            state,
            bi,
            names[bi],
            b.placement,
            b.quantize,
            infos,
            scope,
            scope is module,
            layout,
        )
        for info, pid in zip(infos, members[bi], strict=True):
            info.bucket = rt
            full = local_view(params[pid]).detach()
            info.local = nn.Parameter(
                layout.local_from_full(info.index, full), requires_grad=info.requires_grad
            )
            register_param(info)
            state.infos[info.fqn] = info
            state.mem.alloc(info.local.numel() * info.local.element_size())
        state.buckets.append(rt)
    for rt in state.buckets:
        rt.swap_out()

    # Hooks.
    for rt in state.buckets:
        state.handles.append(
            rt.scope.register_forward_pre_hook(
                functools.partial(state._pre_forward, rt), with_kwargs=True
            )
        )
        state.handles.append(
            rt.scope.register_forward_hook(
                functools.partial(state._post_forward, rt), with_kwargs=True, always_call=True
            )
        )
    if root_has_forward:
        state.handles.append(
            module.register_forward_pre_hook(
                state._root_pre_forward, with_kwargs=True, prepend=True
            )
        )
        state.handles.append(
            module.register_forward_hook(state._root_post_forward, with_kwargs=True)
        )
    swap_class(module)
    cast(FlexShardModule, module).flexshard_state = state
    return module


def _scope(root: nn.Module, locations: list[tuple[str, str]]) -> nn.Module:
    """Deepest module containing every location whose forward exists (ModuleList has none)."""
    paths = [mp.split(".") if mp else [] for mp, _ in locations]
    common: list[str] = []
    for parts in zip(*paths, strict=False):
        if all(p == parts[0] for p in parts):
            common.append(parts[0])
        else:
            break
    while True:
        m = root.get_submodule(".".join(common))
        if _has_forward(m) or not common:
            return m
        common.pop()
