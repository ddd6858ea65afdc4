"""Unit tests of runtime/answer_scoring.py: the statistics, answer extraction and normalisation, the exact and regex
scorers, and MathVerifier's math-verify worker (including a real sympy hang, which it must kill and get past)."""
import math
import os
import signal
import threading
import time

import pytest

from runtime.answer_scoring import (MathVerifier, avg_at_k, extract_answer, extract_boxed, majority_at_k,
                                    normalise_answer, pass_at_k, score_exact, score_regex)

# --- pass@k, avg@k, majority@k ------------------------------------------------------------------------------------


def test_pass_at_k_known_values():
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 4) == 1.0
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - math.comb(3, 2) / math.comb(5, 2)) == pytest.approx(0.7)
    assert pass_at_k(6, 6, 3) == 1.0 and pass_at_k(1, 1, 1) == 1.0
    assert pass_at_k(6, 0, 3) == 0.0


def test_pass_at_k_matches_the_binomial_form_and_stays_stable_for_large_n():
    for n, c, k in [(10, 3, 1), (10, 3, 5), (20, 1, 7), (100, 50, 10)]:
        assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k))
    assert pass_at_k(100_000, 1, 1) == pytest.approx(1e-5)  # C(n, k) as floats would overflow here
    assert 0 < pass_at_k(100_000, 3, 500) < 1


@pytest.mark.parametrize("n, c, k, words", [(4, 1, 5, "k <= n"), (4, 1, 0, "k >= 1"), (4, 5, 1, "c <= n"),
                                            (4, -1, 1, "c <= n")])
def test_pass_at_k_refuses_impossible_arguments(n, c, k, words):
    with pytest.raises(ValueError, match=words):
        pass_at_k(n, c, k)


def test_avg_at_k_is_the_mean_score():
    assert avg_at_k([1.0, 0.0, 1.0, 1.0]) == 0.75
    with pytest.raises(ValueError):
        avg_at_k([])


def test_majority_at_k_votes_over_the_first_k_samples_only():
    answers = ["7", "7", "8", "8", "8"]
    scores = [1.0, 1.0, 0.0, 0.0, 0.0]
    assert majority_at_k(answers, scores, 2) == 1.0
    assert majority_at_k(answers, scores, 5) == 0.0  # "8" wins once samples 4 and 5 vote


def test_majority_at_k_compares_normalised_answers_and_breaks_ties_by_first_seen():
    assert majority_at_k(["$1,234$", "1234.", "5", "5"], [1.0, 1.0, 0.0, 0.0], 4) == 1.0  # tie 2-2: first seen
    assert majority_at_k(["5", "$1,234$", "1234."], [0.0, 1.0, 1.0], 3) == 1.0  # 2 votes beat 1
    assert majority_at_k(["5", "6"], [0.0, 1.0], 2) == 0.0  # 1-1: the first seen


def test_majority_at_k_none_never_wins():
    assert majority_at_k([None, None, "3"], [0.0, 0.0, 1.0], 3) == 1.0
    assert majority_at_k([None, None, "3"], [0.0, 0.0, 1.0], 2) == 0.0  # all of the first 2 are None
    with pytest.raises(ValueError, match="k"):
        majority_at_k(["1", "2"], [1.0, 0.0], 3)

# --- extraction and normalisation -------------------------------------------------------------------------------


def test_extract_boxed_takes_the_last_box_with_nested_braces():
    assert extract_boxed(r"first \boxed{1}, then \boxed{\frac{1}{2}} done") == r"\frac{1}{2}"
    assert extract_boxed(r"so $\fbox{x^{2}}$") == "x^{2}"
    assert extract_boxed(r"\boxed{\{1, 2\}}") == r"\{1, 2\}"  # escaped braces are not counted
    assert extract_boxed("The answer is 7") is None
    assert extract_boxed(r"\boxed{1} and at last \boxed{\frac{1}{2}") is None  # the last one is cut off


def test_normalise_answer():
    assert normalise_answer("  $1,234$. ") == "1234"
    assert normalise_answer(r"\text{Yes}") == "yes"
    assert normalise_answer("  New   York ") == "new york"
    assert normalise_answer("1,234,567.5") == "1234567.5"
    assert normalise_answer("(1,2)") == "(1,2)"  # not a thousands separator
    assert normalise_answer("5.0") == "5.0"


def test_extract_answer_needs_an_anchor():
    assert extract_answer("The answer is 7 apples", None) is None  # no lenient "any number" fallback
    assert extract_answer(r"so \boxed{7}", None) == "7"
    pattern = r"answer is (-?\d+)"
    assert extract_answer("the answer is 3, no, the answer is 4.", pattern) == "4"  # the last match
    assert extract_answer("#### 42", r"#### -?\d+") == "#### 42"  # no group: the whole match
    assert extract_answer("no anchor 5", pattern) is None
    with pytest.raises(ValueError, match="regular expression"):
        extract_answer("x", "(")

# --- exact and regex scorers ------------------------------------------------------------------------------------


def test_score_exact_compares_the_whole_reply_without_a_pattern():
    assert score_exact("  Paris. ", "paris", None) == ("Paris.", 1.0)
    assert score_exact(r"\boxed{Paris}", "Paris", None) == (r"\boxed{Paris}", 0.0)  # not a boxed answer
    assert score_exact("   ", "x", None) == (None, 0.0)
    assert score_exact("Answer: B", "b", r"Answer:\s*([A-D])") == ("B", 1.0)


def test_score_regex_needs_a_pattern():
    assert score_regex("so #### 1,234", "1234", r"####\s*(\S+)") == ("1,234", 1.0)
    assert score_regex("so #### 12", "1234", r"####\s*(\S+)") == ("12", 0.0)
    assert score_regex("nothing here", "1", r"####\s*(\S+)") == (None, 0.0)
    with pytest.raises(ValueError, match="pattern"):
        score_regex("#### 1", "1", None)

# --- math-verify ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def verifier():
    with MathVerifier() as v:
        yield v


def test_math_verifier_scores_equal_values(verifier):
    texts = [r"so \boxed{\frac{1}{2}}", r"\boxed{\dfrac{3}{4}}", r"\boxed{2}", "The answer is 7", r"\boxed{2\sqrt{3}}"]
    golds = ["0.5", "3/4", "3", "7", r"\sqrt{12}"]
    assert verifier.score(texts, golds, timeout_s=30) == [
        (r"\frac{1}{2}", 1.0), (r"\dfrac{3}{4}", 1.0), ("2", 0.0), (None, 0.0), (r"2\sqrt{3}", 1.0)]
    assert verifier.timeouts == 0 and verifier.errors == 0


def test_math_verifier_with_a_pattern(verifier):
    assert verifier.score(["Final answer: 1/2", "Final answer: 1/3"], ["0.5", "0.5"], r"Final answer:\s*(\S+)",
                          timeout_s=30) == [("1/2", 1.0), ("1/3", 0.0)]


def test_math_verifier_restarts_a_worker_that_died_between_items(verifier):
    verifier.score([r"\boxed{1}"], ["1"], timeout_s=30)
    pid = verifier.proc.pid
    os.kill(pid, signal.SIGKILL)
    verifier.proc.join()
    assert verifier.score([r"\boxed{1}"], ["1"], timeout_s=30) == [("1", 1.0)]
    assert verifier.proc.pid != pid


def test_math_verifier_kills_a_hanging_worker_and_goes_on():
    # sympy evaluates 9^(9^9) as an exact integer, which takes far longer than minutes (over 40 s measured, with
    # math-verify's own timeouts off as in the worker); the next item must still be scored, by a fresh worker.
    texts = [r"\boxed{9^{9^{9}}}", r"\boxed{\frac{1}{2}}"]
    with MathVerifier() as v:
        started = time.monotonic()
        results = v.score(texts, ["1", "0.5"], timeout_s=2)
        assert time.monotonic() - started < 60
        assert results == [("9^{9^{9}}", 0.0), (r"\frac{1}{2}", 1.0)]
        assert v.timeouts == 1 and v.errors == 0
    assert v.proc is None  # closed: the worker is gone


def test_math_verifier_scores_0_when_the_worker_dies_mid_item(verifier):
    verifier.score([r"\boxed{1}"], ["1"], timeout_s=30)  # a worker up
    killer = threading.Timer(0.5, os.kill, (verifier.proc.pid, signal.SIGKILL))  # killed while on the hang below
    killer.start()
    errors = verifier.errors
    results = verifier.score([r"\boxed{9^{9^{9}}}", r"\boxed{0.25}"], ["1", r"\frac{1}{4}"], timeout_s=30)
    killer.join()
    assert results == [("9^{9^{9}}", 0.0), ("0.25", 1.0)]
    assert verifier.errors == errors + 1 and verifier.timeouts == 0
