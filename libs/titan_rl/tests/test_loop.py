"""The GRPO loop: sync vs async bitwise, the staleness bound, and bad rollouts."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from titan_rl import (
    ExactMatchTask,
    Generation,
    GRPOConfig,
    GRPOTrainer,
    LossConfig,
    SamplingParams,
    TorchGenerator,
    collect_rollouts,
)

pytestmark = pytest.mark.usefixtures("single_thread")


def _config(tokenizer, **overrides) -> GRPOConfig:
    base = dict(
        num_prompts=2,
        group_size=4,
        sampling=SamplingParams(max_new_tokens=4, stop_token_ids=(tokenizer.eos_id,)),
        loss=LossConfig(correction="tis"),
        seed=3,
    )
    return GRPOConfig(**{**base, **overrides})


def _run(model_factory, tokenizer, steps: int, **overrides):
    model = model_factory(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # Reward: the response starts with an id below 128 (about half of a random model's).
    task = _LowIdTask(tokenizer)
    trainer = GRPOTrainer(model, optimizer, task, _config(tokenizer, **overrides))
    history = trainer.train(steps)
    return model, history


def _sums(index: int) -> tuple[str, str]:
    return f"{index}+{index}=", str(2 * index)


def _task(tokenizer) -> ExactMatchTask:
    return ExactMatchTask(tokenizer, _sums)


class _LowIdTask(ExactMatchTask):
    def __init__(self, tokenizer):
        super().__init__(tokenizer, _sums)

    def score(self, prompt, response_ids):
        from titan_rl import RewardResult

        ok = bool(response_ids) and response_ids[0] < 128
        return RewardResult(float(ok), "correct" if ok else "wrong")


def test_async_with_zero_staleness_equals_sync_bitwise(model_factory, tokenizer):
    sync_model, sync_hist = _run(model_factory, tokenizer, 3, mode="sync")
    async_model, async_hist = _run(model_factory, tokenizer, 3, mode="async", max_offpolicy_steps=0)
    for (name, a), (_, b) in zip(
        sync_model.state_dict().items(), async_model.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
    assert [h["loss"] for h in sync_hist] == [h["loss"] for h in async_hist]
    assert [h["batch_weight_version"] for h in async_hist] == [0, 1, 2]
    assert all(h["grad_norm"] > 0 for h in sync_hist)  # the run actually trained
    assert [h["grad_norm"] for h in sync_hist] == [h["grad_norm"] for h in async_hist]


def test_async_never_trains_on_a_batch_older_than_the_bound(model_factory, tokenizer):
    for bound in (1, 2):
        _, hist = _run(model_factory, tokenizer, 5, mode="async", max_offpolicy_steps=bound)
        lags = [h["trainer_version"] - h["batch_weight_version"] for h in hist]
        assert all(0 <= lag <= bound for lag in lags), (bound, lags)
        assert [h["staleness"] for h in hist] == lags
        print(f"max_offpolicy_steps={bound}: observed lags {lags}")


def test_trainer_refuses_a_batch_outside_the_bound(model_factory, tokenizer):
    model = model_factory()
    task = _task(tokenizer)
    cfg = _config(tokenizer, mode="async", max_offpolicy_steps=1)
    trainer = GRPOTrainer(model, torch.optim.SGD(model.parameters(), lr=0.0), task, cfg)
    batch = collect_rollouts(
        trainer.generator, task, step=0, num_prompts=2, group_size=4, sampling=cfg.sampling
    )
    trainer.version = 2  # the batch (version 0) is now two updates stale
    with pytest.raises(RuntimeError, match="lag 2 outside"):
        trainer.step(batch)


def test_a_raising_reward_is_a_logged_failed_reward(model_factory, tokenizer, caplog):
    class Broken(ExactMatchTask):
        def score(self, prompt, response_ids):
            raise KeyError("verifier bug")

    gen = TorchGenerator(model_factory())
    batch = collect_rollouts(
        gen, Broken(tokenizer, _sums), step=0, num_prompts=2, group_size=2,
        sampling=SamplingParams(max_new_tokens=2),
    )  # fmt: skip
    assert batch.statuses == ["error"] * 4 and torch.equal(batch.rewards, torch.zeros(4))
    assert "reward function raised KeyError" in caplog.text


def test_a_generator_with_mismatched_lengths_is_refused(model_factory, tokenizer):
    class Broken(TorchGenerator):
        def generate(self, prompts, params, seeds):
            out = super().generate(prompts, params, seeds)
            return dataclasses.replace(out, logprobs=out.logprobs[:, :-1])

    gen = Broken(model_factory())
    with pytest.raises(ValueError, match="logprobs has shape"):
        collect_rollouts(
            gen, _task(tokenizer), step=0, num_prompts=2, group_size=2,
            sampling=SamplingParams(max_new_tokens=3),
        )  # fmt: skip
    assert isinstance(gen.generate([[1]], SamplingParams(max_new_tokens=1), [0]), Generation)


def test_bad_loop_config_is_refused(tokenizer, tiny_model):
    for kwargs, field in [
        ({"group_size": 1}, "group_size"),
        ({"num_prompts": 0}, "num_prompts"),
        ({"mode": "eager"}, "mode"),
        ({"max_offpolicy_steps": -1}, "max_offpolicy_steps"),
    ]:
        with pytest.raises(ValueError, match=f"GRPOConfig.{field}"):
            _config(tokenizer, **kwargs)
    with pytest.raises(ValueError, match="needs a ref_model"):
        GRPOTrainer(
            tiny_model,
            torch.optim.SGD(tiny_model.parameters(), lr=0.1),
            _task(tokenizer),
            _config(tokenizer, loss=LossConfig(kl_coef=0.1)),
        )


def test_minibatches_reuse_a_batch_and_the_clip_range_acts(model_factory, tokenizer):
    """Two optimizer steps per batch against the step's fixed proximal policy: with a large
    learning rate the second update's ratios leave the clip range; one version per batch."""
    model = model_factory()
    cfg = _config(tokenizer, num_minibatches=2)
    trainer = GRPOTrainer(
        model, torch.optim.SGD(model.parameters(), lr=20.0), _LowIdTask(tokenizer), cfg
    )
    hist = trainer.train(3)
    assert trainer.version == 3 and [h["batch_weight_version"] for h in hist] == [0, 1, 2]
    assert max(h["clip_fraction"] for h in hist) > 0
    with pytest.raises(ValueError, match="num_minibatches=3 must divide the 8 rows"):
        trainer.config.num_minibatches = 3
        trainer.train(1)


def test_a_loss_is_chosen_by_name_and_a_registered_one_is_used(model_factory, tokenizer):
    """``LossConfig.name`` picks the policy loss the learner calls: a registered function
    is called on every minibatch, and the built-ins differ where they should (Dr. GRPO's
    advantages keep the group's scale)."""
    import titan_rl

    calls = []

    def halved(logprobs, old_logprobs, advantages, mask, config, **kw):
        calls.append(tuple(advantages.shape))
        out = titan_rl.grpo_loss(logprobs, old_logprobs, advantages, mask, config, **kw)
        return dataclasses.replace(out, loss=out.loss * 0.5)

    titan_rl.register_loss("halved_grpo", halved, replace=True)
    with pytest.raises(ValueError, match="registered already"):
        titan_rl.register_loss("halved_grpo", halved)
    loss = LossConfig(name="halved_grpo", correction="tis")
    _run(model_factory, tokenizer, 2, loss=loss, num_minibatches=2)
    assert calls == [(4,)] * 4  # 2 steps x 2 minibatches of 4 rows
    _, grpo = _run(model_factory, tokenizer, 1)
    _, dr = _run(model_factory, tokenizer, 1, loss=LossConfig(name="dr_grpo", correction="tis"))
    assert grpo[0]["reward_mean"] == dr[0]["reward_mean"]  # the same rollouts
    # On this first, on-policy step both losses are 0 up to rounding (each group's advantages
    # sum to 0), so they cannot tell the two apart; their gradients can: binary rewards have a
    # group std below 0.6, so GRPO's std-normalised advantages are > 1.7x Dr. GRPO's raw ones
    # (every response has the same length here, so the two means agree).
    assert grpo[0]["grad_norm"] > 1.5 * dr[0]["grad_norm"] > 0
    with pytest.raises(ValueError, match=r"LossConfig.name='ppo' is not a registered loss"):
        LossConfig(name="ppo")
