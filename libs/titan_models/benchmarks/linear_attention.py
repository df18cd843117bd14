"""Linear attention: our chunked delta rule vs our recurrent form vs transformers' torch
implementations (Gated DeltaNet and KDA), forward + backward time and peak memory at growing
sequence lengths; and generation with the recurrent state vs recomputing the whole sequence.

    uv run python libs/titan_models/benchmarks/linear_attention.py            # S = 1k, 4k, 16k
    uv run python libs/titan_models/benchmarks/linear_attention.py --seq-lens 1024 4096 --rounds 3

Time: all implementations in one process, steps interleaved (ours, recurrent, theirs, ours,
...), the median per implementation and the median of the per-round ratios (robust to the
load of a shared machine drifting). Peak memory: each (implementation, operator, S) once in a
fresh process, its peak RSS (``ru_maxrss``) minus its RSS once the inputs exist, over one
forward + backward. fp32, batch 1, ``--heads`` heads of width 128 (Qwen3.5's and Kimi Linear's),
chunk 64, 2 threads. q/k are L2-normalised beforehand for every implementation. The recurrent
form keeps a (K x V) state per token for the backward and transformers' KDA a (C x C x K) decay
tensor per chunk: they run up to ``--max-recurrent`` / ``--max-hf-kda`` tokens (``-`` beyond).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F


def _rss_kib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4  # pages of 4 KiB


def _inputs(op: str, S: int, heads: int):
    g = torch.Generator().manual_seed(0)
    K = V = 128
    q = F.normalize(torch.randn(1, S, heads, K, generator=g), dim=-1)
    k = F.normalize(torch.randn(1, S, heads, K, generator=g), dim=-1)
    v = torch.randn(1, S, heads, V, generator=g)
    shape = (1, S, heads, K) if op == "kda" else (1, S, heads)
    decay = -torch.rand(shape, generator=g) * 0.1
    beta = torch.rand(1, S, heads, generator=g)
    return [t.requires_grad_() for t in (q, k, v, decay, beta)]


def _step_fn(impl: str, op: str):
    scale = 128**-0.5
    if impl == "ours_chunked":
        from titan_models.components.linear_attention import chunk_delta_rule

        return lambda q, k, v, g, b: chunk_delta_rule(q, k, v, g, b, scale=scale)[0]
    if impl == "ours_recurrent":
        from titan_models.components.linear_attention import recurrent_delta_rule

        return lambda q, k, v, g, b: recurrent_delta_rule(q, k, v, g, b, scale=scale)[0]
    if op == "gdn":
        from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

        return lambda q, k, v, g, b: torch_chunk_gated_delta_rule(q, k, v, g=g, beta=b)[0]
    from transformers.models.kimi_linear.modeling_kimi_linear import chunk_kimi_delta_attention

    return lambda q, k, v, g, b: chunk_kimi_delta_attention(q, k, v, g=g, beta=b)[0]


def _worker(impl: str, op: str, S: int, heads: int) -> dict:
    """Peak memory of one forward + backward, in a fresh process."""
    torch.set_num_threads(2)
    fn = _step_fn(impl, op)
    inputs = _inputs(op, S, heads)
    before = _rss_kib()
    fn(*inputs).sum().backward()
    return {"peak_mib": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024}


def _interleaved_times(op: str, S: int, impls: list[str], heads: int, rounds: int) -> dict:
    """Median fwd+bwd seconds per implementation and the median per-round ratio to ours."""
    torch.set_num_threads(2)
    fns = {impl: _step_fn(impl, op) for impl in impls}
    inputs = _inputs(op, S, heads)
    times: dict[str, list[float]] = {impl: [] for impl in impls}
    for r in range(rounds + 1):  # round 0 warms up
        for impl, fn in fns.items():
            for t in inputs:
                t.grad = None
            start = time.perf_counter()
            fn(*inputs).sum().backward()
            if r:
                times[impl].append(time.perf_counter() - start)
    out = {impl: statistics.median(t) for impl, t in times.items()}
    for impl in impls:
        ratios = [a / b for a, b in zip(times[impl], times["ours_chunked"], strict=True)]
        out[f"{impl}/ours"] = statistics.median(ratios)
    return out


def _generation(tokens: int, prompt: int) -> dict:
    """Greedy decoding of a small Qwen3.5 (Gated DeltaNet + attention): with the cache (KV for
    attention, the recurrent state for Gated DeltaNet) vs one full forward per new token."""
    import titan_models

    torch.set_num_threads(2)
    cls, config = titan_models.get_model("qwen3_5", "debug", dim=256, vocab_size=4096)
    model = cls(config).eval()
    ids = torch.randint(0, 4096, (1, prompt), generator=torch.Generator().manual_seed(0))
    start = time.perf_counter()
    new, _ = titan_models.greedy_generate(model, [ids[0].tolist()], max_new_tokens=tokens)
    cached = time.perf_counter() - start
    seq = ids
    start = time.perf_counter()
    with torch.no_grad():
        for _ in range(tokens):
            nxt = model(seq)[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], dim=1)
    recompute = time.perf_counter() - start
    assert torch.equal(seq[0, prompt:], new[0]), "both decoders must pick the same tokens"
    return {"cached_tok_s": tokens / cached, "recompute_tok_s": tokens / recompute}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-recurrent", type=int, default=1024)
    parser.add_argument("--max-hf-kda", type=int, default=4096)
    parser.add_argument("--gen-tokens", type=int, default=64)
    parser.add_argument("--gen-prompt", type=int, default=512)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--worker", nargs=3, metavar=("IMPL", "OP", "S"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        impl, op, S = args.worker
        print(json.dumps(_worker(impl, op, int(S), args.heads)))
        return

    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    print(f"load average at start: {os.getloadavg()[0]:.1f}; heads {args.heads}, K = V = 128")
    for op, name in (
        ("gdn", "Gated DeltaNet (per-head decay)"),
        ("kda", "KDA (per-channel decay)"),
    ):
        print(f"\n{name}: forward + backward, median ms (peak MiB)")
        print(
            "| S | ours chunked | ours recurrent | transformers | transformers / ours: time, memory |"
        )
        print("|---:|---:|---:|---:|---|")
        for S in args.seq_lens:
            impls = ["ours_chunked"]
            if args.max_recurrent >= S:
                impls.append("ours_recurrent")
            if not args.skip_hf and (op == "gdn" or args.max_hf_kda >= S):
                impls.append("transformers")
            peaks = {}
            for impl in impls:
                cmd = [sys.executable, __file__, "--worker", impl, op, str(S)]
                cmd += ["--heads", str(args.heads)]
                out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
                peaks[impl] = json.loads(out.stdout.strip().splitlines()[-1])["peak_mib"]
            times = _interleaved_times(op, S, impls, args.heads, args.rounds)
            cells = [
                f"{1e3 * times[i]:.0f} ({peaks[i]:.0f})" if i in impls else "-"
                for i in ("ours_chunked", "ours_recurrent", "transformers")
            ]
            ratio = "-"
            if "transformers" in impls:
                memory = peaks["transformers"] / max(peaks["ours_chunked"], 1e-9)
                ratio = f"{times['transformers/ours']:.2f}x, {memory:.2f}x"
            print(f"| {S} | " + " | ".join(cells) + f" | {ratio} |")
    gen = _generation(args.gen_tokens, args.gen_prompt)
    print(
        f"\ngeneration ({args.gen_prompt}-token prompt, {args.gen_tokens} new tokens, qwen3_5 "
        f"debug at dim 256): cached {gen['cached_tok_s']:.1f} tok/s, recomputing "
        f"{gen['recompute_tok_s']:.1f} tok/s, "
        f"{gen['cached_tok_s'] / gen['recompute_tok_s']:.1f}x"
    )
    print(f"load average at end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
