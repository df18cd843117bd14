"""One pipeline stage on this rank: its module, its in-flight microbatches, its backward.

Backward passes go through ``torch.autograd.backward`` (B, and W from the branch points), so
gradients land in ``.grad`` through the parameters' ``AccumulateGrad`` nodes and any
post-accumulate-grad hooks fire: a data-parallel wrapper that reduces gradients from those
hooks (flexshard, FSDP2) composes with the runtime.

Zero-bubble split: I computes the input gradient with ``retain_graph=True`` and, through
prehooks, keeps the gradients arriving at the autograd nodes where the weight-only branches
leave the input path; W then starts autograd from those nodes (``GradientEdge``) to reach the
parameters without redoing the input path. A stage whose input needs no gradient (the first
stage) does all its work in W.

CUDA-graph mode (``cuda_graph=True``): the stage's forward and backward are captured once for
the first microbatch's (shape, dtype) with ``torch.cuda.make_graphed_callables`` and replayed
for every later microbatch (launch overhead gone; inputs copied into the static buffers).
Fixed shape, one tensor in and no keyword inputs, B only (not the zero-bubble I/W split),
no hooks on the module when it is captured; the capture's warm-up runs the module three
times on the first microbatch (``.grad`` untouched). CUDA only: refused on other devices.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

__all__ = ["PipelineStage"]


@dataclass(slots=True)
class _SplitBackward:
    """What I leaves for W: the root, and the gradients caught at the weight branches."""

    output: torch.Tensor
    grad_output: torch.Tensor
    branches: list[tuple[Node, list[torch.Tensor]]]
    """(node on the input path, the leaves its off-path branches reach)."""
    grads: dict[Node, tuple[torch.Tensor | None, ...]] = field(default_factory=dict)


class PipelineStage:
    """One stage held by this rank: its module and the state of its in-flight microbatches.

    ``module`` is the ``nn.Module`` the stage runs (one tensor in, one tensor out);
    ``parameters()`` / ``named_parameters()`` are its module's, so an optimizer, gradient
    clipping or a state dict takes a stage like a module: ``AdamW(stage.parameters())``, or
    over every stage of this rank, ``AdamW(p for st in stages for p in st.parameters())``.
    """

    def __init__(
        self,
        module: nn.Module,
        stage_index: int,
        num_stages: int,
        group: dist.ProcessGroup | None = None,
        *,
        output_spec: Callable[[tuple[int, ...], torch.dtype], tuple[tuple[int, ...], torch.dtype]]
        | None = None,
        cuda_graph: bool = False,
    ) -> None:
        """``output_spec(input_shape, input_dtype) -> (output_shape, output_dtype)`` replaces
        the meta-device trial forward for modules that cannot run on meta tensors (sharded
        parameters gathered by hooks, DTensors). ``cuda_graph``: replay CUDA graphs of the
        forward and backward (see the module docstring)."""
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        if not isinstance(num_stages, int) or num_stages < 1:
            raise ValueError(f"num_stages must be an int >= 1, got {num_stages!r}")
        if not isinstance(stage_index, int) or not 0 <= stage_index < num_stages:
            raise ValueError(
                f"stage_index must be an int in [0, {num_stages}), got {stage_index!r}"
            )
        self.module = module
        """The module this stage runs."""
        self.stage_index = stage_index
        """Index of this stage in the whole pipeline (0 .. ``num_stages - 1``)."""
        self.num_stages = num_stages
        """Number of stages of the pipeline, over all ranks."""
        self.group = group
        """The pipeline's process group (None: the default group)."""
        self.output_spec = output_spec
        if not isinstance(cuda_graph, bool):
            raise ValueError(f"cuda_graph must be a bool, got {cuda_graph!r}")
        if cuda_graph:
            _check_cuda_module(module)
        self.cuda_graph = cuda_graph
        """Forward and backward replayed from CUDA graphs captured on the first microbatch."""
        self._graphed: Callable[..., Any] | None = None
        self._graphed_key: tuple[tuple[int, ...], torch.dtype, bool] | None = None
        self._params = [p for p in module.parameters() if p.requires_grad]
        self._inputs: dict[int, torch.Tensor] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self._split: dict[int, _SplitBackward] = {}
        self._shape_cache: dict[object, list[tuple[tuple[int, ...], torch.dtype]]] = {}
        # per stage-to-rank layout, the microbatch (shape, dtype) every rank agreed on last
        self._agreed_shape: dict[tuple[int, ...], tuple[tuple[int, ...], torch.dtype]] = {}

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        """The parameters of ``module`` (``module.parameters(recurse)``)."""
        return self.module.parameters(recurse)

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        """``module.named_parameters(...)``: names are relative to ``module``."""
        return self.module.named_parameters(prefix, recurse, remove_duplicate)

    @property
    def is_first(self) -> bool:
        """True for stage 0."""
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        """True for the last stage (it computes the loss)."""
        return self.stage_index == self.num_stages - 1

    def _forward(self, mb: int, x: torch.Tensor, kwargs: dict[str, object]) -> torch.Tensor:
        if not self.is_first and x.is_floating_point():
            x = x.detach().requires_grad_(True)
        y = self._graph(x, kwargs)(x) if self.cuda_graph else self.module(x, **kwargs)
        self._inputs[mb] = x
        self._outputs[mb] = y
        return y.detach()

    def _graph(self, x: torch.Tensor, kwargs: dict[str, object]) -> Callable[..., Any]:
        """The graphed module, captured on the first microbatch; later ones must match it."""
        if kwargs:
            raise ValueError(
                f"PipelineStage(cuda_graph=True) takes one tensor input, got keyword inputs "
                f"{sorted(kwargs)} (stage {self.stage_index})"
            )
        if x.device.type != "cuda":
            raise ValueError(
                f"PipelineStage(cuda_graph=True) needs CUDA tensors, got an input on {x.device}"
            )
        key = (tuple(x.shape), x.dtype, x.requires_grad)
        graphed = self._graphed
        if graphed is None:
            sample = torch.empty_like(x).copy_(x).requires_grad_(x.requires_grad)
            graphed = torch.cuda.make_graphed_callables(self.module, (sample,))
            self._graphed, self._graphed_key = graphed, key
        elif key != self._graphed_key:
            raise ValueError(
                f"PipelineStage(cuda_graph=True) replays graphs captured for microbatches of "
                f"(shape, dtype, requires_grad) {self._graphed_key}, got {key} (stage "
                f"{self.stage_index}): keep the microbatch shape fixed"
            )
        return graphed

    def _set_loss(self, mb: int, scaled_loss: torch.Tensor) -> None:
        self._outputs[mb] = scaled_loss

    def _backward(
        self, mb: int, grad_output: torch.Tensor | None, *, split: bool
    ) -> torch.Tensor | None:
        """B (``split=False``) or I: returns the input gradient (None on the first stage)."""
        y = self._outputs.pop(mb)
        gy = torch.ones_like(y) if grad_output is None else grad_output
        x = self._inputs.pop(mb)
        x_grad = x.requires_grad and not self.is_first
        if not split:
            torch.autograd.backward(y, gy)
            return x.grad if x_grad else None
        if self.cuda_graph:
            raise ValueError(
                "PipelineStage(cuda_graph=True) replays one captured backward: use a schedule "
                "without the zero-bubble I/W split (GPipe, 1F1B, Interleaved 1F1B)"
            )
        work = _SplitBackward(y, gy, [])
        self._split[mb] = work
        if not x_grad:
            return None
        x_node = get_gradient_edge(x).node
        work.branches = _weight_branches(y.grad_fn, x_node)
        handles = [n.register_prehook(_catch(work, n)) for n, _ in work.branches]
        try:
            (gx,) = torch.autograd.grad(y, x, gy, retain_graph=True)
        finally:
            for h in handles:
                h.remove()
        return gx

    def _backward_weight(self, mb: int) -> None:
        work = self._split.pop(mb)
        if not self._params:
            return
        complete = bool(work.branches) and all(n in work.grads for n, _ in work.branches)
        if not complete:  # no input path (first stage): one backward from the root
            torch.autograd.backward(work.output, work.grad_output)
            return
        # One autograd call per branch point: a single call from all of them would also send
        # each one's gradient down the input path to the branches below it, counting those
        # twice.
        for node, leaves in work.branches:
            edges, grads_out = [], []
            for i, g in enumerate(work.grads[node]):
                if g is not None:
                    edges.append(GradientEdge(node, i))
                    grads_out.append(g)
            if edges and leaves:
                torch.autograd.backward(edges, grads_out, retain_graph=True, inputs=leaves)


def device_of(stages: Iterable[PipelineStage]) -> torch.device:
    """The device of the stages' parameters (CPU for stages without any)."""
    for st in stages:
        for p in st.module.parameters():
            return p.device
    return torch.device("cpu")


def _check_cuda_module(module: nn.Module) -> None:
    devices = {t.device.type for t in [*module.parameters(), *module.buffers()]}
    if not torch.cuda.is_available() or devices - {"cuda"}:
        raise ValueError(
            "PipelineStage(cuda_graph=True) captures CUDA graphs: it needs a CUDA device and "
            f"the module on it (CUDA available: {torch.cuda.is_available()}, module on "
            f"{sorted(devices) or ['no tensors']}); leave cuda_graph=False elsewhere"
        )


def _catch(work: _SplitBackward, node: Node) -> Callable[..., None]:
    def hook(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
        work.grads[node] = tuple(grad_outputs)

    return hook


def _weight_branches(root: Node | None, x_node: Node) -> list[tuple[Node, list[torch.Tensor]]]:
    """Nodes on a path from ``root`` to the input that also feed something off that path,
    each with the leaves (parameters) that its off-path branches reach.

    The gradients arriving at these nodes during I are all W needs.
    """
    if root is None:
        return []
    reaches: dict[Node, bool] = {x_node: True}
    order: list[Node] = []
    stack: list[tuple[Node, bool]] = [(root, False)]
    while stack:  # iterative post-order DFS: deep models overflow Python recursion
        node, expanded = stack.pop()
        if expanded:
            reaches[node] = any(
                reaches.get(c, False) for c, _ in node.next_functions if c is not None
            )
            order.append(node)
            continue
        if node in reaches:
            continue
        reaches[node] = False
        stack.append((node, True))
        stack.extend(
            (c, False) for c, _ in node.next_functions if c is not None and c not in reaches
        )
    branches = []
    for n in order:
        if not reaches[n] or n is x_node:
            continue
        off_path = [c for c, _ in n.next_functions if c is not None and not reaches[c]]
        if off_path:
            branches.append((n, _leaves_under(off_path)))
    return branches


def _leaves_under(nodes: list[Node]) -> list[torch.Tensor]:
    """The tensors whose AccumulateGrad nodes are reachable from ``nodes``, in visit order."""
    leaves: dict[int, torch.Tensor] = {}
    seen: set[Node] = set()
    stack = list(reversed(nodes))
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if isinstance(variable, torch.Tensor):
            leaves.setdefault(id(variable), variable)
        stack.extend(c for c, _ in reversed(node.next_functions) if c is not None)
    return list(leaves.values())
