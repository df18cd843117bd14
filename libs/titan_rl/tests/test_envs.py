"""The shipped environments: deterministic, their oracle's transcript earns full reward when
played through a rollout, wrong answers do not, and only the assistant's tokens are trained on."""

from __future__ import annotations

import pytest
import torch

from titan_rl import Generation, Message, SamplingParams, SimpleChatRenderer, run_episode
from titan_rl.envs import (
    BM25,
    ArithmeticConfig,
    ArithmeticToolEnv,
    CodeEnv,
    SearchConfig,
    SearchEnv,
    SortingConfig,
    SortingEnv,
)


class ReplayGenerator:
    """Emits the given turns' canonical ids (what a policy trained on them would sample)."""

    def __init__(self, turns):
        self.turns, self.calls, self.weight_version = turns, 0, 0

    def generate(self, prompts, params, seeds):
        ids = self.turns[self.calls]
        self.calls += 1
        n = len(ids)
        lp = torch.full((1, n), -1.0)
        return Generation(
            torch.tensor([ids]), torch.ones(1, n, dtype=torch.bool), lp, lp, ["stop"], 0
        )

    def update_weights(self, state_dict, version):
        pass


ENVS = {
    "sorting": lambda: SortingEnv(),
    "sorting-with-a-mistake": lambda: SortingEnv(),
    "arithmetic-tool": lambda: ArithmeticToolEnv(),
    "arithmetic-in-head": lambda: ArithmeticToolEnv(),
    "search": lambda: SearchEnv(SearchConfig(num_towns=60)),
    "code": lambda: CodeEnv(),
}
DEMO = {
    "sorting-with-a-mistake": {"mistakes": 1},
    "arithmetic-in-head": {"use_tool": False},
}


@pytest.mark.parametrize("name", list(ENVS))
def test_demonstration_played_through_a_rollout_earns_the_reward(tokenizer, name):
    """The oracle's turns, sampled verbatim, get the environment's own replies (the
    transcript), full reward, and the rendered transcript's ids and mask: the environment's
    messages (tool outputs, feedback) are never trained on."""
    env, seed = ENVS[name](), 7
    demo = env.demonstration(seed, **DEMO.get(name, {}))
    renderer = SimpleChatRenderer(tokenizer)
    turns, history = [], []
    for m in demo:
        if m.role == "assistant":
            turns.append(renderer.assistant_ids(history, m))
        history.append(m)
    params = SamplingParams(max_new_tokens=256)
    ep = run_episode(env, ReplayGenerator(turns), renderer, params, seed=seed, max_turns=8)
    assert ep.messages == demo
    assert ep.status == "done" and ep.reward_status == "correct"
    expected = 0.75 if name == "sorting-with-a-mistake" else 1.0  # one retry's penalty
    assert ep.total_reward == expected
    whole = renderer.render(demo)
    assert ep.prompt + ep.tokens == whole.ids
    trained = [t for t, m in zip(ep.tokens, ep.model_mask, strict=True) if m]
    want = [t for m in demo if m.role == "assistant" for t in renderer.assistant_ids([], m)]
    assert trained == want
    for m in demo[1:]:
        if m.role != "assistant":  # environment text sits in the masked-out ids only
            env_text = tokenizer.decode(
                [t for t, k in zip(ep.tokens, ep.model_mask, strict=True) if not k]
            )
            assert m.content in env_text


@pytest.mark.parametrize("name", ["sorting", "arithmetic-tool", "search", "code"])
def test_problems_are_deterministic_given_the_seed(name):
    a, b = ENVS[name](), ENVS[name]()
    assert a.problem(3) == b.problem(3) and a.reset(3) == b.reset(3)
    assert len({str(a.problem(s)) for s in range(10)}) >= 8


def test_sorting_feedback_names_the_wrong_positions():
    env = SortingEnv(SortingConfig(min_words=4, max_words=4, max_attempts=2))
    (prompt,) = env.reset(0)
    words = prompt.content.removeprefix("sort: ").split()
    want = sorted(words)
    swapped = [want[1], want[0], *want[2:]]
    reply = env.step(Message("assistant", " ".join(swapped)))
    assert (reply.done, reply.reward, reply.messages[0].content) == (False, 0.0, "wrong: 1 2")
    final = env.step(Message("assistant", "not the words"))
    assert (final.done, final.reward, final.info["status"]) == (True, 0.0, "unparseable")


def test_calculator_runs_in_the_sandbox_and_refuses_anything_but_arithmetic():
    env = ArithmeticToolEnv()
    _, expression, answer = env.problem(1)
    env.reset(1)
    reply = env.step(Message("assistant", f"<calc>{expression}</calc>"))
    assert reply.messages[0].content == answer and not reply.done
    assert env.calculate("__import__('os').getcwd()") == "error"  # never run
    assert env.calculate("1/0") == "error"  # ran, failed
    wrong = env.step(Message("assistant", str(int(answer) + 1)))
    assert (wrong.reward, wrong.info["status"], wrong.info["tool_calls"]) == (0.0, "wrong", 1)


def test_arithmetic_problems_need_more_than_a_head_for_small_numbers():
    """Most products have 4-5 digits: the tool is what earns reward for a tiny model."""
    only = ArithmeticToolEnv(ArithmeticConfig(operations=("*",)))
    assert all("*" in only.problem(s)[1] for s in range(50))
    env = ArithmeticToolEnv()
    products = [env.problem(s) for s in range(200) if "*" in env.problem(s)[1]]
    assert len(products) > 80 and sum(len(answer) >= 4 for *_, answer in products) > 0.9 * len(
        products
    )


def test_bm25_ranks_the_town_named_in_the_query_first():
    env = SearchEnv(SearchConfig(num_towns=100))
    for seed in range(30):
        _, query, answer = env.problem(seed)
        town = query.split()[0]
        best = env.index.search(query, 1)[0]
        assert env.towns[best]["town"] == town and answer in env.documents[best]
    with pytest.raises(ValueError, match="at least one document"):
        BM25([])


def test_code_env_scores_partial_solutions_and_contains_bad_ones():
    env = CodeEnv()
    env.reset(1)
    wrong = env.step(Message("assistant", "```python\ndef f(xs):\n    return 0\n```"))
    assert not wrong.done and wrong.messages[0].content.startswith("f(")  # a failing input back
    hang = env.step(Message("assistant", "```python\ndef f(xs):\n    while True: pass\n```"))
    assert hang.done and hang.reward == 0.0 and hang.info["sandbox"] == "timeout"


def test_arithmetic_fixed_layout_puts_every_number_at_the_same_place():
    from titan_rl.envs import ArithmeticConfig, ArithmeticToolEnv

    env = ArithmeticToolEnv(
        ArithmeticConfig(min_operand=32, max_operand=99, operations=("*",), fixed_layout=True)
    )
    problems = [env.problem(seed) for seed in range(50)]
    questions = [q for q, _, _ in problems]
    assert len({len(q) for q in questions}) == 1  # one wording, 3-letter names, 2-digit operands
    digits = {tuple(i for i, c in enumerate(q) if c.isdigit()) for q in questions}
    assert len(digits) == 1
    assert all(len(answer) == 4 for _, _, answer in problems)  # 32 * 32 = 1024 and up
    with pytest.raises(ValueError, match="fixed_layout=True words products only"):
        ArithmeticConfig(fixed_layout=True)
