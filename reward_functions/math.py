r"""Math with a boxed final answer: reasoning in ``<think>...</think>``, then ``\boxed{answer}``.

EasyR1-style batch reward function (EasyR1's ``math.py`` scores the same way):
called once per step with every ``reward_input`` and returns one dict per
response, ``overall`` plus the logged sub-scores.

* ``format`` is 1.0 when the response is a ``<think>...</think>`` block followed
  by text that holds a ``\boxed{...}``, else 0.0. Spaces around the tag
  characters are ignored (``< think >`` counts), as some models write them.
* ``accuracy`` is 1.0 when the content of the *last* ``\boxed{}`` equals the
  ground truth as graded by mathruler's ``grade_answer``: the two are normalised
  (LaTeX, units, ``\frac``, ``\dfrac``, spacing) and, failing a textual match,
  compared with sympy, so ``0.5`` matches ``\frac{1}{2}``. An unreduced fraction
  does not match its reduced form, and an integer answer must be an integer.
  Without a ``\boxed{}`` accuracy is 0. A ground truth that is itself boxed is unboxed first.
* ``overall = (1 - format_weight) * accuracy + format_weight * format``.

>>> compute_score([
...     {"response": "<think>2 + 2 = 4</think> So \\boxed{4}.", "response_length": 12, "ground_truth": "4"},
...     {"response": "<think>half</think> \\boxed{0.5}", "response_length": 9, "ground_truth": "\\frac{1}{2}"},
...     {"response": "The answer is 4.", "response_length": 5, "ground_truth": "4"},
...     {"response": "<think>hmm</think> \\boxed{5}", "response_length": 8, "ground_truth": "4"},
... ])
[{'overall': 1.0, 'format': 1.0, 'accuracy': 1.0}, {'overall': 1.0, 'format': 1.0, 'accuracy': 1.0}, {'overall': 0.0, 'format': 0.0, 'accuracy': 0.0}, {'overall': 0.1, 'format': 1.0, 'accuracy': 0.0}]
"""

from __future__ import annotations

import re
from typing import Any

from mathruler.grader import extract_boxed_content, grade_answer

REWARD_TYPE = "batch"

_FORMAT = re.compile(r"<think>.*</think>.*\\boxed\{.*\}.*", re.DOTALL)
_TAG_SPACES = re.compile(r"\s*(<|>|/)\s*")


def format_reward(response: str) -> float:
    return 1.0 if _FORMAT.fullmatch(response) else 0.0


def accuracy_reward(response: str, ground_truth: str) -> float:
    if "\\boxed{" not in response:
        return 0.0
    if "\\boxed{" in ground_truth:
        ground_truth = extract_boxed_content(ground_truth)
    return 1.0 if grade_answer(extract_boxed_content(response), ground_truth) else 0.0


def compute_score(reward_inputs: list[dict[str, Any]], format_weight: float = 0.1) -> list[dict[str, float]]:
    if not isinstance(reward_inputs, list):
        raise ValueError("math.compute_score is a batch reward function: set worker.reward.reward_type=batch.")
    scores = []
    for reward_input in reward_inputs:
        response = _TAG_SPACES.sub(r"\1", reward_input["response"])
        format_score = format_reward(response)
        accuracy_score = accuracy_reward(response, reward_input["ground_truth"])
        scores.append(
            {
                "overall": (1 - format_weight) * accuracy_score + format_weight * format_score,
                "format": format_score,
                "accuracy": accuracy_score,
            }
        )
    return scores
