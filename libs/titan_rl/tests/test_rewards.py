"""Rewards: the exact-match task, exact match and boxed math answers (code: test_sandbox)."""

from __future__ import annotations

import pytest

from titan_rl import ExactMatchTask, boxed_math_reward, exact_match_reward


def _sums(index: int) -> tuple[str, str]:
    """A stand-in corpus: problem ``i`` is ``"i+i="`` with answer ``2i``."""
    return f"{index}+{index}=", str(2 * index)


def test_exact_match_task_prompts_and_scores(tokenizer):
    task = ExactMatchTask(tokenizer, _sums)
    (prompt,) = task.prompts(36, 1)
    assert prompt.ids == [tokenizer.bos_id, *b"36+36="] and prompt.answer == "72"
    eos = tokenizer.eos_id
    assert task.score(prompt, [*b"72", eos]).status == "correct"
    assert task.score(prompt, [*b"72", eos]).score == 1.0
    assert task.score(prompt, [*b"71", eos]).status == "wrong"
    assert task.score(prompt, [*b"7x", eos]).status == "unparseable"
    assert task.score(prompt, [*b"72"]).status == "truncated"  # no EOS: not an answer
    assert task.completion_text([*b"72", eos, *b"9"]) == "72"
    assert [p.answer for p in task.prompts(3, 2)] == ["6", "8"]


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
    task = ExactMatchTask(tokenizer, _sums, digit_credit=0.5)
    (prompt,) = task.prompts(60, 1)  # 60+60= -> 120
    eos = tokenizer.eos_id
    assert task.score(prompt, [*b"120", eos]).score == 1.0
    assert task.score(prompt, [*b"121", eos]).score == pytest.approx(0.5 * 2 / 3)
    assert task.score(prompt, [*b"20", eos]).score == 0.0  # wrong length: no credit
    with pytest.raises(ValueError, match="digit_credit"):
        ExactMatchTask(tokenizer, _sums, digit_credit=1.0)
    with pytest.raises(TypeError, match="problem must be a callable"):
        ExactMatchTask(tokenizer, [("1+1=", "2")])
