"""FP8 / MXFP8 / NVFP4 training in the app: the config's quantised GEMMs, flexshard's FP8 gather.

``apply_quantize`` swaps the model's linears and routed experts for titan_models' FP8 / MXFP8
/ NVFP4 (linears only) modules (``quantize.*``) on the meta model, before parallelisation (``parallelize`` calls it
first). ``check_low_precision`` runs every check on a throw-away meta model in ``build.resolve``, so a
glob that matches nothing, a dim the recipe cannot tile, a layout the FP8 GEMMs do not support
or a device without the kernels fails before any process group, allocation or file.

``fp8_gather_buckets`` (``flexshard.fp8_gather``) splits a flexshard bucket: the weights of
its FP8 linears go to a ``BlockShard((b, b))`` bucket gathered as e4m3 tiles with
power-of-two scales (``quantize="fp8_block_pow2"``), the rest keeps its placement. A
gathered weight is then e4m3 times a power of two per tile, so the GEMMs' MXFP8
quantisation of it (blocks of 32 inside a tile, along either dim) is exact: the weight is
rounded once per step, by the gather. FP8 per-tensor or per-row recipes re-quantise it
exactly except for elements below the smallest e4m3 normal of their coarser scale (which
direct quantisation would also put on the subnormal grid).
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import nn

import titan_models
from titan_train.config import JobConfig

__all__ = ["apply_quantize", "check_low_precision", "fp8_gather_buckets", "recipes"]


def recipes(
    cfg: JobConfig, *, emulate: bool = False
) -> tuple[titan_models.Float8Recipe | None, titan_models.Float8Recipe | None]:
    """The (linear, experts) recipes of ``cfg.quantize`` (None: high precision)."""
    q = cfg.quantize
    emulate = emulate or q.kernels == "emulated"

    def one(
        mode: Literal["none", "fp8_tensorwise", "fp8_rowwise", "mxfp8", "nvfp4"],
    ) -> titan_models.Float8Recipe | None:
        if mode == "none":
            return None
        return titan_models.Float8Recipe(mode, grad_dtype=q.grad_dtype, emulate=emulate)

    return one(q.linear), one(q.experts)


def apply_quantize(
    model: nn.Module, cfg: JobConfig, *, device: torch.device | None = None
) -> dict[str, str]:
    """Swap in the FP8 / MXFP8 modules ``cfg.quantize`` asks for (FQN -> recipe); with
    ``device``, first check that it can run them. ``ValueError`` naming the field."""
    from titan_models.components.scaled_mm import check_device_support

    # the fake backend has no driver to ask: it runs (and sizes) the emulation
    linear, experts = recipes(cfg, emulate=bool(cfg.comm.fake_world_size))
    if linear is None and experts is None:
        return {}
    for field, recipe, grouped in (("linear", linear, False), ("experts", experts, True)):
        if recipe is not None and device is not None:
            try:
                check_device_support(recipe, device, grouped=grouped)
            except ValueError as e:
                raise ValueError(f"quantize.{field}={recipe.mode!r}: {e}") from None
    q = cfg.quantize
    import dist_moe

    if experts is not None and not any(isinstance(m, dist_moe.MoE) for m in model.modules()):
        raise ValueError(
            f"quantize.experts={q.experts!r} but {cfg.model.family} has no routed experts"
        )
    return titan_models.quantize_modules(
        model, linear=linear, experts=experts, include=q.include, exclude=q.exclude
    )


def _fp8_weights(module: nn.Module) -> dict[int, tuple[str, torch.Tensor]]:
    """id -> (FQN, weight) of every FP8 linear's weight that no other module shares."""
    from titan_models.components import Float8Linear

    owners: dict[int, int] = {}
    for m in module.modules():
        for p in m.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    return {
        id(m.weight): (f"{fqn}.weight", m.weight)
        for fqn, m in module.named_modules()
        if isinstance(m, Float8Linear) and owners[id(m.weight)] == 1
    }


def check_low_precision(model: nn.Module, cfg: JobConfig, dims: Any) -> None:
    """Every check of ``cfg.quantize`` / ``cfg.flexshard`` against the layout ``dims`` and the
    meta ``model`` (which is quantised in place): ``ValueError`` naming the field."""
    quantized = cfg.quantize.linear != "none" or cfg.quantize.experts != "none"
    if quantized and dims.tp > 1:
        raise ValueError(
            f"quantize.linear={cfg.quantize.linear!r} / quantize.experts="
            f"{cfg.quantize.experts!r} with parallel.tp={dims.tp} is not supported yet (the FP8 "
            "GEMMs take local tensors, not DTensors): use parallel.tp=1"
        )
    if cfg.flexshard.fp8_gather and dims.dp_shard == 1:
        raise ValueError(
            "flexshard.fp8_gather needs parallel.dp_shard > 1 (it is the gather of the shards), "
            f"got parallel.dp_shard={dims.dp_shard}"
        )
    device = None
    if quantized and not cfg.comm.fake_world_size:
        from titan_train.device import resolve_device

        device = resolve_device(cfg.training.device)
    apply_quantize(model, cfg, device=device)
    if not cfg.flexshard.fp8_gather:
        return
    b = cfg.flexshard.fp8_block
    for fqn, w in _fp8_weights(model).values():
        if w.dim() != 2 or any(d % b for d in w.shape):
            raise ValueError(
                f"flexshard.fp8_block={b} does not tile {fqn} of shape {tuple(w.shape)}: both "
                f"dims must be divisible by it (use a smaller multiple of 32, or exclude the "
                f"module with quantize.exclude)"
            )


def fp8_gather_buckets(module: nn.Module, bucket: Any, cfg: JobConfig) -> list[Any]:
    """``bucket`` split into its FP8 linears' weights (BlockShard, fp8_block_pow2 gather) and
    the rest (its own placement); unchanged when it holds none."""
    import flexshard as fs

    fp8 = _fp8_weights(module)
    params = list(bucket.match)
    tiled = [p for p in params if id(p) in fp8]
    if not tiled:
        return [bucket]
    b = cfg.flexshard.fp8_block
    name = bucket.name or "bucket"
    out = [fs.Bucket(tiled, fs.BlockShard((b, b)), quantize="fp8_block_pow2", name=f"{name}.fp8")]
    rest = [p for p in params if id(p) not in fp8]
    if rest:
        out.append(fs.Bucket(rest, bucket.placement, name=bucket.name))
    return out
