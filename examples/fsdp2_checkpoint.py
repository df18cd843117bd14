"""torch's own FSDP2 + torch_checkpointing: save on 2 ranks, load on 3 ranks and on 1 process.

    python examples/fsdp2_checkpoint.py

``train_or_resume`` is what a trainer does on every rank: shard the model with
``fully_shard``, then resume from the newest checkpoint if there is one, else train and save
(asynchronously: ``save`` returns once the state is staged). ``main`` runs it on 2 gloo ranks
(they train and save), then on 3 (they resume, resharded), then loads the checkpoint into an
unsharded model in this process, and checks that every tensor of the model and of AdamW's
state equals what was saved, bit for bit. On GPUs use NCCL and ``init_device_mesh("cuda",
...)``; nothing else changes. Needs only ``titan-checkpointing`` and torch.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from torch_checkpointing import CheckpointManager

STEPS = 3


def build() -> torch.nn.Module:
    torch.manual_seed(0)  # the same full weights for any number of ranks
    return torch.nn.Sequential(
        torch.nn.Linear(16, 40), torch.nn.GELU(), torch.nn.Linear(40, 10), torch.nn.LayerNorm(10)
    )


def full(x):
    """``x`` with every DTensor gathered to a full CPU tensor (for the comparison)."""
    if isinstance(x, DTensor):
        return x.full_tensor().cpu()
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().clone()
    if isinstance(x, dict):
        return {k: full(v) for k, v in x.items()}
    if isinstance(x, list):
        return [full(v) for v in x]
    return x


def train_or_resume(root: str) -> dict:
    """On every rank of the current process group (any size): the full model and AdamW
    state after resuming from ``root``, or after training ``STEPS`` steps and saving there."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = build()
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # over the sharded parameters
    state = {"model": model, "optim": opt}
    with CheckpointManager(root, keep_last=2) as ckpt:
        if ckpt.latest_step() is not None:
            ckpt.load(state, fallback=True)  # resharded in place; older one if damaged
        else:
            g = torch.Generator().manual_seed(dist.get_rank())
            for step in range(1, STEPS + 1):
                model(torch.randn(8, 16, generator=g)).square().mean().backward()
                opt.step()
                opt.zero_grad()
                ckpt.save(step, state)  # returns once staged; written in the background
    return {"model": full(model.state_dict()), "optim": full(opt.state_dict())}


def load_one_process(root: str) -> dict:
    """The newest checkpoint in an unsharded model and optimizer, no process group at all."""
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with CheckpointManager(root, read_only=True) as ckpt:
        ckpt.load({"model": model, "optim": opt})
    return {"model": full(model.state_dict()), "optim": full(opt.state_dict())}


def assert_equal(a, b, where: str = "state") -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), (where, a.keys(), b.keys())
        for k in a:
            assert_equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_equal(x, y, f"{where}.{i}")
    else:
        assert a == b, (where, a, b)


def _rank(rank: int, world: int, port: int, root: str, report: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # as torchrun does for several ranks per machine
    dist.init_process_group("gloo", rank=rank, world_size=world)
    result = train_or_resume(root)
    if rank == 0:
        torch.save(result, report)
    dist.destroy_process_group()


def on_ranks(world: int, root: str) -> dict:
    """``train_or_resume(root)`` on ``world`` fresh gloo processes; rank 0's result."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    report = f"{root}-report-{world}.pt"
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(r, world, port, root, report)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs):
        sys.exit(f"a rank failed: exit codes {[p.exitcode for p in procs]}")
    return torch.load(report, weights_only=True)


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = os.path.join(tmp, "checkpoints")
        saved = on_ranks(2, root)  # trains and saves
        assert_equal(saved, on_ranks(3, root), "3 ranks")  # resumes
        assert_equal(saved, load_one_process(root), "1 process")
    n = sum(t.numel() for t in saved["model"].values())
    print(f"fsdp2_checkpoint: {n} parameters + AdamW state equal on 2, 3 and 1 ranks")


if __name__ == "__main__":
    main()
