"""torch's own FSDP2 + torch_checkpointing: save on 2 ranks, load on 3 ranks and on 1 process.

    python examples/fsdp2_checkpoint.py

Two ranks train a small model sharded with ``fully_shard`` and save model + AdamW state
(DTensors) asynchronously. Three ranks then load that checkpoint into their own FSDP2 layout,
and one plain process loads it into an unsharded model and optimizer: every tensor equals
what was saved, bit for bit. Ranks are gloo processes on CPU here; on GPUs use NCCL and one
device per rank (``init_device_mesh("cuda", ...)``), nothing else changes.
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

STEP = 3


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)  # the same full weights for any number of ranks
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 40), torch.nn.GELU(), torch.nn.Linear(40, 10), torch.nn.LayerNorm(10)
    )
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def full(x):
    """A state dict with every DTensor gathered to a full CPU tensor (for the comparison)."""
    if isinstance(x, DTensor):
        return x.full_tensor().cpu()
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().clone()
    if isinstance(x, dict):
        return {k: full(v) for k, v in x.items()}
    if isinstance(x, list):
        return [full(v) for v in x]
    return x


def rank_main(rank: int, world: int, port: int, root: str, report: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # as torchrun does for several ranks per machine
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    model, opt = build()
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    state = {"model": model, "optim": opt}
    with CheckpointManager(root, keep_last=2) as ckpt:
        if world == 2:  # train a few steps, then save
            g = torch.Generator().manual_seed(rank)
            for _ in range(STEP):
                model(torch.randn(8, 16, generator=g)).square().mean().backward()
                opt.step()
                opt.zero_grad()
            handle = ckpt.save(STEP, state)  # returns once staged: training may go on
            handle.wait()  # this rank's files are written
        else:
            assert ckpt.load(state) == STEP  # resharded 2 -> 3 ranks, in place
    # Every rank takes part in gathering; rank 0 reports.
    snapshot = {"model": full(model.state_dict()), "optim": full(opt.state_dict())}
    if rank == 0:
        torch.save(snapshot, report)
    dist.barrier()
    dist.destroy_process_group()


def run_ranks(world: int, root: str) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    report = f"{root}-report-{world}.pt"
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=rank_main, args=(r, world, port, root, report)) for r in range(world)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs):
        sys.exit(f"a rank failed: exit codes {[p.exitcode for p in procs]}")
    return torch.load(report, weights_only=True)


def assert_equal(a, b, where: str) -> None:
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


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = os.path.join(tmp, "checkpoints")
        saved = run_ranks(2, root)
        on_three = run_ranks(3, root)
        assert_equal(saved, on_three, "3 ranks")
        # One plain process: an unsharded model and optimizer, no process group at all.
        model, opt = build()
        with CheckpointManager(root, read_only=True) as ckpt:
            ckpt.load({"model": model, "optim": opt})
        assert_equal(
            saved, {"model": full(model.state_dict()), "optim": full(opt.state_dict())}, "1"
        )
    n = sum(t.numel() for t in saved["model"].values())
    print(f"fsdp2_checkpoint: step {STEP}, {n} parameters + AdamW state equal on 2, 3 and 1 ranks")


if __name__ == "__main__":
    main()
