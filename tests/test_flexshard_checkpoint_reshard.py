"""flexshard + torch_checkpointing, composed through the sharded-tensor protocol only.

Two ranks train a flexshard model (Shard(0), Owned and BlockShard buckets) with AdamW and save
its sharded model and optimizer state; three ranks (another split of every parameter) load
that checkpoint and take one more step. The result equals, bit for bit, one process doing the
same arithmetic (per-rank gradients added in rank order, ``reduce_order="rank"``), so the
optimizer state was resharded exactly, not only the weights.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

import flexshard as fs
from flexshard.testing import TinyTransformer, lm_batch
from titan_testing import run_distributed

VOCAB, DIM, HIDDEN, LAYERS, BATCH, SEQ, LR = 40, 16, 48, 2, 12, 6, 1e-2


def _model() -> TinyTransformer:
    torch.manual_seed(0)
    return TinyTransformer(vocab=VOCAB, dim=DIM, n_layers=LAYERS, n_heads=2, hidden=HIDDEN)


def _buckets(model: TinyTransformer) -> list[fs.Bucket]:
    return [
        fs.Bucket("layers.0.**", fs.Owned()),
        fs.Bucket(lambda f, p: f.startswith("layers.1.") and p.ndim == 2, fs.BlockShard((8, 8))),
        fs.Bucket(lambda f, p: f.startswith("layers.1.") and p.ndim != 2, fs.Shard(0)),
        fs.Bucket(lambda f, p: not f.startswith("layers."), fs.Shard(0)),
    ]


def _loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


class _Item:
    """A checkpoint item from a state-dict function and its loader."""

    def __init__(self, get, put) -> None:
        self.state_dict, self.load_state_dict = get, put


def _ranks(root: str, steps: range, load: bool) -> dict[str, torch.Tensor]:
    from torch_checkpointing import CheckpointManager

    rank, world = dist.get_rank(), dist.get_world_size()
    model = _model()
    fs.shard(model, buckets=_buckets(model), reduce_order="rank")
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    state = {
        "model": _Item(
            lambda: fs.sharded_state_dict(model),
            lambda sd: fs.load_sharded_state_dict(model, sd),
        ),
        "optim": _Item(
            lambda: (fs.init_optim_state(opt), fs.sharded_optim_state_dict(model, opt))[1],
            lambda sd: fs.load_sharded_optim_state_dict(model, opt, sd),
        ),
    }
    with CheckpointManager(root, async_mode="off") as ckpt:
        if load:
            ckpt.load(state)
        b = BATCH // world
        for step in steps:
            x, y = lm_batch(VOCAB, BATCH, SEQ, seed=step)
            _loss(model, x[rank * b : (rank + 1) * b], y[rank * b : (rank + 1) * b]).backward()
            opt.step()
            opt.zero_grad()
        if not load:
            ckpt.save(steps[-1] + 1, state)
    return fs.full_state_dict(model, rank0_only=False)


def _reference(worlds: list[int]) -> dict[str, torch.Tensor]:
    """One process: step i averages the gradients of ``worlds[i]`` slices, in rank order."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for step, world in enumerate(worlds):
        x, y = lm_batch(VOCAB, BATCH, SEQ, seed=step)
        b = BATCH // world
        grads = []
        for r in range(world):
            model.zero_grad()
            _loss(model, x[r * b : (r + 1) * b], y[r * b : (r + 1) * b]).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for i, p in enumerate(model.parameters()):
            p.grad = sum(g[i] for g in grads) / world
        opt.step()
        opt.zero_grad()
    return model.state_dict()


def test_two_rank_checkpoint_of_model_and_adamw_resumes_on_three_ranks_bitwise(tmp_path):
    root = str(tmp_path / "ckpt")
    run_distributed(_ranks, 2, root, range(0, 2), False, num_threads=1)
    got = run_distributed(_ranks, 3, root, range(2, 3), True, num_threads=1)
    torch.set_num_threads(1)  # the ranks' kernels
    want = _reference([2, 2, 3])
    for r in range(3):
        for k, v in want.items():
            assert torch.equal(got[r][k], v), k
