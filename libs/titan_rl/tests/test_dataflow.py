"""The controller's dataflow in one process: sync equivalence, the lag bound, metrics,
resume, replica faults and scaling with fixed-latency generators."""

from __future__ import annotations

import copy

import pytest
import torch

from titan_rl import (
    GRPOConfig,
    GRPOTrainer,
    LossConfig,
    RewardResult,
    SamplingParams,
    TorchGenerator,
)
from titan_rl.buffer import RolloutRequest, WorkBuffer
from titan_rl.controller import Controller, DataflowConfig, LocalPolicy
from titan_rl.learner import GRPOLearner
from titan_rl.router import LocalReplica, ReplicaDiedError, Router
from titan_rl.simulated import LatencyGenerator, LatencyPolicy
from titan_rl.tasks import ExactMatchTask
from titan_rl.workers import TaskRollouts

pytestmark = pytest.mark.usefixtures("single_thread")


def _sums(i: int) -> tuple[str, str]:
    return f"{i}+{i}=", str(2 * i)


class _LowIdTask(ExactMatchTask):
    """Reward: the response starts with an id below 128 (about half of a random model's)."""

    def score(self, prompt, response_ids):
        ok = bool(response_ids) and response_ids[0] < 128
        return RewardResult(float(ok), "correct" if ok else "wrong")


def _config(tokenizer, **overrides) -> GRPOConfig:
    base = dict(
        num_prompts=2,
        group_size=4,
        sampling=SamplingParams(max_new_tokens=4, stop_token_ids=(tokenizer.eos_id,)),
        loss=LossConfig(correction="tis"),
        seed=3,
    )
    return GRPOConfig(**{**base, **overrides})


def _controller(model, tokenizer, cfg, dataflow=None, replicas=1):
    learner = GRPOLearner(model, torch.optim.AdamW(model.parameters(), lr=1e-3), cfg)
    gens = [TorchGenerator(copy.deepcopy(model), batch_invariant=cfg.batch_invariant)]
    gens += [
        TorchGenerator(copy.deepcopy(model), batch_invariant=True) for _ in range(replicas - 1)
    ]
    router = Router([LocalReplica(g, f"r{i}") for i, g in enumerate(gens)])
    source = TaskRollouts(
        _LowIdTask(tokenizer, _sums),
        num_prompts=cfg.num_prompts,
        group_size=cfg.group_size,
        sampling=cfg.sampling,
    )
    return Controller(LocalPolicy(learner), router, source, cfg, dataflow)


@pytest.mark.parametrize(
    "batch_invariant, groups_per_request", [(False, 2), (True, 1)], ids=["whole-step", "per-group"]
)
def test_no_lag_controller_equals_the_sync_loop_bitwise(
    model_factory, tokenizer, batch_invariant, groups_per_request
):
    """Guards: K = 0 is today's sync loop (prompts, seeds, weights, ops). Per-group requests
    from two replicas need batch-invariant rows to be bitwise the one-call batch."""
    cfg = _config(tokenizer, batch_invariant=batch_invariant)
    ref_model = model_factory(seed=0)
    trainer = GRPOTrainer(
        ref_model,
        torch.optim.AdamW(ref_model.parameters(), lr=1e-3),
        _LowIdTask(tokenizer, _sums),
        cfg,
    )
    ref = trainer.train(3)
    model = model_factory(seed=0)
    dataflow = DataflowConfig(groups_per_request=groups_per_request, rollout_workers=2)
    ctl = _controller(model, tokenizer, cfg, dataflow, replicas=2 if batch_invariant else 1)
    got = ctl.run(3)
    for (name, a), (_, b) in zip(
        ref_model.state_dict().items(), model.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
    for key in ("loss", "grad_norm", "reward_mean", "max_abs_logprob_diff", "kl_generator_trainer"):
        assert [m[key] for m in ref] == [m[key] for m in got], key
    assert all(m["grad_norm"] > 0 for m in got)
    assert [m["policy_lag_max"] for m in got] == [0, 0, 0]
    for key in ("step", "generator_tokens_per_s", "trainer_tokens_per_s", "trainer_idle_fraction"):
        assert all(key in m for m in got), key
    lanes = {i["lane"] for i in ctl.timeline.intervals}
    assert {"trainer", "publication", "rollout:0"} <= lanes and any(
        x.startswith("replica:") for x in lanes
    )


def test_policy_lag_never_exceeds_the_bound(tokenizer):
    """Guards the admission gate: a generator much faster than the trainer would run ahead
    (lag growing with the step) without it. Every rollout's version is recorded."""
    for bound in (0, 1, 2):
        cfg = _config(tokenizer, mode="async", max_offpolicy_steps=bound, num_prompts=4)
        gen = LatencyGenerator(token_latency_s=0.0)
        source = TaskRollouts(
            _LowIdTask(tokenizer, _sums), num_prompts=4, group_size=4, sampling=cfg.sampling
        )
        ctl = Controller(
            LatencyPolicy(step_s=0.02), gen, source, cfg, DataflowConfig(rollout_workers=3)
        )
        hist = ctl.run(6)
        lags = [m["policy_lag_max"] for m in hist]
        assert all(0 <= lag <= bound for lag in lags), (bound, lags)
        assert all(len(m["rollout_versions"]) == 4 for m in hist)
        if bound:  # the generator is far ahead: the bound is reached, not just respected
            assert max(lags) == bound, (bound, lags)


def test_resume_from_controller_state_continues_the_run_bitwise(model_factory, tokenizer, tmp_path):
    """Guards checkpointable controller state: 2 steps, save, restore into fresh objects,
    2 more steps == 4 steps straight (K = 0)."""
    cfg = _config(tokenizer)
    straight = model_factory(seed=0)
    _controller(straight, tokenizer, cfg).run(4)

    model = model_factory(seed=0)
    first = _controller(model, tokenizer, cfg)
    first.run(2)
    torch.save(
        {
            "controller": first.state_dict(),
            "model": model.state_dict(),
            "optim": first.policy.learner.optimizer.state_dict(),
        },
        tmp_path / "ckpt.pt",
    )
    state = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    resumed_model = model_factory(seed=1)
    resumed_model.load_state_dict(state["model"])
    second = _controller(resumed_model, tokenizer, cfg)
    second.policy.learner.optimizer.load_state_dict(state["optim"])
    with pytest.raises(ValueError, match="at version 2, the policy at 0"):
        second.load_state_dict(state["controller"])
    second.policy.learner.version = 2
    second.load_state_dict(state["controller"])
    hist = second.run(2)
    assert [m["step"] for m in hist] == [2, 3]
    for (name, a), (_, b) in zip(
        straight.state_dict().items(), resumed_model.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name


def test_buffer_state_round_trip_keeps_finished_groups(tokenizer, tmp_path):
    """Guards: finished-but-untrained groups survive a checkpoint (no regeneration needed)."""
    cfg = _config(tokenizer)
    source = TaskRollouts(
        _LowIdTask(tokenizer, _sums), num_prompts=2, group_size=4, sampling=cfg.sampling
    )
    gen = LatencyGenerator(token_latency_s=0.0)
    buf = WorkBuffer(num_groups=2, max_offpolicy_steps=1)
    req = RolloutRequest(step=5, group=1, num_groups=1, index=11, seed=3)
    buf.put(req, source(gen, req))
    torch.save(buf.state_dict(), tmp_path / "buf.pt")
    again = WorkBuffer(num_groups=2, max_offpolicy_steps=1)
    again.load_state_dict(torch.load(tmp_path / "buf.pt", weights_only=True))
    assert again.has(5, 1) and not again.has(5, 0)
    a, b = buf.state_dict()["groups"][0], again.state_dict()["groups"][0]
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k], k


class _Dies:
    """A replica whose process 'dies' on its second request (what a killed actor reports)."""

    def __init__(self, inner):
        self.inner, self.name, self.calls = inner, inner.name, 0

    def submit_generate(self, *args):
        self.calls += 1
        if self.calls == 2:
            raise ReplicaDiedError("the process this actor was running on failed: Killed(sig=9)")
        return self.inner.submit_generate(*args)

    def submit_load(self, *args):
        return self.inner.submit_load(*args)

    def close(self):
        self.inner.close()


@pytest.mark.parametrize("restart", [False, True])
def test_a_dead_replica_is_dropped_or_restarted_and_its_requests_resent(tokenizer, restart, caplog):
    cfg = _config(tokenizer, num_prompts=4)
    replicas = [_Dies(LocalReplica(LatencyGenerator(token_latency_s=0.001), "r0"))]
    replicas += [LocalReplica(LatencyGenerator(token_latency_s=0.001), "r1")]
    fresh = lambda i: LocalReplica(LatencyGenerator(token_latency_s=0.001), f"r{i}b")  # noqa: E731
    router = Router(replicas, restart=fresh if restart else None)
    source = TaskRollouts(
        _LowIdTask(tokenizer, _sums), num_prompts=4, group_size=2, sampling=cfg.sampling
    )
    hist = Controller(
        LatencyPolicy(step_s=0.0), router, source, cfg, DataflowConfig(rollout_workers=2)
    ).run(3)
    assert [m["step"] for m in hist] == [0, 1, 2]
    assert router.deaths == ["r0"] and "generator replica r0 died" in caplog.text
    assert hist[-1]["live_replicas"] == (2 if restart else 1)


def _throughput(replicas: int) -> tuple[float, float]:
    cfg = GRPOConfig(
        num_prompts=8, group_size=2, sampling=SamplingParams(max_new_tokens=8),
        mode="async", max_offpolicy_steps=2,
    )  # fmt: skip
    router = Router(
        [LocalReplica(LatencyGenerator(token_latency_s=0.004), f"r{i}") for i in range(replicas)]
    )
    source = TaskRollouts(
        _LowIdTask(_Tok(), _sums), num_prompts=8, group_size=2, sampling=cfg.sampling
    )
    ctl = Controller(
        LatencyPolicy(step_s=0.02),
        router,
        source,
        cfg,
        DataflowConfig(rollout_workers=2 * replicas),
    )
    hist = ctl.run(6)[1:]  # the first step includes the start
    rollouts = sum(m["rollouts_per_s"] * m["step_time_s"] for m in hist)
    wall = sum(m["step_time_s"] for m in hist)
    idle = sum(m["trainer_idle_fraction"] for m in hist) / len(hist)
    return rollouts / wall, idle


class _Tok:
    bos_id, eos_id, pad_id = 256, 257, 258
    encode = staticmethod(lambda text: list(text.encode()))
    decode = staticmethod(lambda ids: bytes(i for i in ids if i < 256).decode(errors="replace"))


def test_rollout_throughput_scales_with_replicas_and_the_trainer_idles_less():
    """Generators of fixed per-token latency (sleep: no cores used): 4 replicas give several
    times the rollouts/s of 1 (loose bound; the benchmark reports the ratio), the trainer
    waits less."""
    one, idle_one = _throughput(1)
    four, idle_four = _throughput(4)
    print(f"rollouts/s: 1 replica {one:.1f}, 4 replicas {four:.1f} ({four / one:.2f}x); "
          f"trainer idle {idle_one:.2f} -> {idle_four:.2f}")  # fmt: skip
    assert four >= 2.5 * one
    assert idle_four < idle_one


def test_rewards_are_scored_in_parallel_by_the_pool(tokenizer):
    """Guards the worker pool: each score waits at a 4-party barrier, which only 4 scorers
    running at once can pass (one after another, every wait times out: status "error")."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    barrier = threading.Barrier(4, timeout=5.0)

    class Meeting(_LowIdTask):
        def score(self, prompt, response_ids):
            barrier.wait()
            return RewardResult(1.0, "correct")

    sampling = SamplingParams(max_new_tokens=2)
    request = RolloutRequest(step=0, group=0, num_groups=2, index=0, seed=0)
    with ThreadPoolExecutor(4) as pool:
        source = TaskRollouts(
            Meeting(tokenizer, _sums), num_prompts=2, group_size=4, sampling=sampling, pool=pool
        )
        batch = source(LatencyGenerator(token_latency_s=0.0), request)
    assert batch.statuses == ["correct"] * 8


def test_bad_dataflow_input_is_refused_before_any_work(tokenizer):
    with pytest.raises(ValueError, match="DataflowConfig.groups_per_request=0"):
        DataflowConfig(groups_per_request=0)
    with pytest.raises(ValueError, match="DataflowConfig.rollout_workers=0"):
        DataflowConfig(rollout_workers=0)
    cfg = _config(tokenizer, num_prompts=3)
    with pytest.raises(
        ValueError, match="groups_per_request=2 must divide GRPOConfig.num_prompts=3"
    ):
        Controller(
            LatencyPolicy(step_s=0.0), LatencyGenerator(token_latency_s=0.0), lambda g, r: None,
            cfg, DataflowConfig(groups_per_request=2),
        )  # fmt: skip
    with pytest.raises(TypeError, match="source must be a callable"):
        Controller(LatencyPolicy(step_s=0.0), LatencyGenerator(token_latency_s=0.0), 3, cfg)
    with pytest.raises(ValueError, match="Router needs at least one replica"):
        Router([])
