"""flexshard on a transformers Llama, checkpointed with torch_checkpointing, equal to one process.

    python examples/hf_llama_flexshard.py

``train_and_resume`` is what a trainer does on every rank: shard a ``LlamaForCausalLM`` with
``flexshard.shard`` (one bucket per decoder layer plus the rest, as FSDP wraps per block),
train with AdamW, save the sharded model and optimizer state with torch_checkpointing, then
build a fresh model and optimizer, resume from the checkpoint and train on. ``main`` runs it
on 2 gloo ranks and checks that the weights equal, bit for bit, one process training on the
whole batch (``reduce_order="rank"`` adds the ranks' gradients in rank order, the sum one
process makes), and that the loss fell. On GPUs use NCCL; nothing else changes. Needs
``titan-flexshard``, ``titan-checkpointing``, torch and transformers.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import LlamaConfig, LlamaForCausalLM

import flexshard as fs
from torch_checkpointing import CheckpointManager

VOCAB, BATCH, SEQ, LR = 64, 4, 12, 1e-2
STEPS, RESUME_AT = 4, 2  # train, save at step 2, resume in a fresh model, train to step 4


def build() -> LlamaForCausalLM:
    torch.manual_seed(0)  # the same full weights on every rank and in the reference
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def batch(step: int) -> torch.Tensor:
    """Rows counting up from a random start: a sequence the model can learn in a few steps."""
    starts = torch.randint(0, VOCAB, (BATCH, 1), generator=torch.Generator().manual_seed(step))
    return (starts + torch.arange(SEQ)) % VOCAB


def loss_of(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Summed next-token loss over ``tokens``, divided by the global batch's tokens."""
    logits = model(input_ids=tokens, use_cache=False).logits[:, :-1].flatten(0, 1)
    loss = torch.nn.functional.cross_entropy(logits, tokens[:, 1:].flatten(), reduction="sum")
    return loss / (BATCH * (SEQ - 1))


class Stateful:
    """A checkpoint item: what ``CheckpointManager`` saves and loads in place."""

    def __init__(self, get, put) -> None:
        self.state_dict, self.load_state_dict = get, put


def sharded(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    return {
        "model": Stateful(
            lambda: fs.sharded_state_dict(model), lambda sd: fs.load_sharded_state_dict(model, sd)
        ),
        "optim": Stateful(
            lambda: (fs.init_optim_state(opt), fs.sharded_optim_state_dict(model, opt))[1],
            lambda sd: fs.load_sharded_optim_state_dict(model, opt, sd),
        ),
    }


def train_and_resume(root: str) -> dict:
    """On every rank: the full weights and the global losses after ``STEPS`` steps, resumed
    from ``root`` halfway through."""
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)  # this rank's samples
    losses = []
    for steps in (range(RESUME_AT), range(RESUME_AT, STEPS)):
        model = build()  # a transformers LlamaForCausalLM, the same weights on every rank
        fs.shard(model, reduce_order="rank", gradient_divide_factor=1.0)  # loss is global
        opt = torch.optim.AdamW(model.parameters(), lr=LR)  # over this rank's shards
        with CheckpointManager(root) as ckpt:
            if steps.start:
                ckpt.load(sharded(model, opt))  # in place, into the fresh shards
            for step in steps:
                loss = loss_of(model, batch(step)[rows])
                loss.backward()
                opt.step()
                opt.zero_grad()
                loss = loss.detach()
                dist.all_reduce(loss)  # the global batch's loss, for the log
                losses.append(loss.item())
            if not steps.start:
                ckpt.save(RESUME_AT, sharded(model, opt))  # written in the background
        dist.barrier()  # closed: every rank's part is written before any rank resumes
    return {"model": fs.full_state_dict(model, rank0_only=False), "losses": losses}


def one_process() -> dict:
    """The reference: one process, no flexshard, gradients summed over the ranks' samples."""
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        tokens = batch(step)
        loss = loss_of(model, tokens[: BATCH // 2]) + loss_of(model, tokens[BATCH // 2 :])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"model": {k: v.detach() for k, v in model.state_dict().items()}, "losses": losses}


def check(got: dict, want: dict) -> None:
    assert got["model"].keys() == want["model"].keys()
    for name, w in want["model"].items():
        assert torch.equal(got["model"][name], w), f"{name} differs from one process"
    torch.testing.assert_close(got["losses"], want["losses"], rtol=1e-6, atol=0)
    assert got["losses"][-1] < got["losses"][0], f"loss did not fall: {got['losses']}"


def _rank(rank: int, port: int, root: str, report: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # as torchrun does for several ranks per machine
    dist.init_process_group("gloo", rank=rank, world_size=2)
    result = train_and_resume(root)
    if rank == 0:
        torch.save(result, report)
    dist.destroy_process_group()


def main() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        args = (port, os.path.join(tmp, "ckpt"), os.path.join(tmp, "report.pt"))
        procs = [mp.get_context("spawn").Process(target=_rank, args=(r, *args)) for r in (0, 1)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode for p in procs):
            sys.exit(f"a rank failed: exit codes {[p.exitcode for p in procs]}")
        got = torch.load(args[2], weights_only=True)
    torch.set_num_threads(1)  # the ranks' kernels
    check(got, one_process())
    print(f"hf_llama_flexshard: weights equal to one process; loss {got['losses']}")


if __name__ == "__main__":
    main()
