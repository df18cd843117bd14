"""What graph mode can run: one clear error for what it cannot, before anything is built."""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn


def check_graph(cfg: Any, dims: Any) -> None:
    """``ValueError`` naming the field when ``cfg`` asks for something graph mode does not
    express yet (checked with the rest of the config, before any process group)."""
    from titan_train.graph.passes import resolve_passes

    c = cfg.compile
    if c.enabled and c.mode != "eager":
        raise ValueError(
            f"compile.enabled is the older spelling of compile.mode='local'; do not combine it "
            f"with compile.mode={c.mode!r}"
        )
    if c.mode != "graph":
        for name in ("dump_graph", "precompile"):
            if getattr(c, name):
                raise ValueError(f"compile.{name} needs compile.mode='graph' (got {c.mode!r})")
        return
    resolve_passes(c.passes)
    if not c.bucket_mb > 0:
        raise ValueError(f"compile.bucket_mb={c.bucket_mb} must be > 0")
    if not 0.0 <= c.memory_budget < 1.0:
        raise ValueError(f"compile.memory_budget={c.memory_budget} must be in [0, 1) (0: off)")
    if c.memory_budget and "memory" not in c.passes:
        raise ValueError("compile.memory_budget needs the memory pass in compile.passes")
    unsupported = {
        "parallel.pp": dims.pp,
        "parallel.ep": dims.ep,
        "parallel.cp": dims.cp,
        "parallel.dp_replicate": dims.dp_replicate,
    }
    for name, value in unsupported.items():
        if value > 1:
            raise ValueError(
                f"compile.mode='graph' does not support {name}={value} yet (pipeline, expert, "
                "context parallelism and HSDP stay eager: use compile.mode='eager' or 'local')"
            )
    if dims.tp > 1 and dims.dp_shard > 1:
        raise ValueError(
            f"compile.mode='graph' runs parallel.tp={dims.tp} or parallel.dp_shard="
            f"{dims.dp_shard}, not both yet"
        )
    if cfg.optimizer.name == "muon" or cfg.flexshard.fp8_gather:
        raise ValueError(
            "compile.mode='graph' shards with Shard(0) buckets only: optimizer.name='muon' "
            "(Owned matrices) and flexshard.fp8_gather are not supported yet"
        )
    from titan_train.device import device_type

    backend = cfg.model.attention_backend
    if backend == "varlen" or (backend == "auto" and device_type(cfg.training.device) != "cuda"):
        raise ValueError(
            f"compile.mode='graph' needs an attention backend that plans on the device: "
            f"model.attention_backend={backend!r} is varlen here (tiles planned on the host); "
            "use --model.attention-backend sdpa (or flex on CUDA)"
        )
    from titan_train.loaders import IMAGE_TEXT

    if cfg.data.source in IMAGE_TEXT:
        raise ValueError(f"compile.mode='graph' takes token batches only, not {cfg.data.source!r}")


def static_moe_shapes(model: nn.Module) -> None:
    """Dropless MoE dispatch sized by its upper bound (``static_shapes=True``) in every MoE
    layer: the row count no longer needs the host, the same tokens meet the same weights."""
    import dist_moe

    for m in model.modules():
        if isinstance(m, dist_moe.MoE):
            permute = dataclasses.replace(m.config.permute, static_shapes=True)
            m.config = dataclasses.replace(m.config, permute=permute)
            if hasattr(m.dispatcher, "config"):
                m.dispatcher.config = permute
