"""LoRA fine-tuning in the app: adapters swapped in on the meta model, checks, the merged export.

``apply_lora_config`` swaps in titan_models' adapters (``lora.*``) wherever the model is built
(``build_model``, ``parallelize``, the throw-away meta model of ``build.resolve``), after the
component overrides, so every layout shards and initialises the same adapted model: the
adapters start from ``training.seed`` on every path (``adapter_inits``), the base from its
initialisation or the HF checkpoint. Everything but the adapters is frozen: the optimizer sees
the adapters only, flexshard reduces only their gradients, and checkpoints hold the adapters
(and the model's buffers) only; the base is rebuilt on resume from the run's config
(``model.*``, ``training.seed`` or ``checkpoint.init_from_hf``, which may not change within a
LoRA run). The merged HF export is ``titan_train.lora_export``.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from torch import nn

import titan_models
from titan_train.config import JobConfig

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import ParallelStyle

__all__ = ["apply_lora_config", "check_lora", "lora_tensor_parallel"]


def apply_lora_config(model: nn.Module, cfg: JobConfig) -> list[str]:
    """Swap in the adapters ``cfg.lora`` asks for (no-op at rank 0); the swapped FQNs.
    ``ValueError`` naming the ``lora.`` field."""
    lora = cfg.lora
    if lora.rank == 0:
        return []
    try:
        return titan_models.apply_lora(
            model,
            rank=lora.rank,
            alpha=lora.alpha,
            targets=lora.targets,
            dropout=lora.dropout,
            seed=cfg.training.seed,
        )
    except ValueError as e:
        raise ValueError(str(e).replace("apply_lora: ", "lora.", 1)) from None


def check_lora(cfg: JobConfig, dims: Any) -> None:
    """Reject what LoRA does not support yet, naming the fields."""
    if cfg.lora.rank == 0:
        return
    if dims.tp > 1 and cfg.lora.dropout > 0:
        raise ValueError(
            f"lora.dropout={cfg.lora.dropout} with parallel.tp={dims.tp} is not supported yet "
            "(a dropout mask on tensor-parallel activations): use lora.dropout=0 or parallel.tp=1"
        )
    if cfg.quantize.linear != "none" or cfg.quantize.experts != "none":
        raise ValueError(
            f"lora.rank={cfg.lora.rank} with quantize.linear={cfg.quantize.linear!r} / "
            f"quantize.experts={cfg.quantize.experts!r} is not supported yet: use 'none'"
        )
    if cfg.optimizer.name != "adamw":
        raise ValueError(
            f"lora.rank={cfg.lora.rank} with optimizer.name={cfg.optimizer.name!r} is not "
            "supported yet: use 'adamw'"
        )


def lora_tensor_parallel(style: ParallelStyle) -> ParallelStyle:
    """The tensor-parallel style of a ``LoRALinear`` whose base gets ``style``: column-wise
    (base rows split) splits ``B``'s rows and replicates ``A``; row-wise (base columns split)
    splits ``A``'s columns and replicates ``B``, whose input is then a partial sum, reduced
    with the base's output. ``x Aᵀ Bᵀ`` is computed by DTensor on those layouts."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    # The class's own partition of the base weight and bias (style's is replaced below).
    if isinstance(style, ColwiseParallel):
        adapters = {"lora_a": Replicate(), "lora_b": Shard(0)}
        partition_base = functools.partial(type(style)._partition_linear_fn, style)
    elif isinstance(style, RowwiseParallel):
        adapters = {"lora_a": Shard(1), "lora_b": Replicate()}
        partition_base = functools.partial(type(style)._partition_linear_fn, style)
    else:
        raise TypeError(f"no LoRA form of tensor-parallel style {type(style).__name__}")

    def partition(name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        if "lora_a" not in module._parameters:  # called for every submodule (the dropout)
            return
        base = {n: module._parameters.pop(n) for n in list(adapters)}
        partition_base(name, module, device_mesh)  # weight and bias
        for n, p in base.items():
            assert p is not None, f"LoRALinear.{n} is a parameter"
            # src_data_rank: set on the style by parallelize_module before it partitions
            placement = [adapters[n]]
            dist = distribute_tensor(p, device_mesh, placement, src_data_rank=style.src_data_rank)
            module.register_parameter(n, nn.Parameter(dist, requires_grad=p.requires_grad))

    style._partition_linear_fn = partition
    return style
