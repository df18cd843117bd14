"""TorchGenerator decode throughput vs ``transformers`` ``generate``, and batch-invariant cost.

Same weights in both (our Llama 3 exported with ``titan_models.to_hf`` and loaded by
``AutoModelForCausalLM``), same prompts, greedy decoding of exactly ``--new-tokens`` tokens per
row (no stop token), fp32 on CPU. Rows interleave the engines round by round and report the
median. A third row runs TorchGenerator in batch-invariant mode.

    uv run python libs/titan_rl/benchmarks/decode_vs_transformers.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

import titan_models
from titan_rl import SamplingParams, TorchGenerator


def _ours(gen: TorchGenerator, prompts: list[list[int]], new_tokens: int) -> torch.Tensor:
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0)
    return gen.generate(prompts, params, [0] * len(prompts)).tokens


def _theirs(hf_model, prompts: list[list[int]], new_tokens: int) -> torch.Tensor:
    ids = torch.tensor(prompts)  # equal lengths: no padding, so both see the same inputs
    with torch.no_grad():
        out = hf_model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )
    return out[:, ids.shape[1] :]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM

    model_cls, config = titan_models.get_model(
        "llama3", "debug", num_layers=args.layers, dim=args.dim, vocab_size=2048
    )
    with torch.device("meta"):
        model = model_cls(config)
    model.init_weights(device="cpu", seed=0).eval()
    with tempfile.TemporaryDirectory() as tmp:
        titan_models.to_hf(model, tmp)
        hf_model = AutoModelForCausalLM.from_pretrained(tmp, torch_dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, 2048, (args.batch, args.prompt_len), generator=g).tolist()

    engines = {
        "TorchGenerator": lambda: _ours(TorchGenerator(model), prompts, args.new_tokens),
        "TorchGenerator (batch-invariant)": lambda: _ours(
            TorchGenerator(model, batch_invariant=True), prompts, args.new_tokens
        ),
        "transformers generate": lambda: _theirs(hf_model, prompts, args.new_tokens),
    }
    outputs = {name: fn() for name, fn in engines.items()}  # warm-up, and the parity check
    same = torch.equal(outputs["TorchGenerator"], outputs["transformers generate"])
    times: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(args.rounds):
        for name, fn in engines.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)

    tokens = args.batch * args.new_tokens
    print(
        f"llama3 {args.layers} layers, dim {args.dim}, vocab 2048; batch {args.batch}, prompt "
        f"{args.prompt_len}, {args.new_tokens} new tokens, greedy, fp32, {args.threads} threads; "
        f"median of {args.rounds}; same greedy tokens as transformers: {same}"
    )
    base = statistics.median(times["transformers generate"])
    ours = statistics.median(times["TorchGenerator"])
    print("| engine | tokens/s | vs transformers | vs TorchGenerator |\n|---|---:|---:|---:|")
    for name, ts in times.items():
        t = statistics.median(ts)
        print(f"| {name} | {tokens / t:,.0f} | {base / t:.2f}x | {ours / t:.2f}x |")


if __name__ == "__main__":
    main()
