"""Where a rank trains and how it joins its job: the device from the accelerator API and
``LOCAL_RANK``, the process-group backend that goes with it, and the fake backend.

This is the one place in the app that names device types; everything else follows the
``torch.device`` returned here (or the tensors made on it).
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

FAKE_DEVICE = torch.device("meta")
"""Where tensors live in fake-backend mode. Fake *cuda* tensors cannot run a backward on a
machine without a GPU (the autograd engine asks the CUDA driver for streams, pytorch#92627),
so fake mode keeps its tensors on ``meta`` under ``FakeTensorMode`` (which still raises on
any mix with a real CPU tensor) while the mesh and every device-dependent choice use the
recipe's device type."""


def resolve_device(name: str) -> torch.device:
    """``training.device`` → this rank's device: ``auto`` = the accelerator if present, else
    the CPU; the device index is ``LOCAL_RANK``. ``ValueError`` for a device not present."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if name == "auto":
        accelerator = torch.accelerator.current_accelerator(check_available=True)
        name = accelerator.type if accelerator is not None else "cpu"
    if name == "cpu":
        return torch.device("cpu")
    if name != "cuda":
        raise ValueError(f"training.device={name!r} must be one of 'auto', 'cpu', 'cuda'")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if local_rank >= count:
        raise ValueError(
            f"training.device='cuda' but this machine has {count} CUDA device(s) and this "
            f"rank's LOCAL_RANK is {local_rank}; use --training.device cpu (or auto)"
        )
    return torch.device("cuda", local_rank)


def replica_device(index: int) -> torch.device:
    """Device of generator replica ``index``: the accelerator's device ``index`` modulo the
    visible ones (any accelerator type), else the CPU."""
    accelerator = torch.accelerator.current_accelerator(check_available=True)
    if accelerator is None:
        return torch.device("cpu")
    return torch.device(accelerator.type, index % torch.accelerator.device_count())


def device_type(name: str) -> str:
    """The device type a job's mesh uses (``auto`` resolved on this machine)."""
    return resolve_device(name).type if name == "auto" else name


def backend_for(device: torch.device) -> str:
    """The process-group backend of ``device``: NCCL for CUDA, gloo for the CPU."""
    return "nccl" if device.type == "cuda" else "gloo"


def init_process_group(device: torch.device, timeout_s: float) -> None:
    """Join the job ``torchrun`` describes (a no-op for one process or an existing group)."""
    if int(os.environ.get("WORLD_SIZE", "1")) == 1 or dist.is_initialized():
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL's communicator and streams belong to this device
    dist.init_process_group(
        backend_for(device),
        timeout=datetime.timedelta(seconds=timeout_s),
        device_id=device if device.type == "cuda" else None,
    )


def init_fake_process_group(world_size: int, rank: int = 0) -> None:
    """Rank ``rank`` of a ``world_size``-rank job whose collectives do nothing (fake
    backend)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise ValueError(
            "comm.fake_world_size needs a process without a process group (do not combine "
            "it with --nproc or torchrun)"
        )
    dist.init_process_group(
        "cpu:fake,cuda:fake,meta:fake", store=FakeStore(), rank=rank, world_size=world_size
    )


def free_memory_bytes(device: torch.device) -> int:
    """Bytes this rank can still allocate on ``device`` (CUDA: free device memory; CPU: the
    kernel's MemAvailable shared by the ranks of this machine)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024 // local
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // local
