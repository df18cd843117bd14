"""DeepSeek-V3 parallelism plan (pure data)."""

from __future__ import annotations

from torch import nn

from ..plan import ModelPlan, decoder_plan
from .config import DeepSeekV3Config
from .model import DeepSeekV3


def plan(config: DeepSeekV3Config, model_cls: type[nn.Module] = DeepSeekV3) -> ModelPlan:
    """MLA tensor-parallel by heads: ``wq``/``wq_b`` and ``wkv_b`` colwise, ``wo`` rowwise; the
    latent projections and norms ``unsharded`` (every rank computes the latents its heads
    read; the column-wise layers after them sum their input gradients), except the rope
    key that ``wkv_a`` emits after its ``kv_lora_rank`` latent columns, which every local head
    reads directly (``head_shared_columns``: its gradient summed over the TP group);
    the dense blocks' SwiGLU as Llama; every MoE layer (trunk and MTP) expert-parallel; MTP
    modules on the last pipeline stage. ``model_cls``: the class a family built on this decoder
    uses (its parameters are counted per pipeline unit)."""
    c = config
    stacks = ("layers", *(("mtp",) if c.num_mtp_modules else ()))
    q = ("wq_b",) if c.q_lora_rank else ("wq",)
    q_latent = ("wq_a", "q_norm") if c.q_lora_rank else ()
    dense = c.first_k_dense > 0

    def each(names: tuple[str, ...], *, trunk_only: bool = False) -> tuple[str, ...]:
        return tuple(f"{s}.*.{n}" for s in (stacks[:1] if trunk_only else stacks) for n in names)

    mlp = ("feed_forward.w1", "feed_forward.w3") if dense else ()
    return decoder_plan(
        model_cls,
        config,
        colwise=(
            *each(tuple(f"attention.{n}" for n in (*q, "wkv_b"))),
            *each(mlp, trunk_only=True),
        ),
        rowwise=(
            *each(("attention.wo",)),
            *each(("feed_forward.w2",) if dense else (), trunk_only=True),
        ),
        replicated=(),
        unsharded=(
            *each(tuple(f"attention.{n}" for n in (*q_latent, "wkv_a", "kv_norm"))),
            *(("mtp.*.eh_proj",) if c.num_mtp_modules else ()),
        ),
        head_shared_columns=tuple((m, c.kv_lora_rank) for m in each(("attention.wkv_a",))),
        sequence_parallel=(
            ("mtp.*.attention_norm", "mtp.*.ffn_norm", "mtp.*.enorm", "mtp.*.hnorm", "mtp.*.norm")
            if c.num_mtp_modules
            else ()
        ),
        experts=(
            *(f"layers.{i}.feed_forward" for i in range(c.first_k_dense, c.num_layers)),
            *(f"mtp.{k}.feed_forward" for k in range(c.num_mtp_modules)),
        ),
        head_modules=("mtp",) if c.num_mtp_modules else (),
    )
