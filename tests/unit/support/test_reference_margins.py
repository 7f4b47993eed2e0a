"""The near-tie comparison of answers with the plain instance's (tests/support/reference_margins.py)."""

from __future__ import annotations

from tests.support.reference_margins import divergence, top2_margins, with_top2


def test_an_answer_may_differ_only_from_a_near_tie_of_the_reference_on() -> None:
    ref = [5, 6, 7, 8]
    assert divergence([5, 6, 7, 8], ref, [3.0] * 4) is None
    assert divergence([5, 6, 9, 4], ref, [3.0, 3.0, 0.2, 3.0]) is None  # the plain instance nearly chose 9
    assert "step 1" in (divergence([5, 9, 7, 8], ref, [3.0, 3.0, 0.2, 3.0]) or "")  # sure of 6: a wrong answer
    assert divergence([5, 6, 7, 9], ref, None) is not None  # no margins known: exact
    assert divergence(None, ref, [0.1] * 4) is None and divergence([], ref, [3.0] * 4) is not None


def test_margins_are_read_from_completion_and_chat_answers() -> None:
    assert with_top2({"prompt": "x"})["logprobs"] == 2
    assert with_top2({"messages": []})["top_logprobs"] == 2
    completion = {"choices": [{"logprobs": {"top_logprobs": [{"a": -0.1, "b": -2.6}, {"c": -1.0, "d": -1.25}]}}]}
    assert top2_margins(completion) == [2.5, 0.25]
    chat = {
        "choices": [
            {
                "logprobs": {
                    "content": [{"top_logprobs": [{"token": "a", "logprob": -3.0}, {"token": "b", "logprob": -0.5}]}]
                }
            }
        ]
    }
    assert top2_margins(chat) == [2.5]
