"""The titan veRL engine against veRL's own FSDP engine, on CPU (gloo), in the veRL environment.

Run with that environment's python (``build_env.sh``)::

    $TITAN_VERL_ENV/bin/python apps/titan_train/verl_env/check_engine.py --nproc 1 --nproc 2

For each world size, every rank builds both engines from one tiny random Llama saved as HF
safetensors (fp32), takes its data-parallel share of one veRL ``DataProto`` batch (ragged
prompts and responses; ``left_right_2_no_padding`` as veRL's trainer does), and runs veRL's
``train_batch`` with veRL's PPO loss (entropy bonus on, temperature 0.8, two micro-batches
per rank), then ``infer_batch`` with dynamic batch sizes. Rank 0 prints one JSON line per
world size with the largest differences (titan minus FSDP): per-token log-probs and entropy of
the training forward, loss, gradient norm, every weight after the optimizer step (in HF
names), and the log-probs after the step. It also saves the titan engine's checkpoint,
restores it into a fresh engine, runs one more step on both and reports the largest weight
difference (0 when model, optimizer and schedule came back exactly), and the largest difference
between the checkpoint's ``huggingface`` export and the engine's weights (0). A first line
gives the engine config's errors for bad values.

veRL 0.9.1 registers no CPU platform (it falls back to "nvidia" and calls ``cuda.set_device``),
so this script registers one through veRL's own ``PlatformRegistry`` and selects it with
``VERL_PLATFORM=cpu``; the FSDP engine is registered for cuda/npu only, so it is looked up with
veRL's ``VERL_ENGINE_DEVICE=cuda`` override (the titan engine is registered for cpu too); it
also needs ``attn_implementation="sdpa"`` (veRL's
default is flash-attention 2), fp32 ``mixed_precision`` and ``use_torch_compile=False``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import sys
import tempfile
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

BATCH = 8  # sequences of the global batch
PROMPT, RESPONSE = 6, 5  # padded widths
VOCAB = 96
MICRO = 2  # sequences per micro-batch per rank


def write_tiny_llama(folder: Path) -> None:
    """A random fp32 Llama with GQA and a tokenizer (veRL's model config loads one)."""
    from tokenizers import Tokenizer, models
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(folder)
    vocab = {f"t{i}": i for i in range(VOCAB)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="t0", eos_token="t1", bos_token="t2"
    ).save_pretrained(folder)


def register_cpu_platform() -> None:
    """veRL's platform for a machine without an accelerator (see the module doc)."""
    from verl.plugin.platform.platform_base import PlatformBase
    from verl.plugin.platform.platform_manager import PlatformRegistry

    @PlatformRegistry.register(platform="cpu")
    class PlatformCPU(PlatformBase):
        device_name = property(lambda self: "cpu")
        vendor_name = property(lambda self: "cpu")
        device_module = property(lambda self: torch.cpu)

        def is_available(self):
            return True

        def current_device(self):
            return "cpu"  # used as `tensor.to(get_device_id())`

        def device_count(self):
            return 1

        def set_device(self, device_index):
            pass

        def synchronize(self, device_index=None):
            pass

        def manual_seed(self, seed):
            torch.manual_seed(seed)

        def manual_seed_all(self, seed):
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings):
            pass

        def empty_cache(self):
            pass

        def get_device_capability(self, device_index=0):
            return (None, None)

        def communication_backend_name(self):
            return "gloo"

        def visible_devices_envvar(self):
            return "CUDA_VISIBLE_DEVICES"

        @contextlib.contextmanager
        def nvtx_range(self, msg):
            yield

        def profiler_start(self):
            pass

        def profiler_stop(self):
            pass

        def ray_resource_name(self):
            return "CPU"

        def ray_noset_envvars(self):
            return []

        def is_ipc_supported(self):
            return False

        def cudart(self):
            return None


def make_batch(rank: int, world: int):
    """This rank's share of one global PPO batch, as veRL's trainer hands it to an engine."""
    from verl import DataProto
    from verl.workers.utils.padding import left_right_2_no_padding

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (BATCH, PROMPT + RESPONSE), generator=g)
    mask = torch.ones(BATCH, PROMPT + RESPONSE, dtype=torch.long)
    prompt_lens = torch.randint(2, PROMPT + 1, (BATCH,), generator=g)
    response_lens = torch.randint(1, RESPONSE + 1, (BATCH,), generator=g)
    for i in range(BATCH):  # prompts left-padded, responses right-padded
        mask[i, : PROMPT - prompt_lens[i]] = 0
        mask[i, PROMPT + response_lens[i] :] = 0
    batch = DataProto.from_dict(
        tensors={
            "input_ids": ids,
            "attention_mask": mask,
            "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
            "prompts": ids[:, :PROMPT],
            "responses": ids[:, PROMPT:],
            "response_mask": mask[:, PROMPT:].clone(),
            "old_log_probs": -4.0 - torch.rand(BATCH, RESPONSE, generator=g),
            "advantages": torch.randn(BATCH, RESPONSE, generator=g),
        },
        meta_info={"temperature": 0.8},
    )
    return left_right_2_no_padding(batch.chunk(world)[rank].to_tensordict())


def train_once(engine, td, loss_fn):
    """veRL's ``train_batch`` (log-probs kept), then ``infer_batch`` with dynamic batches."""
    from verl.utils import tensordict_utils as tu

    tu.assign_non_tensor(
        td,
        calculate_entropy=True,
        global_batch_size=BATCH,
        use_dynamic_bsz=False,
        micro_batch_size_per_gpu=MICRO,
        use_remove_padding=False,
        use_fused_kernels=False,
        return_model_output=True,
    )
    with engine.train_mode():
        out = engine.train_batch(td, loss_function=loss_fn)
    infer = td.clone()
    tu.assign_non_tensor(infer, use_dynamic_bsz=True, max_token_len_per_gpu=16)
    with engine.eval_mode():
        after = engine.infer_batch(infer)
    return {
        "log_probs": out["model_output"]["log_probs"].values(),
        "entropy": out["model_output"]["entropy"].values(),
        "loss": torch.tensor(out["loss"]).sum(),
        "grad_norm": torch.tensor(out["metrics"]["grad_norm"]),
        "log_probs_after": after["model_output"]["log_probs"].values(),
    }


def fsdp_weights(engine) -> dict[str, torch.Tensor]:
    return {
        name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for name, p in engine.module.named_parameters()
    }


def titan_weights(engine) -> dict[str, torch.Tensor]:
    tensors, _ = engine.get_per_tensor_param()
    return {name: t.detach().clone() for name, t in tensors}


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def run(rank: int, world: int, port: int, folder: str, out: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        VERL_PLATFORM="cpu",
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    register_cpu_platform()
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import (
        FSDPActorConfig,
        FSDPEngineConfig,
        FSDPOptimizerConfig,
        HFModelConfig,
    )
    from verl.workers.engine import EngineRegistry
    from verl.workers.utils.losses import ppo_loss

    from titan_train.integrations import verl as titan_verl

    def model_config():
        return HFModelConfig(
            path=folder,
            use_remove_padding=False,
            enable_gradient_checkpointing=False,
            override_config={"attn_implementation": "sdpa"},
        )

    def optim():
        return FSDPOptimizerConfig(
            lr=3e-3, total_training_steps=4, clip_grad=1.0, weight_decay=0.01
        )

    actor = dict(
        ppo_mini_batch_size=BATCH,
        ppo_micro_batch_size_per_gpu=MICRO,
        rollout_n=1,
        use_dynamic_bsz=False,
        entropy_coeff=0.01,
    )
    fsdp_actor = FSDPActorConfig(strategy="fsdp2", **actor)
    os.environ["VERL_ENGINE_DEVICE"] = "cuda"  # the FSDP engine is registered for cuda/npu only
    fsdp = EngineRegistry.new(
        "language_model",
        "fsdp2",
        model_config=model_config(),
        engine_config=FSDPEngineConfig(
            strategy="fsdp2",
            use_torch_compile=False,
            mixed_precision={"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"},
        ),
        optimizer_config=optim(),
        checkpoint_config=CheckpointConfig(),
    )
    del os.environ["VERL_ENGINE_DEVICE"]
    fsdp.initialize()
    ref = train_once(fsdp, make_batch(rank, world), partial(ppo_loss, config=fsdp_actor))
    ref_w = {k: v for k, v in fsdp_weights(fsdp).items()}
    del fsdp

    def titan_engine():
        titan_actor = titan_verl.TitanActorConfig(**actor)  # strategy "titan"; .engine is ours
        contents = ["model", "optimizer", "extra", "hf_model"]
        engine = EngineRegistry.new(
            "language_model",
            titan_actor.strategy,
            model_config=model_config(),
            engine_config=titan_actor.engine,
            optimizer_config=optim(),
            checkpoint_config=CheckpointConfig(save_contents=contents),
        )
        engine.initialize()
        return engine, partial(ppo_loss, config=titan_actor)

    titan, titan_loss = titan_engine()
    assert isinstance(titan, titan_verl.TitanEngineWithLMHead), type(titan)
    got = train_once(titan, make_batch(rank, world), titan_loss)
    got_w = titan_weights(titan)
    diffs = {k: (got[k] - ref[k]).abs().max().item() for k in ref}
    diffs["weights"] = max_diff(got_w, ref_w)
    diffs["weights_moved"] = max_diff(got_w, titan_weights_initial(folder))

    # Checkpoint round trip: a fresh engine restored from the checkpoint takes the same step.
    ckpt = Path(out) / f"ckpt{world}" / "global_step_1" / "actor"
    titan.save_checkpoint(str(ckpt), global_step=1)
    diffs["hf_export"] = max_diff(read_hf(ckpt / "huggingface"), titan_weights(titan))
    restored, _ = titan_engine()
    restored.load_checkpoint(str(ckpt))
    train_once(titan, make_batch(rank, world), titan_loss)
    train_once(restored, make_batch(rank, world), titan_loss)
    diffs["restored_step"] = max_diff(titan_weights(restored), titan_weights(titan))
    if rank == 0:
        print(json.dumps({"world": world, **diffs}), flush=True)
    dist.destroy_process_group()


def titan_weights_initial(folder: str) -> dict[str, torch.Tensor]:
    return read_hf(Path(folder))


def read_hf(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    assert files and (folder / "config.json").is_file(), f"no HF checkpoint in {folder}"
    return {k: v for f in files for k, v in load_file(str(f)).items()}


def check_errors() -> dict[str, str]:
    """The engine config's answer to bad values: each a ValueError naming the field."""
    from titan_train.integrations.verl import TitanEngineConfig

    bad = {
        "mixed_precision": {"mixed_precision": "fp16"},
        "param_offload": {"param_offload": True},
        "dp_shard": {"dp_shard": 0},
        "attention_backend": {"attention_backend": "nope"},
        "strategy": {"strategy": "fsdp"},
    }
    messages = {}
    for name, kwargs in bad.items():
        try:
            TitanEngineConfig(**kwargs)
        except ValueError as e:
            messages[name] = str(e)
        else:
            messages[name] = "no error"
    return messages


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, action="append", choices=(1, 2))
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    print(json.dumps({"errors": check_errors()}), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "tiny-llama"
        write_tiny_llama(folder)
        for world in args.nproc or [1]:
            mp.start_processes(
                run,
                args=(world, free_port(), str(folder), tmp),
                nprocs=world,
                join=True,
                start_method="spawn",
            )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
