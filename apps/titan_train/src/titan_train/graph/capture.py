"""Capture one training step (forward, loss, backward and the gradients' reduction) as one
FX graph with ``make_fx``.

The traced function takes this rank's local parameters, the model's buffers, the loss scale
and the micro-batches' tensors; it gathers sharded parameters (functional all-gathers), runs
``loss_sum`` on every micro-batch under ``torch.func.functional_call``, takes the gradients
with ``torch.autograd.grad`` (so the backward is traced into the same graph: the joint
graph), accumulates them over the micro-batches as eager accumulation does, and reduces the
sharded ones (functional reduce-scatters). Outputs: the step's summed loss and one gradient
per trainable parameter, in the order of ``StepSignature.params``.

The graph is not functionalised: in-place updates of buffers (MoE token counts) stay in-place nodes on the
buffers, which are graph inputs, so running the graph updates the app's buffers.
Tensor-parallel parameters enter as their local tensors and are wrapped back into DTensors
inside the graph (``DTensor.from_local``): DTensor's redistributions become functional
collectives in the graph. Host-side input checks (the document-id order check) are run by
the runner before each graph call and skipped while tracing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from titan_train.data.packing import Batch
from titan_train.graph.collectives import ShardSpec, gather, reduce_scatter, shard_spec

BATCH_FIELDS = ("input_ids", "labels", "document_ids", "positions")


@dataclass
class StepSignature:
    """The inputs and outputs of a step graph, as the runner binds them."""

    params: list[nn.Parameter]
    """This rank's parameters (each once), in graph-input order."""
    names: list[str]
    buffers: list[torch.Tensor]
    buffer_names: list[str]
    shards: list[ShardSpec | None]
    """Per parameter: its flexshard layout, None when it is not sharded."""
    dtensors: list[tuple[Any, Any, Any, Any] | None]
    """Per parameter: (mesh, placements, shape, stride) of a DTensor, else None."""
    trainable: list[int]
    """Indices into ``params`` of the parameters that get a gradient (graph outputs 1...)."""

    def inputs(self, scale: torch.Tensor, micro: Sequence[Batch]) -> list[torch.Tensor]:
        """The flat graph inputs of one step."""
        local = [_local(p).detach() for p in self.params]
        tensors = [getattr(mb, f) for mb in micro for f in BATCH_FIELDS]
        return [*local, *self.buffers, scale, *tensors]


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


def signature(model: nn.Module) -> StepSignature:
    """Parameters, buffers and layouts of ``model`` (one part: no pipeline)."""
    from torch.distributed.tensor import DTensor

    named = list(model.named_parameters())
    params = [p for _, p in named]
    buffers = list(model.named_buffers())
    dtensors = [
        (p.device_mesh, tuple(p.placements), p.shape, p.stride())
        if isinstance(p, DTensor)
        else None
        for p in params
    ]
    return StepSignature(
        params=params,
        names=[n for n, _ in named],
        buffers=[b for _, b in buffers],
        buffer_names=[n for n, _ in buffers],
        shards=[shard_spec(p) for p in params],
        dtensors=dtensors,
        trainable=[i for i, p in enumerate(params) if p.requires_grad],
    )


class _LossOf(nn.Module):
    """``loss_sum(model, batch) * scale`` as a module, for ``functional_call``."""

    def __init__(self, model: nn.Module, cfg: Any) -> None:
        super().__init__()
        self.model = model
        self.cfg = cfg

    def forward(self, mb: Batch, scale: torch.Tensor) -> torch.Tensor:
        from titan_train.losses import autocast, loss_sum

        with autocast(self.cfg, mb.input_ids.device):
            return loss_sum(self.model, mb) * scale


def step_function(model: nn.Module, cfg: Any, sig: StepSignature, num_micro: int) -> Any:
    """The Python function ``make_fx`` traces (flat tensors in, flat tensors out)."""
    wrapper = _LossOf(model, cfg)
    n_p, n_b = len(sig.params), len(sig.buffers)

    def step(*flat: torch.Tensor) -> list[torch.Tensor | None]:
        local, bufs = flat[:n_p], flat[n_p : n_p + n_b]
        scale = flat[n_p + n_b]
        data = flat[n_p + n_b + 1 :]
        leaves: list[torch.Tensor] = []
        full: dict[str, torch.Tensor] = {}
        for i, (name, t) in enumerate(zip(sig.names, local, strict=True)):
            spec, dt = sig.shards[i], sig.dtensors[i]
            leaf = gather(t, spec) if spec is not None else t
            leaf = leaf.detach().requires_grad_(sig.params[i].requires_grad)
            leaves.append(leaf)
            value = leaf
            if dt is not None:
                from torch.distributed.tensor import DTensor

                mesh, placements, shape, stride = dt
                value = DTensor.from_local(
                    leaf, mesh, placements, run_check=False, shape=shape, stride=stride
                )
            full[f"model.{name}"] = value
        for name, b in zip(sig.buffer_names, bufs, strict=True):
            full[f"model.{name}"] = b
        mark("gather", 0)
        wanted = [leaves[i] for i in sig.trainable]
        total = None
        grads: list[torch.Tensor | None] = [None] * len(wanted)
        k = len(BATCH_FIELDS)
        for m in range(num_micro):
            mb = Batch(*data[m * k : (m + 1) * k])  # pyrefly: ignore[bad-argument-type]  # traced fields in Batch's order
            loss = torch.func.functional_call(wrapper, full, (mb, scale), strict=False)
            mark("fwd", m)
            new = torch.autograd.grad(loss, wanted, allow_unused=True)
            for j, g in enumerate(new):
                if g is not None:
                    before = grads[j]
                    grads[j] = g if before is None else before + g
            loss = loss.detach()
            total = loss if total is None else total + loss
            mark("bwd", m)
        out: list[torch.Tensor | None] = [total]
        for j, i in enumerate(sig.trainable):
            g, spec = grads[j], sig.shards[i]
            if g is None and spec is not None:  # flexshard reduces zeros for a missing one
                g = torch.zeros_like(leaves[i])
            out.append(reduce_scatter(g, spec) if spec is not None and g is not None else g)
        mark("reduce", 0)
        return out

    return step


def mark(phase: str, micro: int) -> None:
    """Tag the graph nodes traced since the last mark with ``phase`` (``gather``, ``fwd``,
    ``bwd``, ``reduce``) and the micro-batch index: the passes use it to tell activations
    (forward nodes used by the backward) from the rest."""
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    mode = get_proxy_mode()
    if mode is None:
        return
    for n in reversed(mode.tracer.graph.nodes):
        if "phase" in n.meta:
            break
        n.meta["phase"] = phase
        n.meta["micro"] = micro


@contextlib.contextmanager
def tracing_context(model: nn.Module) -> Iterator[None]:
    """While tracing: flexshard's module hooks are off (the graph gathers and reduces
    itself) and host-side input checks are skipped (the runner runs them eagerly)."""
    saved = []
    for state in _flexshard_states(model):
        for h in state.handles:
            refs = h.hooks_dict_ref if isinstance(h.hooks_dict_ref, tuple) else (h.hooks_dict_ref,)
            for ref in refs:
                d = ref()
                if d is not None and h.id in d:
                    saved.append((d, h.id, d[h.id]))
    order = {id(d): list(d.items()) for d, _, _ in saved}
    dicts = {id(d): d for d, _, _ in saved}
    import titan_models.components.attention_metadata as meta

    check = meta.check_document_ids
    try:
        for d, key, _ in saved:
            d.pop(key, None)
        setattr(meta, "check_document_ids", lambda ids: ids)  # noqa: B010 (a staticmethod slot)
        yield
    finally:
        setattr(meta, "check_document_ids", check)  # noqa: B010
        for key, d in dicts.items():
            d.clear()
            d.update(order[key])


def host_checks(micro: Sequence[Batch]) -> None:
    """The checks ``tracing_context`` skips, run eagerly on a step's batch."""
    import titan_models.components.attention_metadata as meta

    for mb in micro:
        meta.check_document_ids(mb.document_ids)


def _flexshard_states(model: nn.Module) -> list[Any]:
    out = []
    for m in model.modules():
        st: Any = getattr(m, "flexshard_state", None)
        if st is not None and all(st is not o for o in out):
            out += [s for s in st.all_states() if all(s is not o for o in out)]
    return out


def trace_step(
    model: nn.Module, cfg: Any, sig: StepSignature, inputs: list[torch.Tensor], num_micro: int
) -> torch.fx.GraphModule:
    """The step graph for inputs shaped like ``inputs``. Traced on real tensors (model code
    may cache tensors it computes, which fake tensors would poison): the buffers are cloned
    for the trace, so that their in-place updates do not happen twice, and the random state
    is restored after it."""
    from torch.fx.experimental.proxy_tensor import make_fx

    fn = step_function(model, cfg, sig, num_micro)
    n_p, n_b = len(sig.params), len(sig.buffers)
    inputs = list(inputs)
    inputs[n_p : n_p + n_b] = [b.clone() for b in inputs[n_p : n_p + n_b]]
    devices = sorted({str(t.device) for t in inputs if t.device.type not in ("cpu", "meta")})
    with tracing_context(model), torch.random.fork_rng(devices=devices):
        gm = make_fx(fn, tracing_mode="real")(*inputs)
    return gm
