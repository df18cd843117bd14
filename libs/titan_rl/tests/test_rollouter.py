"""Groups of multi-turn rollouts: reproducible, recorded per turn, scored by a rubric, and
trained as they are by GRPOTrainer with a generator-vs-trainer log-prob gap of exactly 0."""

from __future__ import annotations

import pytest
import torch

from titan_rl import (
    ExactMatchTask,
    GRPOConfig,
    GRPOTrainer,
    LossConfig,
    Message,
    RewardFunction,
    RolloutBatch,
    RolloutConfig,
    Rollouter,
    Rubric,
    SamplingParams,
    SimpleChatRenderer,
    StepResult,
    TorchGenerator,
    batch_invariant,
    episode_tensors,
    sequence_logprobs,
    shortest_correct_bonus,
)

pytestmark = pytest.mark.usefixtures("single_thread")


class CountEnv:
    """Three turns: a tool reply after each of the first two, a reward for each turn's
    length parity (so rewards differ inside a group)."""

    def __init__(self, item):
        self.item, self.turn = item, 0

    def reset(self, seed):
        return [Message("system", "count"), Message("user", f"from {self.item}")]

    def step(self, message):
        self.turn += 1
        reward = float(len(message.content) % 2)
        if self.turn == 3:
            return StepResult((), reward, True, {"status": "correct" if reward else "wrong"})
        return StepResult([Message("tool", f"n={self.turn}")], reward, False)


def make_rollouter(tokenizer, rubric=None, **config):
    cfg = RolloutConfig(sampling=SamplingParams(max_new_tokens=4), max_turns=3, **config)
    return Rollouter(
        env_factory=CountEnv,
        renderer=SimpleChatRenderer(tokenizer),
        config=cfg,
        rubric=rubric,
        dataset=["a", "bb", "ccc"],
    )


def test_rollout_group_is_reproducible_and_independent_of_the_batch(tokenizer, tiny_model):
    """Same seed, same episodes (environments stepped on one thread or three); a member's
    episode does not depend on the group's size (each turn's seed is fixed by (seed, index,
    member, turn); batch-invariant generator)."""
    gen = TorchGenerator(tiny_model, batch_invariant=True)
    rollouter = make_rollouter(tokenizer)
    three = rollouter.rollout_group(gen, 1, 3, seed=5)
    again = make_rollouter(tokenizer, env_workers=3).rollout_group(gen, 1, 3, seed=5)
    two = rollouter.rollout_group(gen, 1, 2, seed=5)
    other = rollouter.rollout_group(gen, 1, 3, seed=6)
    assert three == again
    assert three[:2] == two
    assert [e.tokens for e in three] != [e.tokens for e in other]
    assert len({tuple(e.tokens) for e in three}) == 3  # members sample differently
    for e in three:
        assert e.turns == 3 and e.status == "done" and e.weight_versions == [0, 0, 0]
        assert e.messages[1].content == "from bb"  # the dataset's item reached the env
        assert len(e.turn_rewards) == 3 and e.reward == e.total_reward
        assert e.reward_breakdown == {"environment": e.total_reward}
        for _, start, end in e.turn_spans:  # model turns: masked in, log-probs recorded
            assert all(e.model_mask[start:end]) and all(lp < 0 for lp in e.logprobs[start:end])
        env_ids = [t for t, m in zip(e.tokens, e.model_mask, strict=True) if not m]
        assert tokenizer.decode(env_ids).count("tool: n=") == 2


def test_weight_version_of_every_turn_is_recorded(tokenizer, tiny_model):
    """A weight push between turns shows in the episode's per-turn versions."""

    class Pushing(TorchGenerator):
        def generate(self, prompts, params, seeds):
            out = super().generate(prompts, params, seeds)
            self.weight_version += 1  # as if a push landed after every call
            return out

    gen = Pushing(tiny_model, batch_invariant=True)
    (episode,) = make_rollouter(tokenizer).rollout_group(gen, 0, 1, seed=0)
    assert episode.weight_versions == [0, 1, 2]


def test_rubric_weights_functions_and_scores_a_raising_one_as_error(tokenizer, tiny_model):
    def broken(episode):
        raise RuntimeError("verifier bug")

    rubric = Rubric(
        [
            RewardFunction("environment", lambda e: e.total_reward, weight=2.0),
            RewardFunction("broken", broken, weight=5.0),
            RewardFunction("shortest", shortest_correct_bonus, weight=0.5, per="group"),
        ]
    )
    gen = TorchGenerator(tiny_model, batch_invariant=True)
    episodes = make_rollouter(tokenizer, rubric).rollout_group(gen, 2, 4, seed=1)
    bonus = [e.reward_breakdown["shortest"] for e in episodes]
    assert sum(bonus) == (1.0 if any(e.total_reward >= 1 for e in episodes) else 0.0)
    for e, b in zip(episodes, bonus, strict=True):
        assert e.reward_breakdown["broken"] == 0.0 and e.reward_status == "error"
        assert e.reward == pytest.approx(2.0 * e.total_reward + 0.5 * b)


@pytest.mark.parametrize(
    "loss",
    [
        LossConfig(correction="tis"),  # GRPO / DAPO clip-higher, TIS
        LossConfig(aggregation="seq_mean_token_sum_norm", correction="mis"),  # Dr. GRPO, MIS
    ],
    ids=["grpo-tis", "drgrpo-mis"],
)
def test_grpo_trainer_trains_multi_turn_episodes_with_zero_logprob_gap(tokenizer, tiny_model, loss):
    """``RolloutBatch.from_episodes`` feeds today's ``GRPOTrainer.step``: environment ids are
    context, not trained on; in batch-invariant mode the trainer's log-prob of every model
    token of every turn equals the generator's bit for bit."""
    gen = TorchGenerator(tiny_model, batch_invariant=True)
    rollouter = make_rollouter(tokenizer)
    groups = [rollouter.rollout_group(gen, i, 2, seed=0) for i in range(2)]
    batch = RolloutBatch.from_episodes(groups, step=0)
    episodes = [e for g in groups for e in g]
    tokens, mask, logprobs = episode_tensors(episodes)
    assert torch.equal(batch.generation.mask, mask) and not mask.all()
    assert batch.rewards.tolist() == [e.reward for e in episodes]

    # Every model token of every turn, generator vs trainer, with the env ids in between.
    with torch.no_grad(), batch_invariant():
        trainer_lp = sequence_logprobs(tiny_model, batch.prompts, tokens, mask)
    assert torch.equal(trainer_lp[mask], logprobs[mask])

    cfg = GRPOConfig(
        num_prompts=2,
        group_size=2,
        sampling=SamplingParams(max_new_tokens=4),
        loss=loss,
        batch_invariant=True,
    )
    task = ExactMatchTask(tokenizer, lambda i: ("unused", "0"))
    optimizer = torch.optim.SGD(tiny_model.parameters(), lr=1e-2)
    trainer = GRPOTrainer(tiny_model, optimizer, task, cfg, generator=gen)
    before = [p.detach().clone() for p in tiny_model.parameters()]
    metrics = trainer.step(batch)
    assert metrics["max_abs_logprob_diff"] == 0.0
    assert metrics["reward_statuses"] == batch.status_counts()
    if batch.rewards.std() > 0:  # a non-zero advantage moves the weights
        assert any(
            not torch.equal(a, b) for a, b in zip(before, tiny_model.parameters(), strict=True)
        )


def test_bad_inputs_are_refused(tokenizer, tiny_model):
    with pytest.raises(ValueError, match="max_turns"):
        RolloutConfig(sampling=SamplingParams(max_new_tokens=4), max_turns=0)
    gen = TorchGenerator(tiny_model)
    episodes = make_rollouter(tokenizer).rollout_group(gen, 0, 2, seed=0)
    with pytest.raises(ValueError, match="groups of one size"):
        RolloutBatch.from_episodes([episodes, episodes[:1]], step=0)
    with pytest.raises(ValueError, match="distinct"):
        Rubric([RewardFunction("a", len), RewardFunction("a", len)])


def test_multi_turn_groups_stay_multi_turn_through_the_work_buffer(tokenizer, tiny_model):
    # Guards the controller's packing: a step's batch of episode groups (masks with holes
    # where the environment's ids sit) was rebuilt as a plain Generation and refused.
    from titan_rl import RolloutRequest, WorkBuffer
    from titan_rl.buffer import pack_groups

    rollouter = make_rollouter(tokenizer)
    gen = TorchGenerator(tiny_model)
    groups = [
        RolloutBatch.from_episodes([rollouter.rollout_group(gen, i, 2, seed=0)], step=0)
        for i in range(2)
    ]
    mask = groups[0].generation.mask
    assert bool((mask[:, 1:] & ~mask[:, :-1]).any())  # a model turn after environment ids
    batch = pack_groups(0, groups)
    batch.generation.validate(4)  # holes allowed
    buffer = WorkBuffer(num_groups=2, max_offpolicy_steps=0, version=0)
    buffer.open()
    buffer.publish(0)
    buffer.put(RolloutRequest(step=0, group=0, num_groups=2, index=0, seed=0), batch)
    restored = WorkBuffer(num_groups=2, max_offpolicy_steps=0, version=0)
    restored.load_state_dict(buffer.state_dict())
    restored.open()
    for b in (buffer, restored):
        taken = pack_groups(0, b.take(0))
        taken.generation.validate(4)
        assert torch.equal(taken.generation.mask, batch.generation.mask)


def test_rollout_items_plays_many_problems_at_once_like_groups_of_one(tokenizer, tiny_model):
    # Evaluation plays every held-out problem in one lockstep batch; each episode must be the
    # one its own group of one would give (batch-invariant generator: bitwise).
    rollouter = make_rollouter(tokenizer)
    gen = TorchGenerator(tiny_model, batch_invariant=True)
    together = rollouter.rollout_items(gen, [0, 1, 2], seed=5)
    for i, episode in enumerate(together):
        (alone,) = rollouter.rollout_group(gen, i, 1, seed=5)
        assert episode.tokens == alone.tokens and episode.reward == alone.reward
        assert episode.messages[1].content == f"from {['a', 'bb', 'ccc'][i]}"
    with pytest.raises(ValueError, match="at least one index"):
        rollouter.rollout_items(gen, [], seed=0)


def test_packed_training_equals_padded_training_bitwise(tokenizer, tiny_model):
    # GRPOConfig.pack_sequences: the learner's log-probs over packed rows (no padding) are the
    # padded path's bits in batch-invariant mode (the generator-vs-trainer gap stays exactly
    # 0); the backward sums the weight gradients over other row layouts, so the updates agree
    # to rounding (1e-6), not bit for bit.
    import copy

    gen = TorchGenerator(tiny_model, batch_invariant=True)
    rollouter = make_rollouter(tokenizer)
    groups = [rollouter.rollout_group(gen, i, 2, seed=1) for i in range(2)]
    batch = RolloutBatch.from_episodes(groups, step=0)
    task = ExactMatchTask(tokenizer, lambda i: ("unused", "0"))
    results = []
    for pack in (False, True):
        model = copy.deepcopy(tiny_model)
        cfg = GRPOConfig(
            num_prompts=2,
            group_size=2,
            sampling=SamplingParams(max_new_tokens=4),
            batch_invariant=True,
            pack_sequences=pack,
        )
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
        trainer = GRPOTrainer(model, optimizer, task, cfg, generator=TorchGenerator(model))
        metrics = trainer.step(batch)
        assert metrics["max_abs_logprob_diff"] == 0.0
        results.append([p.detach().clone() for p in model.parameters()])
    moved = max(
        (a - b).abs().max() for a, b in zip(results[0], tiny_model.parameters(), strict=True)
    )
    assert moved > 1e-4
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
