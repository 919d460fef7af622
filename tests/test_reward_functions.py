"""The shipped reward functions in reward_functions/: their docstring examples, their scoring
rules case by case, and each one loaded by path and run by the manager its REWARD_TYPE names.

Modules are loaded by file path, as ``worker.reward.reward_function`` loads them:
``reward_functions/`` is never put on ``sys.path``, where ``math.py`` would shadow
the standard library's ``math``.
"""

from __future__ import annotations

import doctest
import importlib.util
from pathlib import Path

import pytest

from vlmrl.reward.function import load_reward_function
from vlmrl.reward.manager import REWARD_MANAGERS, RewardResult

FOLDER = Path(__file__).resolve().parents[1] / "reward_functions"
SHIPPED = ["dapo", "math", "multiple_choice", "r1v", "synthetic_colour"]


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"shipped_reward_{name}", FOLDER / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def one(module, response: str, truth: str, length: int | None = None, **kwargs) -> dict[str, float]:
    x = {"response": response, "response_length": len(response) if length is None else length, "ground_truth": truth}
    if module.REWARD_TYPE == "batch":
        (score,) = module.compute_score([x], **kwargs)
        return score
    return module.compute_score(x, **kwargs)


def test_the_folder_holds_the_shipped_functions():
    assert sorted(p.stem for p in FOLDER.glob("*.py")) == SHIPPED


@pytest.mark.parametrize("name", SHIPPED)
def test_docstring_examples_run(name):
    result = doctest.testmod(load(name))
    assert result.attempted >= 1 and result.failed == 0


RUN_KWARGS = {"dapo": {"max_response_length": 64, "overlong_buffer_length": 16}}


@pytest.mark.parametrize("name", SHIPPED)
def test_each_loads_by_path_and_runs_in_the_manager_its_reward_type_names(name):
    fn, declared = load_reward_function(f"{FOLDER / name}.py:compute_score")
    assert declared is not None and fn.__name__ == "compute_score"
    manager = REWARD_MANAGERS[declared](f"{FOLDER / name}.py:compute_score", RUN_KWARGS.get(name, {}))
    try:
        inputs = [
            {"response": "<think>x</think><answer>A</answer>", "response_length": 9, "ground_truth": "A",
             "prompt": "p", "data_source": "d", "images": [], "sample_id": 0, "some_column": 3},
        ]  # fmt: skip
        result = manager.compute(inputs)
    finally:
        manager.close()
    assert isinstance(result, RewardResult) and len(result.overall) == 1
    assert "overall" not in result.sub_scores and result.sub_scores  # sub-scores to log


@pytest.mark.parametrize("name", SHIPPED)
def test_each_refuses_the_other_manager_shape(name):
    module = load(name)
    x = {"response": "a", "response_length": 1, "ground_truth": "a"}
    wrong = x if module.REWARD_TYPE == "batch" else [x]
    with pytest.raises(
        ValueError, match=f"{'batch' if module.REWARD_TYPE == 'batch' else 'sequential'} reward function"
    ):
        module.compute_score(wrong, **RUN_KWARGS.get(name, {}))


# --------------------------------------------------------------------------- math


@pytest.mark.parametrize(
    ("response", "truth", "format_", "accuracy"),
    [
        ("<think>2+2</think> \\boxed{4}", "4", 1.0, 1.0),
        ("<think>a</think>\nSo the answer is $\\boxed{\\frac{1}{2}}$.", "0.5", 1.0, 1.0),  # sympy: 1/2 == 0.5
        ("< think >a< /think > \\boxed{4}", "4", 1.0, 1.0),  # spaces around tag characters are forgiven
        ("\\boxed{4}", "4", 0.0, 1.0),  # no reasoning block: accuracy without format
        ("<think>4</think> The answer is 4.", "4", 0.0, 0.0),  # no box: nothing to grade
        ("<think>a</think> \\boxed{3} no wait \\boxed{4}", "4", 1.0, 1.0),  # the last box counts
        ("<think>a</think> \\boxed{4} no wait \\boxed{3}", "4", 1.0, 0.0),
        ("<think>a</think> \\boxed{\\frac{2}{4}}", "\\frac{1}{2}", 1.0, 0.0),  # unreduced fractions do not match
        ("<think>a</think> \\boxed{(x+1)^2}", "x^2+2x+1", 1.0, 1.0),  # equal under sympy
        ("<think>a</think> \\boxed{7}", "\\boxed{7}", 1.0, 1.0),  # a boxed ground truth is unboxed
        ("<think>a</think> \\boxed{}", "4", 1.0, 0.0),
    ],
)
def test_math(response, truth, format_, accuracy):
    score = one(load("math"), response, truth)
    assert (score["format"], score["accuracy"]) == (format_, accuracy)
    assert score["overall"] == pytest.approx(0.9 * accuracy + 0.1 * format_)


def test_math_format_weight():
    # weight 0.5: 0.5 * 0 (wrong) + 0.5 * 1 (format) = 0.5
    assert one(load("math"), "<think>a</think> \\boxed{5}", "4", format_weight=0.5)["overall"] == 0.5


# --------------------------------------------------------------------------- r1v


@pytest.mark.parametrize(
    ("response", "truth", "format_", "accuracy"),
    [
        ("<think>count</think><answer>3</answer>", "3", 1.0, 1.0),
        ("<think>count</think>\n<answer> 3.0 </answer>", "3", 1.0, 1.0),  # whitespace and 3.0 == 3
        ("<think>c</think><answer>Red</answer>", "red", 1.0, 1.0),  # case is normalised
        ("3", "3", 0.0, 1.0),  # a bare answer: accuracy, no format
        ("<answer>3</answer>", "3", 0.0, 1.0),  # no reasoning block
        ("<think>c</think><answer>3</answer> trailing text", "3", 0.0, 1.0),  # the whole response must be the format
        ("<think>c</think><answer>4</answer>", "3", 1.0, 0.0),
        ("<think>c</think><answer>2 cats</answer>", "2", 1.0, 0.0),  # no partial credit
        ("<think>c</think><answer>\\frac{</answer>", "3", 1.0, 0.0),  # unparsable: 0, not an exception
    ],
)
def test_r1v(response, truth, format_, accuracy):
    score = one(load("r1v"), response, truth)
    assert (score["format"], score["accuracy"]) == (format_, accuracy)
    assert score["overall"] == pytest.approx(0.5 * accuracy + 0.5 * format_)  # EasyR1's default weight 0.5


# --------------------------------------------------------------------------- multiple choice


@pytest.mark.parametrize(
    ("response", "truth", "format_", "accuracy"),
    [
        ("<think>a</think><answer>B</answer>", "B", 1.0, 1.0),
        ("<think>a</think><answer>(B) 12 cm</answer>", "(B)", 1.0, 1.0),
        ("<think>a</think><answer>The answer is b.</answer>", "B. 12 cm", 1.0, 1.0),
        (
            "<think>a</think><answer>A</answer> no, <answer>C</answer>",
            "C",
            0.0,
            1.0,
        ),  # last pair counts; not the format
        ("So the answer is \\boxed{D}", "D", 0.0, 1.0),
        ("Answer: (E)", "E", 0.0, 1.0),
        ("C", "C", 0.0, 1.0),
        ("<think>a</think><answer>A or C</answer>", "C", 0.0, 0.0),  # hedging picks nothing
        ("<think>a</think><answer>ABCD</answer>", "A", 0.0, 0.0),  # listing every option picks nothing
        ("It is C because ...", "C", 0.0, 0.0),  # no explicit pick
        ("<think>a</think><answer>D</answer>", "C", 1.0, 0.0),
    ],
)
def test_multiple_choice(response, truth, format_, accuracy):
    score = one(load("multiple_choice"), response, truth)
    assert (score["format"], score["accuracy"]) == (format_, accuracy)


def test_multiple_choice_ground_truth_without_a_letter_is_an_error():
    with pytest.raises(ValueError, match="ground truth '12 cm' names no option letter"):
        one(load("multiple_choice"), "A", "12 cm")


# --------------------------------------------------------------------------- dapo


@pytest.mark.parametrize(
    ("length", "overlong"),
    [
        # L = 100, C = 20: free up to 80, then linear to -1 at 100, then -1.
        (10, 0.0),
        (80, 0.0),
        (81, -1 / 20),
        (90, -0.5),
        (100, -1.0),
        (101, -1.0),
    ],
)
def test_dapo_soft_overlong_punishment(length, overlong):
    module = load("dapo")
    assert module.soft_overlong_punishment(length, 100, 20) == pytest.approx(overlong)
    score = one(module, "Answer: 7", "7", length=length, max_response_length=100, overlong_buffer_length=20,
                overlong_penalty_factor=0.5)  # fmt: skip
    assert score["overlong"] == pytest.approx(overlong)
    assert score["overall"] == pytest.approx(1.0 + 0.5 * overlong)


@pytest.mark.parametrize(
    ("response", "correct"),
    [
        ("Reasoning...\nAnswer: 42", True),
        ("Answer: 41\nAnswer: 42.", True),  # the last Answer line, trailing period dropped
        ("so \\boxed{42} and Answer: 41", True),  # a box wins over an Answer line
        ("answer : 4.2e1", True),
        ("The result is 42", False),  # no answer marked: wrong
        ("Answer: 43", False),
    ],
)
def test_dapo_accuracy_is_plus_or_minus_one(response, correct):
    score = one(load("dapo"), response, "42", length=5, max_response_length=100, overlong_buffer_length=20)
    assert score["accuracy"] == float(correct)
    assert score["overall"] == (1.0 if correct else -1.0)


def test_dapo_rejects_a_buffer_longer_than_the_response_limit():
    with pytest.raises(ValueError, match=r"overlong_buffer_length=200 must be in \(0, max_response_length=100\]"):
        one(load("dapo"), "Answer: 1", "1", max_response_length=100, overlong_buffer_length=200)
