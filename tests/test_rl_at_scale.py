"""titan_rl on Monarch actors composed with flexshard, as the app runs it (CPU, gloo): a
trainer mesh of 2 flexshard ranks and generator replicas in their own processes; weight
sync, data-parallel equivalence, batch invariance, a replica and a trainer rank killed with
SIGKILL. Checks are grouped: each spawn costs seconds."""

from __future__ import annotations

import functools
import logging
import os
import signal
import time

import pytest
import torch

pytest.importorskip("monarch.actor")

from titan_rl import GRPOConfig, LossConfig, RewardResult, SamplingParams
from titan_rl.actors import (
    DistributedGRPO,
    MeshConfig,
    TorchGeneratorFactory,
    TrainerDiedError,
)
from titan_rl.buffer import RolloutRequest, pack_groups
from titan_rl.controller import DataflowConfig
from titan_rl.factories import TitanModelFactory
from titan_rl.learner import GRPOLearner
from titan_rl.tasks import ExactMatchTask
from titan_rl.workers import TaskRollouts

make_llama = TitanModelFactory(
    family="llama3", flavor="debug", overrides={"vocab_size": 264, "num_layers": 2}
)
"""A tiny fp32 Llama 3 on the byte vocabulary (same weights in every process)."""


class FlexshardDP:
    """The hook the app passes: flexshard shards, reduces (mean) and clips. (Tests compose
    libraries; titan_rl never imports flexshard. Imported on use: replicas need not.)"""

    def parallelize(self, model, group):
        import flexshard

        return flexshard.shard(model, group)

    def reduce_gradients(self, model):
        pass  # flexshard reduces in its backward hooks

    def clip_grad_norm_(self, model, max_norm):
        import flexshard

        return flexshard.clip_grad_norm_(model.parameters(), max_norm)

    def state_dict(self, model):
        import flexshard

        return flexshard.sharded_state_dict(model)


class Bytes:
    bos_id, eos_id, pad_id = 256, 257, 258

    def encode(self, text):
        return list(text.encode())

    def decode(self, ids):
        return bytes(i for i in ids if i < 256).decode(errors="replace")


def _sums(i: int) -> tuple[str, str]:
    return f"{i}+{i}=", str(2 * i)


class LowIdTask(ExactMatchTask):
    def score(self, prompt, response_ids):
        ok = bool(response_ids) and response_ids[0] < 128
        return RewardResult(float(ok), "correct" if ok else "wrong")


def _full_weights(learner) -> list[tuple[str, tuple, torch.Tensor]]:
    """This rank's pieces of the full weights (offset, chunk), read from flexshard itself."""
    import flexshard

    out = []
    for name, value in flexshard.sharded_state_dict(learner.model).items():
        if hasattr(value, "local_chunks"):
            out += [(name, tuple(o), c.detach().clone()) for o, c in value.local_chunks()]
        elif learner.rank == 0:
            out.append((name, (0,) * value.dim(), value.detach().clone()))
    return out


def _assemble(pieces_per_rank, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    full = {k: torch.full_like(v, float("nan")) for k, v in like.items()}
    for pieces in pieces_per_rank:
        for name, offset, chunk in pieces:
            index = tuple(slice(o, o + n) for o, n in zip(offset, chunk.shape, strict=True))
            full[name][index] = chunk
    return full


def _generator_state(generator) -> tuple[int, dict[str, torch.Tensor]]:
    return generator.weight_version, {k: v.cpu() for k, v in generator.model.state_dict().items()}


def _pid(_target) -> int:
    return os.getpid()


CFG = GRPOConfig(
    num_prompts=2,
    group_size=4,
    sampling=SamplingParams(max_new_tokens=4, stop_token_ids=(257,)),
    loss=LossConfig(correction="tis"),
    mode="sync",
    batch_invariant=True,
    seed=5,
)


def test_trainer_mesh_replicas_weight_sync_and_faults(caplog):
    """One spawn (2 flexshard trainer ranks, 2 replicas), in order:
    - batch-invariant at DP 2 with rollouts from 2 replicas: max_abs_logprob_diff == 0.0
      on every step (guards the data-parallel log-prob path and the weight sync);
    - after a publication every replica holds the trainer's full weights bitwise, at the
      published version (guards the shared-memory slots and each rank's pieces);
    - a DP-2 step equals one process on the same batch to 1e-6 (guards the loss scaling: a
      wrong share or divisor moves SGD's update by a factor);
    - kill -9 of a replica mid-run: the run finishes on the other, its lost requests re-sent
      (guards the supervision path: Monarch's default hook would exit the controller);
    - kill -9 of a trainer rank: the next step ends the run with one TrainerDiedError line."""
    caplog.set_level(logging.WARNING)
    source = TaskRollouts(
        LowIdTask(Bytes(), _sums), num_prompts=2, group_size=4, sampling=CFG.sampling
    )
    run = DistributedGRPO(
        model_factory=make_llama,
        optimizer_factory=functools.partial(torch.optim.SGD, lr=0.5),
        generator_factory=TorchGeneratorFactory(model_factory=make_llama, batch_invariant=True),
        data_parallel=FlexshardDP(),
        source=source,
        config=CFG,
        mesh=MeshConfig(num_generators=2, trainer_ranks=2, num_threads=1, restart_generators=False),
        dataflow=DataflowConfig(rollout_workers=2),
    )
    start = time.time()
    with run:
        hist = run.train(2)
        print(f"[{time.time() - start:.1f} s] spawned, 2 steps")
        assert [m["max_abs_logprob_diff"] for m in hist] == [0.0, 0.0], hist
        assert [m["policy_lag_max"] for m in hist] == [0, 0]
        assert all(m["grad_norm"] > 0 for m in hist)
        lanes = {i["lane"] for i in run.controller.timeline.intervals}
        assert {"replica:gen0", "replica:gen1"} <= lanes, lanes

        # Weight sync: the replicas hold version 2, bitwise the trainer's full weights.
        run.router.wait_loaded(2)
        like = make_llama(torch.device("cpu")).state_dict()
        trainer_full = _assemble(run.trainer.run(_full_weights), like)
        replicas = list(run.router._replicas.values())
        for replica in replicas:
            version, weights = replica.run(_generator_state)
            assert version == 2
            for name, tensor in trainer_full.items():
                assert torch.equal(weights[name], tensor), (replica.name, name)

        # DP 2 vs one process: the same batch from the trainer's current weights.
        model = make_llama(torch.device("cpu"))
        model.load_state_dict(trainer_full)
        local = GRPOLearner(model, torch.optim.SGD(model.parameters(), lr=0.5), CFG, version=2)
        gen = TorchGeneratorFactory(model_factory=make_llama)(0)
        gen.update_weights(trainer_full, 2)
        reqs = [RolloutRequest(step=2, group=g, num_groups=1, index=4 + g, seed=9) for g in (0, 1)]
        batch = pack_groups(2, [source(gen, r) for r in reqs])
        want = local.step(batch)
        got = run.trainer.train(batch, 0)
        trainer_after = _assemble(run.trainer.run(_full_weights), like)
        worst = max(
            float((trainer_after[k] - v).abs().max()) for k, v in model.state_dict().items()
        )
        moved = max(float((trainer_full[k] - v).abs().max()) for k, v in model.state_dict().items())
        print(f"DP 2 vs 1 process: max |dw| {worst:.2e} (the step moved weights by {moved:.2e})")
        assert moved > 1e-4 and worst <= 1e-6
        assert abs(got["loss"] - want["loss"]) <= 1e-6

        print(f"[{time.time() - start:.1f} s] weight sync and DP checks")
        # kill -9 one replica as the next step's requests go out.
        pid = replicas[0].pid()

        def kill_first(metrics):
            if metrics["step"] == 3:
                os.kill(pid, signal.SIGKILL)

        hist = run.train(3, on_step=kill_first)
        assert [m["step"] for m in hist] == [3, 4, 5]
        assert run.router.deaths == ["gen0"] and hist[-1]["live_replicas"] == 1
        assert "generator replica gen0 died" in caplog.text
        assert [m["max_abs_logprob_diff"] for m in hist] == [0.0, 0.0, 0.0]
        print(f"requests re-sent after the kill: {run.router.resent}")

        print(f"[{time.time() - start:.1f} s] replica killed, 3 steps")
        # kill -9 a trainer rank: one clear error.
        trainer_pid = run.trainer.run(_pid)[1]
        os.kill(trainer_pid, signal.SIGKILL)
        with pytest.raises(TrainerDiedError, match="a trainer rank died, the run stops"):
            run.train(1)
        print(f"[{time.time() - start:.1f} s] trainer rank killed")
    print(f"[{time.time() - start:.1f} s] closed")
