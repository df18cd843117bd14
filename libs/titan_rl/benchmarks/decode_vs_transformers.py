"""TorchGenerator decode throughput vs ``transformers`` ``generate``, and batch-invariant cost.

Same weights in both (our Llama 3 exported with ``titan_models.to_hf`` and loaded by
``AutoModelForCausalLM``), same prompts, greedy decoding of exactly ``--new-tokens`` tokens per
row (no stop token), fp32 on CPU. Rows interleave the engines round by round and report the
median. Engines: TorchGenerator eager, with its compiled decode step, and in batch-invariant
mode; transformers with its default dynamic cache (eager) and with ``cache_implementation=
"static"`` plus its own ``torch.compile`` of the forward (``CompileConfig``, forced on CPU).
Compiles happen in the untimed warm-up; the script prints the dynamo graph count before and
after the timed rounds (equal: no recompiles while timing).

    uv run python libs/titan_rl/benchmarks/decode_vs_transformers.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault(
    "TORCHINDUCTOR_CACHE_DIR", os.path.expanduser("~/.cache/titan_rl_bench_inductor")
)

import torch
from torch._dynamo.utils import counters

import titan_models
from titan_rl import SamplingParams, TorchGenerator


def _ours(gen: TorchGenerator, prompts: list[list[int]], new_tokens: int) -> torch.Tensor:
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0)
    return gen.generate(prompts, params, [0] * len(prompts)).tokens


def _theirs(
    hf_model, prompts: list[list[int]], new_tokens: int, *, compiled: bool = False
) -> torch.Tensor:
    from transformers import CompileConfig

    ids = torch.tensor(prompts)  # equal lengths: no padding, so both see the same inputs
    extra = {}
    if compiled:
        config = CompileConfig(fullgraph=True, dynamic=False, mode="default")
        config._compile_all_devices = True  # generate() compiles only on GPUs unless told
        extra = {"cache_implementation": "static", "compile_config": config}
    with torch.no_grad():
        out = hf_model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
            **extra,
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

    compiled = TorchGenerator(model, compile_decode=True)  # one instance: compiled once
    engines = {
        "TorchGenerator": lambda: _ours(TorchGenerator(model), prompts, args.new_tokens),
        "TorchGenerator, compiled decode": lambda: _ours(compiled, prompts, args.new_tokens),
        "TorchGenerator (batch-invariant)": lambda: _ours(
            TorchGenerator(model, batch_invariant=True), prompts, args.new_tokens
        ),
        "transformers generate": lambda: _theirs(hf_model, prompts, args.new_tokens),
        "transformers generate, static cache + compile": lambda: _theirs(
            hf_model, prompts, args.new_tokens, compiled=True
        ),
    }
    outputs = {name: fn() for name, fn in engines.items()}  # warm-up, and the parity check
    outputs.update({name: fn() for name, fn in engines.items() if "compile" in name})
    same = {
        name: torch.equal(out, outputs["transformers generate"]) for name, out in outputs.items()
    }
    graphs_before = dict(counters["stats"])
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
        f"median of {args.rounds}"
    )
    print(f"same greedy tokens as transformers generate: {same}")
    print(f"dynamo stats before timing {graphs_before}, after {dict(counters['stats'])}")
    base = statistics.median(times["transformers generate"])
    ours = statistics.median(times["TorchGenerator"])
    print("| engine | tokens/s | vs transformers | vs TorchGenerator |\n|---|---:|---:|---:|")
    for name, ts in times.items():
        t = statistics.median(ts)
        print(f"| {name} | {tokens / t:,.0f} | {base / t:.2f}x | {ours / t:.2f}x |")


if __name__ == "__main__":
    main()
