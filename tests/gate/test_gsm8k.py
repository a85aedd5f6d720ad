"""GSM8K answer extraction, the shipped data's format and the prompt."""

import pytest
from gate_data import GSM8K_FEWSHOT, GSM8K_TEST

from chatfleet.gate.gsm8k import build_messages, extract_answer, load_problems, normalize_number


@pytest.mark.parametrize("reply, answer", [
    ("She sells 9 eggs, 9 * 2 = 18.\n#### 18", "18"),
    ("#### 1,234.50 dollars", "1234.5"),
    ("#### $70,000", "70000"),
    ("The total is 3 + 4 = 7 apples.", "7"),           # no '####': the last number
    ("#### -5", "-5"),
    ("Earlier 12, then #### 3. Later 99.", "3"),        # strict first
    ("no number at all", None),
    ("It costs 2.50.", "2.5"),
])
def test_extraction_strict_then_last_number(reply, answer):
    assert extract_answer(reply) == answer


def test_normalization():
    assert normalize_number("18.00") == "18" and normalize_number("1e2") == "100" and normalize_number("x") is None


def test_the_shared_files_load_and_the_prompt_has_shots():
    problems = load_problems(GSM8K_TEST, limit=20)
    shots = load_problems(GSM8K_FEWSHOT, limit=3)
    assert len(problems) == 20 and problems[0].gold == "18"
    msgs = build_messages(problems[0], shots)
    assert [m["role"] for m in msgs] == ["system"] + ["user", "assistant"] * 3 + ["user"]
    assert "<<" not in msgs[2]["content"] and "####" in msgs[2]["content"]
    assert msgs[-1]["content"] == problems[0].question
