"""reward_functions/synthetic_colour.py, loaded by file path as EasyR1 loads reward functions."""

from __future__ import annotations

import doctest
import importlib.util
from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parents[1] / "reward_functions" / "synthetic_colour.py"


@pytest.fixture(scope="module")
def reward():
    spec = importlib.util.spec_from_file_location("synthetic_colour", PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _score(reward, response, truth="red", **kwargs):
    return reward.compute_score({"response": response, "response_length": len(response), "ground_truth": truth}, **kwargs)


def test_docstring_examples_run(reward):
    result = doctest.testmod(reward)
    assert result.attempted >= 3 and result.failed == 0


def test_is_sequential(reward):
    assert reward.REWARD_TYPE == "sequential"
    with pytest.raises(ValueError, match="sequential"):
        reward.compute_score([{"response": "red", "response_length": 1, "ground_truth": "red"}])


@pytest.mark.parametrize(
    ("response", "accuracy", "format_"),
    [
        ("<answer>red</answer>", 1.0, 1.0),
        ("I think... <answer> RED. </answer>", 1.0, 1.0),
        ("<answer>blue</answer> no wait <answer>red</answer>", 1.0, 1.0),  # last pair counts
        ("<answer>red</answer> no wait <answer>blue</answer>", 0.0, 1.0),
        ("<answer>red or blue</answer>", 0.0, 1.0),
        ("<answer></answer>", 0.0, 1.0),
        ("red", 1.0, 0.0),  # bare answer accepted, no format credit
        ("  Red!\n", 1.0, 0.0),
        ("It is red", 0.0, 0.0),  # no substring matching
        ("red green blue yellow", 0.0, 0.0),
        ("<answer>red", 0.0, 0.0),  # unclosed tag: neither format nor a bare answer
        ("", 0.0, 0.0),
    ],
)
def test_accuracy_and_format(reward, response, accuracy, format_):
    score = _score(reward, response)
    assert (score["accuracy"], score["format"]) == (accuracy, format_)
    # overall = 0.9 * accuracy + 0.1 * format with the default weight.
    assert score["overall"] == pytest.approx(0.9 * accuracy + 0.1 * format_)


def test_format_weight(reward):
    # weight 0.5: 0.5 * 0 (wrong colour) + 0.5 * 1 (tags present) = 0.5
    assert _score(reward, "<answer>blue</answer>", format_weight=0.5)["overall"] == pytest.approx(0.5)
    assert _score(reward, "<answer>red</answer>", format_weight=0.0)["overall"] == 1.0


def test_ground_truth_is_normalised_too(reward):
    assert _score(reward, "<answer>green</answer>", truth=" Green ")["accuracy"] == 1.0
