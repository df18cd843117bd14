"""Rewards: arithmetic task, exact match and boxed math answers (code rewards: test_sandbox)."""

from __future__ import annotations

import pytest

from titan_rl import (
    ArithmeticTask,
    arithmetic_problem,
    boxed_math_reward,
    exact_match_reward,
)


def test_arithmetic_problems_match_the_app_corpus():
    # Golden values produced by titan_train.data.arithmetic.arithmetic_problem (the app's copy).
    got = [arithmetic_problem(s, i) for s, i in [(0, 0), (0, 1), (0, 2), (7, 123), (1, 5)]]
    assert [(p.prompt, p.answer) for p in got] == [
        ("12*6=", "72"),
        ("72+97=", "169"),
        ("11+10=", "21"),
        ("73+65=", "138"),
        ("61-26=", "35"),
    ]
    assert [arithmetic_problem(3, i, max_operand=999).prompt for i in range(4)] == [
        "12+587=",
        "6*9=",
        "779+209=",
        "10*8=",
    ]


def test_arithmetic_task_prompts_and_scores(tokenizer):
    task = ArithmeticTask(tokenizer, seed=0)
    (prompt,) = task.prompts(1, 1)
    assert prompt.ids == [tokenizer.bos_id, *b"72+97="] and prompt.answer == "169"
    eos = tokenizer.eos_id
    assert task.score(prompt, [*b"169", eos]).status == "correct"
    assert task.score(prompt, [*b"169", eos]).score == 1.0
    assert task.score(prompt, [*b"168", eos]).status == "wrong"
    assert task.score(prompt, [*b"1x9", eos]).status == "unparseable"
    assert task.score(prompt, [*b"169"]).status == "truncated"  # no EOS: not an answer


def test_exact_match():
    assert exact_match_reward(" 42 ", "42").score == 1.0
    assert exact_match_reward("41", "42").status == "wrong"


@pytest.mark.parametrize(
    ("completion", "answer", "status"),
    [
        (r"so the answer is \boxed{42}.", "42", "correct"),
        (r"\boxed{1} then \boxed{\frac{1}{2}}", "0.5", "correct"),
        (r"\boxed{ 1,000 }", "1000", "correct"),
        (r"\boxed{\text{yes}}", "yes", "correct"),
        (r"\boxed{x^{2}}", "x^{2}", "correct"),
        (r"\boxed{41}", "42", "wrong"),
        ("the answer is 42", "42", "unparseable"),
        (r"\boxed{42", "42", "unparseable"),
    ],
)
def test_boxed_math_reward(completion, answer, status):
    result = boxed_math_reward(completion, answer)
    assert result.status == status
    assert result.score == (1.0 if status == "correct" else 0.0)


def test_digit_credit_rewards_right_digits_below_an_exact_answer(tokenizer):
    task = ArithmeticTask(tokenizer, seed=0, digit_credit=0.5)
    (prompt,) = task.prompts(1, 1)  # 72+97= -> 169
    eos = tokenizer.eos_id
    assert task.score(prompt, [*b"169", eos]).score == 1.0
    assert task.score(prompt, [*b"168", eos]).score == pytest.approx(0.5 * 2 / 3)
    assert task.score(prompt, [*b"69", eos]).score == 0.0  # wrong length: no credit
    with pytest.raises(ValueError, match="digit_credit"):
        ArithmeticTask(tokenizer, digit_credit=1.0)
