"""The overlapped runtime: per-bucket gather / free / re-gather / reduce driven by hooks.

Parameters as the user and the optimizer see them (``module.parameters()`` outside forward)
are the *local* shards (``ParamInfo.local``: plain tensors, possibly empty). During a
bucket's forward its modules hold *full* parameters instead (``ParamInfo.full``), views into
one flat buffer per bucket in the compute dtype. Gradients land on the full parameters;
a post-accumulate-grad hook counts them and, once the bucket is complete, issues the
bucket's asynchronous reduction (reduce-scatter / all-reduce / reduce-to-owner) and frees
its buffer. A callback queued on the autograd engine waits for every outstanding
reduction at the end of backward and writes the reduced gradients into ``local.grad``.

Freeing a bucket resizes the flat buffer's storage to zero bytes; gathering resizes it
back and fills it, so tensors saved for backward (which alias that storage) see the
re-gathered values. Collective writes go through ``flat.data`` (a fresh version counter), so
autograd's saved-tensor version check does not trip over the refill.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable
from torch.utils._pytree import tree_flatten, tree_map

from flexshard._ddp_guard import check_not_reduced_by_ddp, ddp_ignore_list, set_ddp_ignore_list
from flexshard._groups import GroupInfo
from flexshard._layout import CommStats, DeviceOnly, Layout, Pending
from flexshard.placements import MixedPrecision, Placement, Replicate

_FREE, _GATHERING, _GATHERED = 0, 1, 2

# id(local param) -> ParamInfo (entries removed when the parameter dies).
_REGISTRY: dict[int, ParamInfo] = {}


def register_param(info: ParamInfo) -> None:
    key = id(info.local)
    _REGISTRY[key] = info
    weakref.finalize(info.local, _REGISTRY.pop, key, None)


def param_info(param: torch.Tensor) -> ParamInfo | None:
    """The :class:`ParamInfo` of a local (sharded) parameter made by ``shard``, else None."""
    info = _REGISTRY.get(id(param))
    if info is not None and info.local is param:
        return info
    return None


class MemStats:
    """Bytes of parameter storage held by this rank: local shards + gathered buffers +
    in-flight gather buffers; ``peak`` is the high-water mark since the last reset."""

    def __init__(self) -> None:
        self.current = 0
        self.peak = 0

    def alloc(self, n: int) -> None:
        self.current += int(n)
        self.peak = max(self.peak, self.current)

    def free(self, n: int) -> None:
        self.current -= int(n)

    def reset_peak(self) -> None:
        self.peak = self.current


@dataclass(eq=False)
class ParamInfo:
    """What flexshard knows about one parameter. ``local`` is what the optimizer updates."""

    fqn: str
    fqns: list[str]
    locations: list[tuple[nn.Module, str]]
    shape: torch.Size  # global (for a DTensor: its local tensor's shape)
    dtype: torch.dtype  # dtype of the sharded master copy
    requires_grad: bool
    placement: Placement
    bucket_name: str = ""
    index: int = 0
    owner: int | None = None
    # set by ``shard`` once the bucket's layout exists (the layout needs every ParamInfo)
    local: nn.Parameter = field(init=False, repr=False)
    full: nn.Parameter | None = None
    acc_grad: torch.Tensor | None = None
    dtensor: tuple[Any, Any, Any, Any] | None = None  # (mesh, placements, shape, stride)
    bucket: Any = field(default=None, repr=False)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def group(self) -> Any:
        return self.bucket.state.g.group

    def local_chunks(self) -> list[tuple[tuple[int, ...], torch.Tensor]]:
        """(global offset, tensor) of every chunk of this parameter held here."""
        return self.bucket.layout.local_chunks(self.index, self.local.detach())

    def holds_anything(self) -> bool:
        return self.bucket.layout.holds_anything(self.index)


class BucketRuntime:
    def __init__(
        self,
        state: FlexShardState,
        index: int,
        name: str,
        placement: Placement,
        quantize: str | None,
        infos: list[ParamInfo],
        scope: nn.Module,
        is_root_scope: bool,
        layout: Layout,
    ) -> None:
        self.state = state
        self.index = index
        self.name = name
        self.placement = placement
        self.quantize = quantize
        self.infos = infos
        self.scope = scope
        self.is_root_scope = is_root_scope
        self.layout = layout
        mp = state.mp
        master = infos[0].dtype
        self.param_dtype = mp.param_dtype or master
        self.reduce_dtype = mp.reduce_dtype or self.param_dtype
        self.predivide = torch.finfo(self.reduce_dtype).bits < 32
        self.alias = isinstance(placement, Replicate) and all(
            i.dtype == self.param_dtype and i.dtensor is None for i in infos
        )
        self.flat: torch.Tensor | None = None
        self.status = _FREE
        self.pending: Pending | None = None
        self.ready = 0
        self.num_grad = sum(1 for i in infos if i.requires_grad)
        self.all_grad = self.num_grad == len(infos)
        self.backward_started = False
        self.backward_done = False

    def __repr__(self) -> str:
        return f"Bucket({self.name!r}, {self.placement}, {len(self.infos)} params)"

    # -- full parameters -----------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.infos[0].local.device

    def _flat(self) -> torch.Tensor:
        """The gathered flat buffer (allocated by ``_alloc``)."""
        assert self.flat is not None, f"bucket {self.name!r}: flat buffer used before allocation"
        return self.flat

    def _flat_nbytes(self) -> int:
        return self.layout.full_numel * torch.empty((), dtype=self.param_dtype).element_size()

    def _make_full_params(self) -> None:
        for i, info in enumerate(self.infos):
            data = info.local.detach() if self.alias else self.layout.out_view(self._flat(), i)
            if info.dtensor is not None:
                from torch.distributed.tensor import DTensor

                mesh, placements, shape, stride = info.dtensor
                data = DTensor.from_local(
                    data, mesh, placements, run_check=False, shape=shape, stride=stride
                )
            full = nn.Parameter(data, requires_grad=info.requires_grad)
            if info.requires_grad:
                full.register_post_accumulate_grad_hook(
                    functools.partial(self.state._on_full_grad, self, info)
                )
            info.full = full

    def _alloc(self) -> None:
        if self.alias:
            if self.infos[0].full is None:
                self._make_full_params()
            for info in self.infos:
                full = info.full
                assert full is not None  # made above
                if full.data_ptr() != info.local.data_ptr():
                    full.data = info.local.detach()
            return
        nbytes = self._flat_nbytes()
        if self.flat is None or self.flat.device != self.device:
            self.flat = torch.empty(
                self.layout.full_numel, dtype=self.param_dtype, device=self.device
            )
            self._make_full_params()
        elif self.flat.untyped_storage().nbytes() == 0:
            self.flat.untyped_storage().resize_(nbytes)
        self.state.mem.alloc(nbytes)

    def gather_async(self) -> None:
        if self.status != _FREE:
            return
        if self.alias:
            self._alloc()
            self.status = _GATHERED
            return
        # Layouts that gather into a separate buffer get the full buffer only when that
        # arrives (wait_gather): a prefetched bucket then costs its receive buffer only.
        if self.layout.writes_flat_at_issue:
            self._alloc()
            target = self._flat().data
        else:
            target = DeviceOnly(self.device)
        locals_ = [info.local.detach() for info in self.infos]
        self.pending = self.layout.issue_gather(
            locals_, target, self.param_dtype, self.quantize, self.state.comm
        )
        self.state.mem.alloc(self.pending.transient_bytes)
        self.status = _GATHERING

    def wait_gather(self) -> None:
        if self.status == _GATHERING:
            p = self.pending
            assert p is not None  # set with _GATHERING
            if not self.layout.writes_flat_at_issue:
                self._alloc()
            self.layout.finish_gather(p, self._flat().data)
            self.state.mem.free(p.transient_bytes)
            self.pending = None
            self.status = _GATHERED

    def unshard(self) -> None:
        self.gather_async()
        self.wait_gather()

    def free(self) -> None:
        """Register the local shards again and drop the gathered buffer."""
        self.swap_out()
        if self.status == _FREE or self.alias:
            return
        self.wait_gather()
        self._flat().untyped_storage().resize_(0)
        self.state.mem.free(self._flat_nbytes())
        self.status = _FREE

    def swap_in(self) -> None:
        """Register the full parameters on their modules (while the bucket is in use by
        forward or backward: recomputation in backward finds them there too)."""
        for info in self.infos:
            for m, n in info.locations:
                m._parameters[n] = info.full

    def swap_out(self) -> None:
        for info in self.infos:
            for m, n in info.locations:
                m._parameters[n] = info.local

    # -- gradients -----------------------------------------------------------------------
    def _take_grads(self) -> list[torch.Tensor | None]:
        grads: list[torch.Tensor | None] = []
        for info in self.infos:
            g = None
            if info.full is not None and info.full.grad is not None:
                g = info.full.grad
                info.full.grad = None
                if info.dtensor is not None:
                    g = _dtensor_local_grad(g, info)
            if info.acc_grad is not None:
                g = info.acc_grad if g is None else info.acc_grad.add_(g)
                info.acc_grad = None
            grads.append(g)
        return grads

    def accumulate_locally(self, info: ParamInfo) -> None:
        """No-sync micro-step: move the full gradient into an accumulator in reduce dtype."""
        full = info.full
        g = None if full is None else full.grad
        if full is None or g is None:
            return
        full.grad = None
        if info.dtensor is not None:
            g = _dtensor_local_grad(g, info)
        if info.acc_grad is None:
            info.acc_grad = g.to(self.reduce_dtype, copy=True)
        else:
            info.acc_grad.add_(g)

    def reduce_async(self) -> None:
        grads = self._take_grads()
        p = self.layout.issue_reduce(
            grads, self.reduce_dtype, self.predivide, self.state.comm, self.device
        )
        self.state.pending_reduces.append((self, p))

    def finish_reduce(self, p: Pending) -> None:
        res = self.layout.finish_reduce(p, self.predivide)
        if self.layout.g.replicate_group is not None:
            self._sum_over_replicas(res)
        for info, g in zip(self.infos, res, strict=True):
            if not info.requires_grad:
                continue
            local = info.local
            if g is None:  # holds nothing of it (Owned elsewhere): an empty gradient, so that
                # optimizers step every parameter on every rank and their state agrees
                if local.grad is None:
                    local.grad = torch.zeros_like(local)
                continue
            g = g.to(local.dtype).contiguous()
            if local.grad is None:
                local.grad = g
            else:
                local.grad.add_(g)

    def _sum_over_replicas(self, grads: list[torch.Tensor | None]) -> None:
        """HSDP: add this rank's reduced shards to those of its replicas (one all-reduce per
        bucket; every replica holds the same layout, so the buffers agree in size)."""
        held = [g for g in grads if g is not None and g.numel()]
        if not held:
            return
        flat = torch.cat([g.reshape(-1) for g in held])
        dist.all_reduce(flat, group=self.layout.g.replicate_group)
        self.state.comm.add("all_reduce", flat.nbytes)
        offset = 0
        for g in held:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


def _dtensor_local_grad(g: torch.Tensor, info: ParamInfo) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    if isinstance(g, DTensor):
        assert info.dtensor is not None  # a DTensor gradient belongs to a DTensor parameter
        mesh, placements, _, _ = info.dtensor
        if tuple(g.placements) != tuple(placements):
            g = g.redistribute(mesh, placements)
        return g.to_local()
    return g


class FlexShardState:
    """Runtime state of one ``shard()``-ed module (``module.flexshard_state``)."""

    def __init__(
        self,
        root: nn.Module,
        g: GroupInfo,
        mp: MixedPrecision,
        reshard_after_forward: bool,
        prefetch: int,
    ) -> None:
        self.root = root
        self.g = g
        self.mp = mp
        self.reshard_after_forward = reshard_after_forward
        self.prefetch = prefetch
        self.buckets: list[BucketRuntime] = []
        self.infos: dict[str, ParamInfo] = {}  # canonical fqn -> info
        self.comm = CommStats()
        self.mem = MemStats()
        self.sync_grads = True
        self.forward_order: list[BucketRuntime] = []
        self.order_frozen = False
        self.recording = False
        self.callback_queued = False
        self.pending_reduces: deque[tuple[BucketRuntime, Pending]] = deque()
        self.max_inflight_reduces = 2
        self.handles: list[Any] = []
        self.keep_gathered = False  # no-sync micro-step without resharding: reuse next forward
        self.nested: list[FlexShardState] = []  # states of submodules sharded before this one
        self.ddp_allowed: weakref.WeakSet = weakref.WeakSet()  # DDPs seen not to reduce our params

    def all_states(self) -> list[FlexShardState]:
        """This state and those of nested sharded submodules, outermost first."""
        out: list[FlexShardState] = [self]
        for st in self.nested:
            out += st.all_states()
        return out

    def _sync_locals(self) -> None:
        """Adopt parameter objects that ``Module._apply`` replaced (``to_empty`` from meta,
        a move to another device type): the module's registration is the truth."""
        for b in self.buckets:
            for info in b.infos:
                m, n = info.locations[0]
                p = m._parameters.get(n)
                if p is not None and p is not info.local:
                    info.local = p
                    register_param(info)
                    for m2, n2 in info.locations[1:]:
                        m2._parameters[n2] = p
                if b.flat is not None and b.flat.device != info.local.device:
                    b.flat = None
                    b.status = _FREE

    # -- forward -------------------------------------------------------------------------
    @staticmethod
    def _in_backward() -> bool:
        return torch._C._current_graph_task_id() != -1

    def _root_pre_forward(self, module, args, kwargs):
        if self._in_backward():
            return None
        check_not_reduced_by_ddp(self)
        self._drain_reduces()
        if not self.order_frozen:
            self.forward_order = []
            self.recording = True
        if not self.keep_gathered:
            # Whatever is still gathered may predate an optimizer step: refresh it.
            for b in self.buckets:
                b.free()
        self.keep_gathered = False
        if self.mp.param_dtype is not None and self.mp.cast_forward_inputs:
            dt = self.mp.param_dtype

            def cast(x):
                if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dt:
                    return x.to(dt)
                return x

            return tree_map(cast, args), tree_map(cast, kwargs)
        return None

    def _root_post_forward(self, module, args, kwargs, output):
        if self.recording:
            self.recording = False
            self.order_frozen = True
        return None

    def _pre_forward(self, bucket: BucketRuntime, module, args, kwargs):
        in_bwd = self._in_backward()
        if not in_bwd:
            check_not_reduced_by_ddp(self)
        if self.recording and bucket not in self.forward_order:
            self.forward_order.append(bucket)
        bucket.unshard()
        bucket.swap_in()
        if not in_bwd and self.order_frozen and self.prefetch > 0:
            order = self.forward_order
            if bucket in order:
                i = order.index(bucket)
                for nb in order[i + 1 : i + 1 + self.prefetch]:
                    nb.gather_async()
        return None

    def _post_forward(self, bucket: BucketRuntime, module, args, kwargs, output):
        if self._in_backward():
            return None  # recomputation inside backward: keep the bucket gathered
        tensors = [
            t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad
        ]
        if torch.is_grad_enabled() and tensors:
            hook = functools.partial(self._pre_backward, bucket)
            for t in tensors:
                t.register_hook(hook)
            if self.reshard_after_forward and not bucket.is_root_scope:
                bucket.free()
        else:
            bucket.free()
        return None

    # -- backward ------------------------------------------------------------------------
    def _ensure_callback(self) -> None:
        if not self.callback_queued:
            self.callback_queued = True
            Variable._execution_engine.queue_callback(self._finalize_backward)

    def _pre_backward(self, bucket: BucketRuntime, grad: torch.Tensor) -> None:
        self._ensure_callback()
        if bucket.backward_started:
            return
        bucket.backward_started = True
        bucket.unshard()
        bucket.swap_in()
        if self.prefetch > 0 and bucket in self.forward_order:
            i = self.forward_order.index(bucket)
            n = 0
            for nb in reversed(self.forward_order[:i]):
                if n >= self.prefetch:
                    break
                if not nb.backward_started and not nb.backward_done:
                    nb.gather_async()
                    n += 1

    def _on_full_grad(self, bucket: BucketRuntime, info: ParamInfo, param: torch.Tensor) -> None:
        self._ensure_callback()
        if not self.sync_grads:
            bucket.accumulate_locally(info)
        bucket.ready += 1
        if bucket.ready == bucket.num_grad:
            bucket.backward_done = True
            if self.sync_grads:
                bucket.reduce_async()
                while len(self.pending_reduces) > self.max_inflight_reduces:
                    self._finish_one_reduce()
            if bucket.all_grad and (self.sync_grads or self.reshard_after_forward):
                bucket.free()

    def _finish_one_reduce(self) -> None:
        b, p = self.pending_reduces.popleft()
        b.finish_reduce(p)

    def _drain_reduces(self) -> None:
        while self.pending_reduces:
            self._finish_one_reduce()

    def _finalize_backward(self) -> None:
        for b in self.buckets:
            if not self.sync_grads:
                continue
            has_acc = any(i.acc_grad is not None for i in b.infos)
            if (0 < b.ready < b.num_grad) or (b.ready == 0 and has_acc):
                b.reduce_async()
        self._drain_reduces()
        # Accumulating without sync and without resharding: parameters cannot change before
        # the next forward (no optimizer step between micro-steps), so keep them gathered.
        self.keep_gathered = not self.sync_grads and not self.reshard_after_forward
        for b in self.buckets:
            if not self.keep_gathered:
                b.free()
            b.ready = 0
            b.backward_started = False
            b.backward_done = False
        self.callback_queued = False


# a mixin over nn.Module classes: type-check it as one
_ModuleBase = nn.Module if TYPE_CHECKING else object


class FlexShardModule(_ModuleBase):
    """Mixin added to the class of a module passed to :func:`flexshard.shard`."""

    flexshard_state: FlexShardState

    # Read by DistributedDataParallel's constructor before it broadcasts anything: raises
    # unless every flexshard parameter is ignored (see _ddp_guard).
    _ddp_params_and_buffers_to_ignore = property(ddp_ignore_list, set_ddp_ignore_list)

    def _apply(self, fn, recurse=True):
        ret = super()._apply(fn, recurse)
        self.flexshard_state._sync_locals()
        return ret

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        """``False``: following backwards accumulate full gradients locally, with no
        communication; the next backward with ``True`` reduces the accumulated sum. Applies to
        nested sharded submodules too."""
        for st in self.flexshard_state.all_states():
            st.sync_grads = bool(requires_gradient_sync)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Context manager form of ``set_requires_gradient_sync(False)``."""
        states = self.flexshard_state.all_states()
        prev = [st.sync_grads for st in states]
        for st in states:
            st.sync_grads = False
        try:
            yield
        finally:
            for st, flag in zip(states, prev, strict=True):
                st.sync_grads = flag

    def unshard(self) -> None:
        """Gather every bucket now and register the full parameters (e.g. before calling
        submodules by hand); ``reshard()`` undoes it."""
        for b in self.flexshard_state.buckets:
            b.gather_async()
        for b in self.flexshard_state.buckets:
            b.wait_gather()
            b.swap_in()

    def reshard(self) -> None:
        """Free every gathered bucket."""
        for b in self.flexshard_state.buckets:
            b.free()


_CLASS_CACHE: dict[type, type] = {}


def swap_class(module: nn.Module) -> None:
    cls = type(module)
    if cls not in _CLASS_CACHE:
        _CLASS_CACHE[cls] = type(f"FlexShard{cls.__name__}", (FlexShardModule, cls), {})
    module.__class__ = _CLASS_CACHE[cls]
