"""Chunked cross-entropy (the ``output=chunked_cross_entropy`` override) vs the standard
head + ``F.cross_entropy``: peak memory and time of one forward+backward of the loss.

Run: ``uv run python apps/titan_train/benchmarks/chunked_ce.py`` (fp32, CPU, 2 threads).
Peak bytes are torch_remat's measured high-water mark of storages created during the step.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import torch_remat
from titan_train.components import chunked_cross_entropy_sum


class _Loss(torch.nn.Module):
    def __init__(self, vocab: int, dim: int, chunk_rows: int | None) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(vocab, dim) * 0.02)
        self.chunk_rows = chunk_rows

    def forward(self, h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.chunk_rows is None:
            return F.cross_entropy(F.linear(h, self.weight), y, reduction="sum")
        return chunked_cross_entropy_sum(h, self.weight, y, self.chunk_rows)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--chunk-rows", type=int, default=1024)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    h = torch.randn(a.tokens, a.dim, requires_grad=True)
    y = torch.randint(0, a.vocab, (a.tokens,))
    rows = []
    for name, chunk in (("standard", None), (f"chunked ({a.chunk_rows} rows)", a.chunk_rows)):
        m = torch_remat.measure(_Loss(a.vocab, a.dim, chunk), (h, y), loss_fn=lambda out: out)
        rows.append((name, m.peak_bytes, m.step_time_s))
    print(f"tokens {a.tokens}, dim {a.dim}, vocab {a.vocab}, fp32, {a.threads} threads")
    print(f"full logits: {a.tokens * a.vocab * 4 / 2**20:.0f} MiB")
    print(f"{'loss':24s} {'peak MiB':>10s} {'step ms':>9s}")
    for name, peak, t in rows:
        print(f"{name:24s} {peak / 2**20:10.1f} {t * 1e3:9.1f}")
    (_, p0, t0), (_, p1, t1) = rows
    print(f"chunked / standard: peak {p1 / p0:.3f}x, time {t1 / t0:.2f}x")


if __name__ == "__main__":
    main()
