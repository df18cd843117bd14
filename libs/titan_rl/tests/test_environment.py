"""Multi-turn episodes with the code tool, and their log-probs in batch-invariant mode."""

from __future__ import annotations

import pytest
import torch

from titan_rl import (
    CodeToolEnv,
    Generation,
    Message,
    SamplingParams,
    SimpleChatRenderer,
    StepResult,
    TorchGenerator,
    batch_invariant,
    episode_tensors,
    run_episode,
    sequence_logprobs,
)

pytestmark = pytest.mark.usefixtures("single_thread")


class ScriptedGenerator:
    """Replies with fixed texts, one per turn (the environment mechanics without a model)."""

    def __init__(self, tokenizer, turns: list[str]) -> None:
        self.tokenizer, self.turns, self.weight_version, self.calls = tokenizer, turns, 7, 0

    def generate(self, prompts, params, seeds):
        assert len(prompts) == 1
        ids = [*self.tokenizer.encode(self.turns[self.calls]), self.tokenizer.eos_id]
        self.calls += 1
        n = len(ids)
        return Generation(
            torch.tensor([ids]), torch.ones(1, n, dtype=torch.bool), torch.full((1, n), -0.5),
            torch.full((1, n), -0.5), ["stop"], self.weight_version,
        )  # fmt: skip

    def update_weights(self, state_dict, version):
        self.weight_version = version


def plain(tokenizer):
    """The layout of the old text protocol: BOS, then raw text (no role prefixes)."""
    roles = {"system": "", "user": "", "tool": "", "assistant": ""}
    return SimpleChatRenderer(tokenizer, roles=roles, separator="")


def test_code_tool_runs_sandboxed_code_and_scores_the_boxed_answer(tokenizer):
    env = CodeToolEnv([("What is 6*7?", "42")])
    gen = ScriptedGenerator(tokenizer, ["```python\nprint(6*7)\n```", "so \\boxed{42}"])
    ep = run_episode(env, gen, plain(tokenizer), SamplingParams(max_new_tokens=32), seed=0)
    assert (ep.turns, ep.total_reward, env.last_result.status) == (2, 1.0, "correct")
    text = tokenizer.decode(ep.tokens)
    assert "```output\n42\n```" in text  # the tool's stdout came back as an observation
    tool_reply = tokenizer.encode("\n```output\n42\n```\n")
    assert ep.model_mask.count(False) == len(tool_reply)
    assert ep.weight_versions == [7, 7]


def test_code_tool_reports_a_failing_program_and_a_missing_answer(tokenizer):
    env = CodeToolEnv(
        [("loop", "0")],
    )
    gen = ScriptedGenerator(tokenizer, ["```python\nwhile True: pass\n```", "I give up"])
    ep = run_episode(env, gen, plain(tokenizer), SamplingParams(max_new_tokens=32), seed=0)
    assert "[timeout]" in tokenizer.decode(ep.tokens)
    assert (ep.total_reward, env.last_result.status) == (0.0, "unparseable")
    assert (ep.status, ep.reward_status) == ("done", "unparseable")
    assert isinstance(env.step(Message("assistant", "\\boxed{1}")), StepResult)


def test_multi_turn_logprobs_equal_trainer_recompute_in_batch_invariant_mode(tokenizer, tiny_model):
    """A real model's turns, with tool replies in between: the trainer's one forward over the
    whole episode gives the generator's log-probs on every model token, bit for bit."""

    class EchoEnv:
        def reset(self, seed):
            return [Message("user", "7+8=")]

        def step(self, message):
            return StepResult([Message("tool", " ok? ")], 0.0, False)

    gen = TorchGenerator(tiny_model, batch_invariant=True)
    params = SamplingParams(max_new_tokens=5)
    renderer = SimpleChatRenderer(tokenizer)
    episodes = [run_episode(EchoEnv(), gen, renderer, params, seed=s, max_turns=3) for s in (1, 2)]
    tokens, mask, logprobs = episode_tensors(episodes)
    assert not mask.all() and mask.any()
    with torch.no_grad(), batch_invariant():
        recomputed = sequence_logprobs(tiny_model, [e.prompt for e in episodes], tokens, mask)
    assert torch.equal(recomputed[mask], logprobs[mask])
