"""Swap a Hugging Face Qwen3-MoE's sparse MoE blocks for dist_moe, then run expert parallel.

    torchrun --standalone --nproc-per-node 2 examples/hf_moe_swap.py

Every rank builds the same tiny random ``Qwen3MoeForCausalLM`` (nothing is downloaded),
computes logits, router logits and HF's load-balancing loss on its own batch, swaps each
sparse block for ``dist_moe``'s MoE (``swap_hf_moe_blocks`` maps HF's fused
``experts.gate_up_proj`` (E, 2I, H) to ``experts.w_gate``/``w_up`` and ``gate.weight`` to
``router.gate.weight``), shards the experts over the ranks with ``expert_parallel`` (each
rank keeps E / world_size experts; tokens travel by all-to-all), runs the same batch again
and checks that nothing changed. Then one training step shows the gradients flow.

Uses only torch, transformers and dist_moe. Exits non-zero if a check fails.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from dist_moe import expert_parallel, swap_hf_moe_blocks

NUM_EXPERTS = 8
TOLERANCE = 1e-5  # fp32; HF adds a token's experts in expert order, dist_moe in top-k order


def build_model() -> Qwen3MoeForCausalLM:
    config = Qwen3MoeConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=NUM_EXPERTS,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        router_aux_loss_coef=0.01,
    )
    torch.manual_seed(0)  # the same weights on every rank
    model = Qwen3MoeForCausalLM(config)
    with torch.no_grad():  # HF initialises routers to zero; random routers route for real
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(std=0.5)
    return model


def main() -> int:
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = build_model()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(100 + rank))

    with torch.no_grad():
        before = model(ids, labels=ids, output_router_logits=True)

    swapped = swap_hf_moe_blocks(model)
    for name in swapped:
        expert_parallel(model.get_submodule(name), group=None)  # default group = all ranks
    local_experts = model.get_submodule(swapped[0]).experts.w_gate.shape[0]

    after = model(ids, labels=ids, output_router_logits=True)
    logits_diff = (after.logits - before.logits).abs().max().item()
    router_diff = max(
        (a - b).abs().max().item()
        for a, b in zip(after.router_logits, before.router_logits, strict=True)
    )
    aux_diff = abs(after.aux_loss.item() - before.aux_loss.item())

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    after.loss.backward()
    expert_grad = model.get_submodule(swapped[0]).experts.w_gate.grad.abs().sum().item()
    optimizer.step()

    print(
        f"rank {rank}/{world_size}: swapped {len(swapped)} blocks, {local_experts} of "
        f"{NUM_EXPERTS} experts here; max |logits diff| {logits_diff:.2e}, max |router "
        f"logits diff| {router_diff:.2e}, |aux loss diff| {aux_diff:.2e}, "
        f"loss {after.loss.item():.4f}, expert grad sum {expert_grad:.3e}",
        flush=True,
    )
    ok = (
        max(logits_diff, router_diff, aux_diff) <= TOLERANCE
        and local_experts == NUM_EXPERTS // world_size
        and expert_grad > 0
    )
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    if "RANK" not in os.environ:
        sys.exit("run me with: torchrun --standalone --nproc-per-node 2 examples/hf_moe_swap.py")
    sys.exit(main())
