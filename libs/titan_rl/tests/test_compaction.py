"""Compaction: past the budget, a rollout continues in a new token sequence whose prompt is
the compacted context; every model turn is trained once, on the prefix it was sampled from."""

from __future__ import annotations

import pytest
import torch

from titan_rl import (
    DropToolOutputs,
    Generation,
    Message,
    RolloutBatch,
    RolloutConfig,
    Rollouter,
    SamplingParams,
    SimpleChatRenderer,
    StepResult,
    Summarize,
    TorchGenerator,
    batch_invariant,
    episode_tensors,
    sequence_logprobs,
)

pytestmark = pytest.mark.usefixtures("single_thread")


class LongToolEnv:
    """Every turn gets a 40-character tool output; the fifth turn ends the episode."""

    def __init__(self, item):
        self.turn = 0

    def reset(self, seed):
        return [Message("system", "find it"), Message("user", "go")]

    def step(self, message):
        self.turn += 1
        if self.turn == 5:
            return StepResult((), 1.0, True, {"status": "correct"})
        return StepResult([Message("tool", f"{self.turn}" * 40)], 0.0, False)


class ScriptedGenerator:
    """Row turns from a list of texts (then EOS); records each prompt it was shown."""

    def __init__(self, tokenizer, texts):
        self.tokenizer, self.texts, self.shown, self.weight_version = tokenizer, texts, [], 0

    def generate(self, prompts, params, seeds):
        (prompt,) = prompts
        ids = [*self.tokenizer.encode(self.texts[len(self.shown)]), self.tokenizer.eos_id]
        self.shown.append(list(prompt))
        n = len(ids)
        lp = torch.full((1, n), -0.5)
        return Generation(
            torch.tensor([ids]), torch.ones(1, n, dtype=torch.bool), lp, lp, ["stop"], 0
        )

    def update_weights(self, state_dict, version):
        pass


def rollouter(tokenizer, policy, max_context_tokens=None):
    config = RolloutConfig(
        sampling=SamplingParams(max_new_tokens=8),
        max_turns=8,
        compaction=policy,
        max_context_tokens=max_context_tokens,
    )
    return Rollouter(env_factory=LongToolEnv, renderer=SimpleChatRenderer(tokenizer), config=config)


def check_each_turn_trained_once_on_its_prefix(episode, shown):
    """The generator's k-th prompt is the prefix of the k-th model turn in its sequence, and
    the masked-in ids of all sequences are exactly the model turns, each once."""
    assert len(shown) == episode.turns
    for (seq, start, end), prompt in zip(episode.turn_spans, shown, strict=True):
        s = episode.sequences[seq]
        assert prompt == s.prompt + s.tokens[:start]
        assert all(s.model_mask[start:end])
    trained = sum(sum(s.model_mask) for s in episode.sequences)
    assert trained == sum(end - start for _, start, end in episode.turn_spans)


def test_drop_tool_outputs_replaces_the_oldest_and_starts_a_new_sequence(tokenizer):
    texts = ["a1", "a2", "a3", "a4", "a5"]
    gen = ScriptedGenerator(tokenizer, texts)
    policy = DropToolOutputs(budget_tokens=150, marker="[dropped]")
    (episode,) = rollouter(tokenizer, policy).rollout_group(gen, 0, 1, seed=0)
    assert episode.status == "done" and episode.turns == 5 and episode.total_reward == 1.0
    assert len(episode.sequences) >= 2
    check_each_turn_trained_once_on_its_prefix(episode, gen.shown)
    # Each new sequence's prompt is the conversation before its first turn, rendered with
    # every tool output but the newest replaced by the marker.
    renderer = SimpleChatRenderer(tokenizer)
    for turn, (seq, start, _) in enumerate(episode.turn_spans):
        if seq == 0 or start != 0:
            continue
        before = episode.messages[: 2 + 2 * turn]
        last_tool = max(i for i, m in enumerate(before) if m.role == "tool")
        context = [
            Message("tool", "[dropped]") if m.role == "tool" and i != last_tool else m
            for i, m in enumerate(before)
        ]
        prompt = episode.sequences[seq].prompt
        assert prompt == renderer.render(context, add_generation_prompt=True).ids
        assert "1" * 40 not in tokenizer.decode(prompt)
    assert episode.messages[-1] == Message("assistant", "a5")  # the transcript is uncompacted
    assert sum("1" * 40 in m.content for m in episode.messages) == 1
    with pytest.raises(ValueError, match="compacted"):
        RolloutBatch.from_episodes([[episode, episode]], step=0)


def test_summarize_asks_the_policy_and_continues_from_the_summary(tokenizer):
    texts = ["a1", "a2", "a3", "SUMMARY", "a4", "a5"]
    gen = ScriptedGenerator(tokenizer, texts)
    policy = Summarize(budget_tokens=200, instruction="summarise!", summary_prefix="so far: ")
    (episode,) = rollouter(tokenizer, policy).rollout_group(gen, 0, 1, seed=0)
    assert len(episode.sequences) == 2 and episode.status == "done"
    check_each_turn_trained_once_on_its_prefix(episode, gen.shown)
    first, second = episode.sequences
    # The summary is a model turn of the first sequence, after the instruction (not trained).
    seq, start, end = episode.turn_spans[3]
    assert seq == 0 and tokenizer.decode(first.tokens[start:end]) == "SUMMARY"
    assert "user: summarise!\n" in tokenizer.decode(first.tokens[:start])
    # The new context: the first messages and the summary, rendered as a prompt (masked).
    renderer = SimpleChatRenderer(tokenizer)
    context = [*episode.messages[:2], Message("user", "so far: SUMMARY")]
    assert second.prompt == renderer.render(context, add_generation_prompt=True).ids
    assert episode.turn_rewards[3] == 0.0 and episode.weight_versions == [0] * 6
    want = [
        Message("tool", "3" * 40),
        Message("user", "summarise!"),
        Message("assistant", "SUMMARY"),
    ]
    assert episode.messages[7:10] == want


def test_context_limit_ends_the_episode_without_a_policy(tokenizer):
    gen = ScriptedGenerator(tokenizer, ["a1", "a2", "a3", "a4", "a5"])
    (episode,) = rollouter(tokenizer, None, max_context_tokens=120).rollout_group(gen, 0, 1, seed=0)
    assert episode.status == "context" and len(episode.sequences) == 1
    assert len(episode.prompt) + len(episode.tokens) + 8 > 120  # no room for another turn


def test_compacted_sequences_keep_the_logprob_gap_at_zero(tokenizer, tiny_model):
    """A real model past the budget: each sequence, trained as a row of its own, gives the
    generator's log-prob on every model token bit for bit (batch-invariant mode)."""
    gen = TorchGenerator(tiny_model, batch_invariant=True)
    r = rollouter(tokenizer, DropToolOutputs(budget_tokens=110))
    episodes = r.rollout_group(gen, 0, 2, seed=4)
    rows = [s for e in episodes for s in e.sequences]
    assert len(rows) > len(episodes)  # compaction happened
    tokens, mask, logprobs = episode_tensors(rows)
    with torch.no_grad(), batch_invariant():
        recomputed = sequence_logprobs(tiny_model, [s.prompt for s in rows], tokens, mask)
    assert torch.equal(recomputed[mask], logprobs[mask])


def test_bad_policies_are_refused():
    with pytest.raises(ValueError, match="budget_tokens"):
        DropToolOutputs(budget_tokens=0)
    with pytest.raises(ValueError, match="roles"):
        DropToolOutputs(budget_tokens=10, roles=("assistant",))
    with pytest.raises(TypeError, match="compaction"):
        RolloutConfig(sampling=SamplingParams(max_new_tokens=2), compaction="drop")
