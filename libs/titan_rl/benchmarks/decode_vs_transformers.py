"""TorchGenerator decode throughput vs ``transformers`` ``generate``, and batch-invariant cost.

Same weights in both (our Llama 3 exported with ``titan_models.to_hf`` and loaded by
``AutoModelForCausalLM``), same prompts, greedy decoding of exactly ``--new-tokens`` tokens per
row (no stop token), fp32. Every engine runs in one process, interleaved round by round; the
table gives the median wall time per engine (and the process CPU time, less sensitive to other
jobs on a shared machine) and the ratios. The load average before and after is printed: on a
shared machine wall-clock ratios are noisy.

Engines: TorchGenerator decodes through the model's own forward, ``model(tokens,
kv_cache=cache)`` over a static KV cache: eager, with ``compile_decode=True`` (one compiled
graph per step: the forward and the sampler), and in batch-invariant mode. transformers runs
with its default dynamic cache (eager) and with ``cache_implementation="static"`` plus its own
``torch.compile`` of the forward (``CompileConfig``, forced on CPU). The compiled engine also
runs with ``cpu_rowwise_linear=True``, the library's CPU-only opt-in (the step's linears traced
as products and sums, ``titan_rl.cpu_decode``), to state its gain. Compiles happen in the untimed warm-up; the script prints the
dynamo graph count before and after the timed rounds (equal: no recompiles while timing).

    uv run python libs/titan_rl/benchmarks/decode_vs_transformers.py --rounds 7 --threads 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")

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
    p.add_argument("--no-compile", action="store_true", help="eager engines only")
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
        hf_model = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, 2048, (args.batch, args.prompt_len), generator=g).tolist()
    n = args.new_tokens

    def ours(gen: TorchGenerator) -> Callable[[], torch.Tensor]:
        return lambda: _ours(gen, prompts, n)

    engines = {
        "TorchGenerator": ours(TorchGenerator(model)),
        "TorchGenerator (batch-invariant)": ours(TorchGenerator(model, batch_invariant=True)),
        "transformers generate": lambda: _theirs(hf_model, prompts, n),
    }
    if not args.no_compile:
        engines["TorchGenerator, compile_decode"] = ours(TorchGenerator(model, compile_decode=True))
        engines["TorchGenerator, compile_decode + cpu_rowwise_linear (CPU opt-in)"] = ours(
            TorchGenerator(model, compile_decode=True, cpu_rowwise_linear=True)
        )
        engines["transformers generate, static cache + compile"] = lambda: _theirs(
            hf_model, prompts, n, compiled=True
        )
    load_before = os.getloadavg()
    outputs = {name: fn() for name, fn in engines.items()}  # warm-up (compiles), parity check
    outputs.update({name: fn() for name, fn in engines.items() if "compile" in name})
    same = {
        name: torch.equal(out, outputs["transformers generate"]) for name, out in outputs.items()
    }
    graphs_before = dict(counters["stats"])
    wall: dict[str, list[float]] = {name: [] for name in engines}
    cpu: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(args.rounds):
        for name, fn in engines.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            fn()
            wall[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - start_cpu)

    tokens = args.batch * n
    print(
        f"llama3 {args.layers} layers, dim {args.dim}, vocab 2048; batch {args.batch}, prompt "
        f"{args.prompt_len}, {n} new tokens, greedy, fp32, {args.threads} threads; median of "
        f"{args.rounds} interleaved rounds; torch {torch.__version__}"
    )
    print(
        "load average (1, 5, 15 min) before: "
        + ", ".join(f"{x:.1f}" for x in load_before)
        + "; after: "
        + ", ".join(f"{x:.1f}" for x in os.getloadavg())
    )
    print(f"same greedy tokens as transformers generate: {same}")
    print(f"dynamo stats before timing {graphs_before}, after {dict(counters['stats'])}")
    base = statistics.median(wall["transformers generate"])
    base_cpu = statistics.median(cpu["transformers generate"])
    print(
        "| engine | tokens/s | vs transformers | CPU s per call | vs transformers (CPU) |\n"
        "|---|---:|---:|---:|---:|"
    )
    for name in engines:
        t, c = statistics.median(wall[name]), statistics.median(cpu[name])
        print(f"| {name} | {tokens / t:,.0f} | {base / t:.2f}x | {c:.3f} | {base_cpu / c:.2f}x |")


if __name__ == "__main__":
    main()
