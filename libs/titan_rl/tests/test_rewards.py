"""Rewards: arithmetic task, boxed math answers, and the code sandbox's limits."""

from __future__ import annotations

import os
import time

import pytest

from titan_rl import (
    ArithmeticTask,
    SandboxLimits,
    arithmetic_problem,
    boxed_math_reward,
    code_reward,
    exact_match_reward,
    run_sandboxed,
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


LIMITS = SandboxLimits(wall_time_s=2.0, memory_bytes=256 * 2**20)


def test_sandbox_runs_a_program():
    result = run_sandboxed("print(int(input()) * 2)", stdin="21\n", limits=LIMITS)
    assert (result.status, result.stdout) == ("ok", "42\n")


def test_sandbox_limits_always_return_a_failed_run():
    """An infinite loop, a memory bomb, a network attempt and a fork-and-sleep each fail
    within the limit, and the calling process is unaffected."""
    pid = os.getpid()
    cases = {
        "timeout": "while True:\n    pass\n",
        "memory": "chunks = []\nwhile True:\n    chunks.append(bytearray(50 * 2**20))\n",
        "network": (
            "import _socket\n"  # below the socket guard: only the namespace stops it
            "s = _socket.socket()\ns.settimeout(3)\ns.connect(('1.1.1.1', 80))\nprint('connected')\n"
        ),
        "fork": "import subprocess, time\nsubprocess.Popen(['sleep', '60'])\ntime.sleep(60)\n",
    }
    results = {}
    for name, code in cases.items():
        start = time.perf_counter()
        results[name] = run_sandboxed(code, limits=LIMITS)
        assert time.perf_counter() - start < LIMITS.wall_time_s + 5.0, name
    assert results["timeout"].status == "timeout"
    assert results["memory"].status == "memory"
    assert results["network"].status == "error" and "connected" not in results["network"].stdout
    assert results["fork"].status == "timeout"
    assert os.getpid() == pid
    print({k: (r.status, r.network_isolation, round(r.wall_s, 2)) for k, r in results.items()})


def test_sandbox_network_uses_a_namespace_where_allowed():
    result = run_sandboxed("print('hi')", limits=LIMITS)
    # On the development machines (root, or unprivileged user namespaces on) the child gets an
    # empty network namespace; elsewhere the weaker socket guard is reported, not hidden.
    assert result.network_isolation in ("namespace", "socket_guard")
    assert result.status == "ok"


def test_code_reward_counts_passing_tests():
    code = "a, b = map(int, input().split())\nprint(a + b)\n"
    assert code_reward(code, [("1 2", "3"), ("5 5", "10")], limits=LIMITS).status == "correct"
    partial = code_reward(code, [("1 2", "3"), ("5 5", "11")], limits=LIMITS)
    assert (partial.score, partial.status) == (0.5, "wrong")
    crash = code_reward("raise SystemExit(3)", [("", "")], limits=LIMITS)
    assert (crash.score, crash.status) == (0.0, "error")
    with pytest.raises(ValueError, match="at least one"):
        code_reward(code, [])


def test_bad_sandbox_limits_are_refused():
    with pytest.raises(ValueError, match="wall_time_s"):
        SandboxLimits(wall_time_s=0)
    with pytest.raises(ValueError, match="memory_bytes"):
        SandboxLimits(memory_bytes=1024)


def test_digit_credit_rewards_right_digits_below_an_exact_answer(tokenizer):
    task = ArithmeticTask(tokenizer, seed=0, digit_credit=0.5)
    (prompt,) = task.prompts(1, 1)  # 72+97= -> 169
    eos = tokenizer.eos_id
    assert task.score(prompt, [*b"169", eos]).score == 1.0
    assert task.score(prompt, [*b"168", eos]).score == pytest.approx(0.5 * 2 / 3)
    assert task.score(prompt, [*b"69", eos]).score == 0.0  # wrong length: no credit
    with pytest.raises(ValueError, match="digit_credit"):
        ArithmeticTask(tokenizer, digit_credit=1.0)
