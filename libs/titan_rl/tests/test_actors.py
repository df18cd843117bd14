"""``titan_rl.actors`` on a GPU (the CPU path, composed with flexshard as the app runs it,
is tested in the repository's ``tests/test_rl_at_scale.py``)."""

from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("monarch.actor")

from titan_rl import GRPOConfig, LossConfig, RewardResult, SamplingParams
from titan_rl.actors import DistributedGRPO, MeshConfig
from titan_rl.factories import TitanModelFactory, TorchGeneratorFactory
from titan_rl.learner import AllReduceGradients
from titan_rl.tasks import ExactMatchTask
from titan_rl.workers import TaskRollouts
from titan_testing import requires_gpus

_LLAMA = TitanModelFactory(
    family="llama3", flavor="debug", overrides={"vocab_size": 264, "num_layers": 2}
)


class _Bytes:
    bos_id, eos_id, pad_id = 256, 257, 258

    def encode(self, text):
        return list(text.encode())

    def decode(self, ids):
        return bytes(i for i in ids if i < 256).decode(errors="replace")


class _LowIdTask(ExactMatchTask):
    def score(self, prompt, response_ids):
        ok = bool(response_ids) and response_ids[0] < 128
        return RewardResult(float(ok), "correct" if ok else "wrong")


def _sums(i: int) -> tuple[str, str]:
    return f"{i}+{i}=", str(2 * i)


def _generator_state(generator) -> tuple[int, dict[str, torch.Tensor]]:
    return generator.weight_version, {k: v.cpu() for k, v in generator.model.state_dict().items()}


def _trainer_state(learner) -> dict[str, torch.Tensor]:
    return {k: v.cpu() for k, v in learner.model.state_dict().items()}


@requires_gpus(1)
def test_distributed_grpo_on_cuda():
    """The GPU path: a trainer rank over NCCL and a TorchGenerator replica on CUDA; after two
    steps the replica holds the trainer's weights bitwise at version 2 (the slot copy from
    and to device memory)."""
    cfg = GRPOConfig(
        num_prompts=2,
        group_size=4,
        sampling=SamplingParams(max_new_tokens=4, stop_token_ids=(257,)),
        loss=LossConfig(correction="tis"),
        seed=5,
    )
    source = TaskRollouts(
        _LowIdTask(_Bytes(), _sums), num_prompts=2, group_size=4, sampling=cfg.sampling
    )
    run = DistributedGRPO(
        model_factory=_LLAMA,
        optimizer_factory=functools.partial(torch.optim.AdamW, lr=1e-4),
        generator_factory=TorchGeneratorFactory(model_factory=_LLAMA, first_device=0),
        data_parallel=AllReduceGradients(),
        source=source,
        config=cfg,
        mesh=MeshConfig(num_generators=1, trainer_ranks=1, backend="nccl"),
    )
    with run:
        hist = run.train(2)
        assert [m["step"] for m in hist] == [0, 1] and all(m["grad_norm"] > 0 for m in hist)
        run.router.wait_loaded(2)
        (trainer,) = run.trainer.run(_trainer_state)
        (replica,) = run.router._replicas.values()
        version, weights = replica.run(_generator_state)
        assert version == 2
        for name, tensor in trainer.items():
            assert torch.equal(weights[name], tensor), name
