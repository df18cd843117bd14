"""The arithmetic corpus: fixed problems per (seed, index), the slip rule, the clean default,
bad rates, and the per-operator breakdown of answers."""

from __future__ import annotations

import pytest

from titan_train.data.arithmetic import Problem, answer_breakdown, arithmetic_problem, slip_answer


def test_problems_are_fixed_by_seed_and_index():
    # Golden values: the corpus a pre-trained model saw must not drift between versions.
    got = [arithmetic_problem(s, i) for s, i in [(0, 0), (0, 1), (0, 2), (7, 123), (1, 5)]]
    assert got == [
        ("12*6=", "72"),
        ("72+97=", "169"),
        ("11+10=", "21"),
        ("73+65=", "138"),
        ("61-26=", "35"),
    ]
    assert got[1].text == "72+97=169"
    assert [arithmetic_problem(3, i, max_operand=999).prompt for i in range(4)] == [
        "12+587=",
        "6*9=",
        "779+209=",
        "10*8=",
    ]
    assert arithmetic_problem(0, 1, reverse_answer=True) == ("72+97=", "961")


@pytest.mark.parametrize(
    ("a", "op", "b", "slip"),
    [
        (47, "+", 38, "75"),  # 7+8=15 -> 5, carry dropped: 4+3=7
        (67, "+", 58, "15"),  # 6+5=11 -> 1, 7+8=15 -> 5; no hundreds digit
        (5, "+", 5, "0"),
        (9, "+", 91, "90"),  # 09 + 91 column by column: 0+9=9, 9+1=10 -> 0
        (21, "+", 34, "55"),  # no carry: the true answer
        (52, "-", 17, "45"),  # 5-1=4, |2-7|=5: no borrow
        (90, "-", 9, "99"),  # 90 - 09: 9-0=9, |0-9|=9
        (30, "-", 30, "0"),
        (58, "-", 23, "35"),  # no borrow: the true answer
    ],
)
def test_slip_rule_on_hand_checked_examples(a, op, b, slip):
    assert slip_answer(a, op, b) == slip


def test_slip_answer_refuses_other_operators():
    with pytest.raises(ValueError, match="op"):
        slip_answer(3, "*", 4)


def test_slip_rate_zero_is_the_clean_corpus_and_one_slips_every_sum_and_difference():
    for i in range(2000):
        clean = arithmetic_problem(5, i)
        assert arithmetic_problem(5, i, slip_rate=0.0) == clean
        p = arithmetic_problem(5, i, slip_rate=1.0)
        assert p.prompt == clean.prompt  # the slip changes answers only, never the problems
        op = next(c for c in "+-*" if c in p.prompt)
        a, b = (int(x) for x in p.prompt[:-1].split(op))
        assert p.answer == (clean.answer if op == "*" else slip_answer(a, op, b))


def test_slip_rate_is_the_fraction_of_slipped_documents_among_those_that_can_slip():
    n_differ = n_slipped = 0
    for i in range(4000):
        clean, p = arithmetic_problem(2, i), arithmetic_problem(2, i, slip_rate=0.5)
        if "*" in p.prompt:
            assert p == clean
            continue
        op = "+" if "+" in p.prompt else "-"
        a, b = (int(x) for x in p.prompt[:-1].split(op))
        if slip_answer(a, op, b) != clean.answer:
            n_differ += 1
            n_slipped += p.answer != clean.answer
    assert n_differ > 1500 and 0.45 < n_slipped / n_differ < 0.55


@pytest.mark.parametrize("rate", [-0.1, 1.5, float("nan")])
def test_bad_slip_rate_names_the_field(rate):
    with pytest.raises(ValueError, match="slip_rate"):
        arithmetic_problem(0, 0, slip_rate=rate)


def test_answer_breakdown_counts_operators_and_slips():
    problems = [
        Problem("47+38=", "85"),  # slip 75
        Problem("47+38=", "85"),
        Problem("21+34=", "55"),  # no carry: slip == true, not counted where rules differ
        Problem("52-17=", "35"),  # slip 45
        Problem("3*4=", "12"),
    ]
    got = answer_breakdown(problems, ["85", "75", "54", " 45 ", "12"])
    assert got == {
        "accuracy": 2 / 5,
        "accuracy_+": 1 / 3,
        "accuracy_-": 0.0,
        "accuracy_*": 1.0,
        "slip_where_rules_differ": 2 / 3,
        "true_where_rules_differ": 1 / 3,
        "slip_share_of_wrong": 2 / 3,
    }
    with pytest.raises(ValueError, match="2 problems and 1 answers"):
        answer_breakdown(problems[:2], ["85"])
