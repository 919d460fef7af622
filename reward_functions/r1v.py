"""Short answers in R1-V's format: ``<think>...</think><answer>...</answer>``.

EasyR1-style sequential reward function (EasyR1's ``r1v.py`` scores the same
way): called once per response with a ``reward_input`` dict and returns
``overall`` plus the logged sub-scores. For short free-form answers (a number,
a word, a short phrase) as in visual question answering.

* ``format`` is 1.0 when the whole response is a ``<think>...</think>`` block
  followed by an ``<answer>...</answer>`` block, else 0.0.
* ``accuracy`` is 1.0 when the answer equals the ground truth as graded by
  mathruler's ``grade_answer`` (normalised case, spacing, LaTeX and units, then
  sympy for numbers: ``2.0`` matches ``2``). The answer is the content of the
  first ``<answer>`` pair, or the whole response when there is none, so a bare
  correct answer still earns accuracy but no format credit.
* ``overall = (1 - format_weight) * accuracy + format_weight * format``.

>>> compute_score({"response": "<think>two cats</think><answer>2</answer>", "response_length": 9, "ground_truth": "2"})
{'overall': 1.0, 'format': 1.0, 'accuracy': 1.0}
>>> compute_score({"response": "2.0", "response_length": 3, "ground_truth": "2"})
{'overall': 0.5, 'format': 0.0, 'accuracy': 1.0}
>>> compute_score({"response": "<think>...</think><answer>Red</answer>", "response_length": 9, "ground_truth": "blue"})
{'overall': 0.5, 'format': 1.0, 'accuracy': 0.0}
"""

from __future__ import annotations

import re
from typing import Any

from mathruler.grader import grade_answer

REWARD_TYPE = "sequential"

_FORMAT = re.compile(r"<think>.*?</think>\s*<answer>.*?</answer>", re.DOTALL)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def format_reward(response: str) -> float:
    return 1.0 if _FORMAT.fullmatch(response.strip()) else 0.0


def accuracy_reward(response: str, ground_truth: str) -> float:
    match = _ANSWER.search(response)
    answer = match.group(1).strip() if match else response.strip()
    try:
        return 1.0 if grade_answer(answer, ground_truth.strip()) else 0.0
    except Exception:  # sympy can fail on text it cannot parse; that answer is simply not equal
        return 0.0


def compute_score(reward_input: dict[str, Any], format_weight: float = 0.5) -> dict[str, float]:
    if not isinstance(reward_input, dict):
        raise ValueError("r1v.compute_score is a sequential reward function: set worker.reward.reward_type=sequential.")
    format_score = format_reward(reward_input["response"])
    accuracy_score = accuracy_reward(reward_input["response"], reward_input["ground_truth"])
    return {
        "overall": (1 - format_weight) * accuracy_score + format_weight * format_score,
        "format": format_score,
        "accuracy": accuracy_score,
    }
