"""Train an ``nn.Sequential`` through a titan_pipeline schedule with a plain torch optimizer.

    torchrun --standalone --nproc-per-node 2 examples/plain_pipeline.py [--schedules zbv 1f1b]

Each rank holds its part of the model (``build_stages``: one or two stages per rank, as the
schedule says), AdamW steps the parameters of those stages, and every rank gets the step's
losses (``broadcast_losses=True``). Rank 0 then trains the same model in one process, with
the same data and the same optimizer, and checks that losses and weights agree. CPU and
gloo, fp32; on GPUs use NCCL and move the model to ``LOCAL_RANK``'s device.
Needs only ``titan-pipeline`` and torch.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.functional import mse_loss

import titan_pipeline as tp

DIM, BATCH, MICROBATCHES, LR = 32, 16, 4, 1e-2


def make_model() -> nn.Sequential:
    """Eight Linear+GELU blocks and a head, the same weights on every rank (seeded)."""
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(DIM, DIM), nn.GELU()) for _ in range(8)]
    return nn.Sequential(*blocks, nn.Linear(DIM, 4))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and regression targets of one step, the same on every rank."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(BATCH, DIM, generator=g), torch.randn(BATCH, 4, generator=g)


def train_pipelined(name: str, steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """``steps`` AdamW steps of the pipelined model on this rank: the mean loss of each step
    (on every rank) and the trained weights of the stages this rank holds."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model()
    schedule = tp.build_schedule(name, num_ranks=world, num_microbatches=MICROBATCHES)
    tp.validate(schedule)  # build_schedule did; a schedule you write or edit needs it
    print(f"rank {rank}: {name}, simulated bubble {tp.simulate(schedule).bubble_ratio:.1%}")
    stages = tp.build_stages(list(model), schedule, rank)  # this rank's part of the model
    opt = torch.optim.AdamW([p for st in stages for p in st.parameters()], lr=LR)
    mean_losses = []
    for step in range(steps):
        x, y = batch(step)
        opt.zero_grad()
        losses = tp.run(
            schedule,
            stages,
            tp.split_microbatches(x, MICROBATCHES),  # used on the first stage's rank
            tp.split_microbatches(y, MICROBATCHES),  # used on the last stage's rank
            mse_loss,
            broadcast_losses=True,
        )
        opt.step()
        mean_losses.append(torch.stack(losses).mean().item())  # the same on every rank
    mine = {id(p) for st in stages for p in st.parameters()}
    weights = {n: p.detach().clone() for n, p in model.named_parameters() if id(p) in mine}
    return mean_losses, weights


def train_one_process(steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The reference: the same model, data and optimizer, no pipeline."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    mean_losses = []
    for step in range(steps):
        x, y = batch(step)
        opt.zero_grad()
        loss = mse_loss(model(x), y)  # mean over the batch = mean of the microbatch losses
        loss.backward()
        opt.step()
        mean_losses.append(loss.item())
    return mean_losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def compare(schedules: list[str], steps: int) -> dict[str, dict[str, float]]:
    """Train with each schedule on the process group, then against one process (rank 0).

    Returns, per schedule, the largest loss and weight differences and whether every rank
    saw the same losses; every rank returns the same report.
    """
    report = {}
    for name in schedules:
        losses, weights = train_pipelined(name, steps)
        every_rank: list = [None] * dist.get_world_size()
        dist.all_gather_object(every_rank, (losses, weights))
        merged = {n: w for _, part in every_rank for n, w in part.items()}
        ref_losses, ref_weights = train_one_process(steps)
        assert merged.keys() == ref_weights.keys(), sorted(merged.keys() ^ ref_weights.keys())
        report[name] = {
            "losses": losses,
            "same_losses_on_every_rank": all(r[0] == losses for r in every_rank),
            "max_loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)),
            "max_weight_diff": max(
                (merged[n] - w).abs().max().item() for n, w in ref_weights.items()
            ),
        }
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", nargs="+", default=["zbv"], choices=sorted(tp.SCHEDULES))
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    report = compare(args.schedules, args.steps)
    if dist.get_rank() == 0:
        for name, r in report.items():
            print(
                f"{name}: losses {[round(x, 5) for x in r['losses']]}, vs one process: "
                f"loss diff {r['max_loss_diff']:.1e}, weight diff {r['max_weight_diff']:.1e}"
            )
    dist.destroy_process_group()
    for name, r in report.items():  # fp32 sums in another order: equal to rounding
        assert r["same_losses_on_every_rank"], name
        assert r["max_loss_diff"] < 1e-5 and r["max_weight_diff"] < 1e-5, (name, r)
        assert r["losses"][-1] < r["losses"][0], (name, "the loss did not fall")


if __name__ == "__main__":
    main()
