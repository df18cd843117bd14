"""Remat policies on a Llama-like stack vs torch.utils.checkpoint full checkpointing.

    uv run python libs/torch_remat/benchmarks/llama_stack.py [--layers 8 --dim 192 --seq 128]

For each policy: saved-activation bytes, peak bytes and step time (forward + loss + backward)
from ``torch_remat.measure``, side by side with wrapping every block in
``torch.utils.checkpoint.checkpoint(use_reentrant=False)`` directly. Prints ratios to that
baseline, marks the Pareto front over (peak bytes, step time) and checks the goal: a policy at
<= Full's memory + 20 % with <= 0.85x Full's step time. fp32 on CPU (see ENVIRONMENT.md).
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F
from torch import nn

import torch_remat as tr


class _Attention(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x_BSD: torch.Tensor, cos_SH: torch.Tensor, sin_SH: torch.Tensor):
        B, S, _ = x_BSD.shape
        q = self.wq(x_BSD).view(B, S, self.heads, self.head_dim).transpose(1, 2)
        k = self.wk(x_BSD).view(B, S, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x_BSD).view(B, S, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = _rope(q, cos_SH, sin_SH), _rope(k, cos_SH, sin_SH)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.wo(o.transpose(1, 2).reshape(B, S, -1))


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class _Block(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, hidden: int) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim)
        self.attention = _Attention(dim, heads, kv_heads)
        self.ffn_norm = nn.RMSNorm(dim)
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x, cos, sin):
        x = x + self.attention(self.attention_norm(x), cos, sin)
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Llama(nn.Module):
    """Llama 3 shape: RMSNorm, RoPE, GQA attention, SwiGLU, untied output head."""

    def __init__(self, *, vocab: int, dim: int, layers: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        hidden = 256 * math.ceil(int(8 * dim / 3) / 256)
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(_Block(dim, heads, kv_heads, hidden) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)
        self.head_dim = dim // heads

    def forward(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        S = tokens_BS.shape[1]
        freqs = torch.outer(
            torch.arange(S, dtype=torch.float32),
            1.0 / 10000 ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim),
        )
        cos, sin = freqs.cos(), freqs.sin()
        x = self.tok_embeddings(tokens_BS)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.output(self.norm(x))


def _torch_checkpoint_every_block(model: Llama) -> None:
    """The peer: every block under torch.utils.checkpoint, the way most trainers do it."""
    for block in model.layers:
        inner = block.forward
        block.forward = lambda *a, _f=inner: torch.utils.checkpoint.checkpoint(
            _f, *a, use_reentrant=False
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dim", type=int, default=192)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    def build() -> Llama:
        torch.manual_seed(0)
        return Llama(
            vocab=args.vocab,
            dim=args.dim,
            layers=args.layers,
            heads=args.heads,
            kv_heads=args.kv_heads,
        )

    tokens = torch.randint(0, args.vocab, (args.batch, args.seq))
    targets = torch.randint(0, args.vocab, (args.batch, args.seq))

    def loss_fn(logits: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    probe = build()
    plan = tr.plan(probe, (tokens,), 0.5)
    # The tightest budget the goal allows: Full's saved bytes + 20 %.
    full_plus_20 = int(1.2 * plan.min_bytes)
    configs = [
        ("none", None),
        ("torch.utils.checkpoint full", "peer"),
        ("Full", tr.Full()),
        ("Selective(matmul, attention)", tr.Selective()),
        ("Selective(every other matmul)", tr.Selective(matmul_every=2)),
        ("EveryNth(2, Full)", tr.EveryNth(2, tr.Full())),
        ("Budget(50%)", tr.Budget(0.5)),
        ("Budget(Full + 20%)", tr.Budget(full_plus_20)),
        ("Offload (CPU: copy only)", tr.Offload()),
    ]
    models = []
    for name, policy in configs:
        model = build()
        if policy == "peer":
            _torch_checkpoint_every_block(model)
        elif policy is not None:
            tr.apply(model, policy, sample_inputs=(tokens,))
        models.append((name, model))
    # Round-robin, fastest of the rounds: on a shared machine load drifts over minutes, and
    # timing the configurations one after another would compare different loads.
    best: dict[str, tr.Measurement] = {}
    for r in range(args.rounds):
        for name, model in models:
            m = tr.measure(model, (tokens,), loss_fn=loss_fn, steps=1, warmup=1 if r == 0 else 0)
            if name not in best or m.step_time_s < best[name].step_time_s:
                best[name] = m
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    rows = [(name, best[name]) for name, _ in models]

    peer = dict(rows)["torch.utils.checkpoint full"]
    full = dict(rows)["Full"]
    mib = 2.0**20

    def dominated(m: tr.Measurement) -> bool:
        return any(
            o.peak_bytes <= m.peak_bytes
            and o.step_time_s <= m.step_time_s
            and (o.peak_bytes, o.step_time_s) != (m.peak_bytes, m.step_time_s)
            for _, o in rows
        )

    print(
        f"\nLlama-like stack: {args.layers} layers, dim {args.dim}, {args.heads}/{args.kv_heads} "
        f"heads, seq {args.seq}, batch {args.batch}, vocab {args.vocab}, fp32, "
        f"{torch.get_num_threads()} threads; step = forward + cross-entropy + backward\n"
    )
    print(
        f"{'policy':<31} {'saved MiB':>9} {'offl. MiB':>9} {'peak MiB':>9} {'step ms':>8} "
        f"{'saved/peer':>10} {'peak/peer':>9} {'time/peer':>9}  pareto"
    )
    for name, m in rows:
        print(
            f"{name:<31} {m.saved_bytes / mib:>9.2f} {m.offloaded_bytes / mib:>9.2f} "
            f"{m.peak_bytes / mib:>9.2f} {m.step_time_s * 1e3:>8.1f} "
            f"{m.saved_bytes / peer.saved_bytes:>10.2f} {m.peak_bytes / peer.peak_bytes:>9.2f} "
            f"{m.step_time_s / peer.step_time_s:>9.2f}  {'' if dominated(m) else '*'}"
        )
    print("\nGoal: memory <= 1.2x Full and step time <= 0.85x Full")
    for what in ("saved_bytes", "peak_bytes"):
        limit = 1.2 * getattr(full, what)
        fits = [
            (n, m.step_time_s / full.step_time_s)
            for n, m in rows
            # On CPU, Offload's host copies are in the same RAM: it saves no memory here.
            if getattr(m, what) <= limit
            and n not in ("Full", "torch.utils.checkpoint full")
            and not n.startswith("Offload")
        ]
        best = min(fits, key=lambda x: x[1], default=None)
        verdict = "none fits" if best is None else f"{best[0]}: {best[1]:.2f}x Full's step time"
        met = best is not None and best[1] <= 0.85
        print(f"  by {what}: best {verdict} -> {'met' if met else 'NOT met'}")


if __name__ == "__main__":
    main()
