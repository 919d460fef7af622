r"""DAPO's reward: +1 / -1 for the final answer, plus a soft penalty for overlong responses.

Batch reward function (as EasyR1's ``dapo.py``): called once per step with
every ``reward_input`` and returns one dict per response.

* The answer is the content of the last ``\boxed{}``, else the text after the
  last ``Answer:`` (DAPO's prompt asks for "Answer: $Answer" on the last line).
  It is graded against the ground truth with mathruler's ``grade_answer``
  (normalised LaTeX and numbers, then sympy). ``accuracy`` is 1.0 or 0.0; the
  reward uses DAPO's +1 for a correct answer and -1 otherwise.
* ``overlong`` is DAPO's soft overlong punishment on ``response_length`` (in
  tokens), with ``L = max_response_length`` and ``C = overlong_buffer_length``::

      0                      if length <= L - C
      ((L - C) - length) / C if L - C < length <= L   (from 0 down to -1)
      -1                     if length > L

  Set ``max_response_length`` to ``data.max_response_length``; responses cut at
  that length get the full -1 of the buffer's end.
* ``overall = (+1 if correct else -1) + overlong_penalty_factor * overlong``.

>>> compute_score(
...     [
...         {"response": "... Answer: 12", "response_length": 100, "ground_truth": "12"},
...         {"response": "... so \\boxed{\\frac{1}{2}}", "response_length": 448, "ground_truth": "0.5"},
...         {"response": "... Answer: 13", "response_length": 512, "ground_truth": "12"},
...     ],
...     max_response_length=512,
...     overlong_buffer_length=128,
... )
[{'overall': 1.0, 'accuracy': 1.0, 'overlong': 0.0}, {'overall': 0.5, 'accuracy': 1.0, 'overlong': -0.5}, {'overall': -2.0, 'accuracy': 0.0, 'overlong': -1.0}]
"""

from __future__ import annotations

import re
from typing import Any

from mathruler.grader import extract_boxed_content, grade_answer

REWARD_TYPE = "batch"

_ANSWER_LINE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")


def extract_answer(response: str) -> str | None:
    if "\\boxed{" in response:
        return extract_boxed_content(response)
    lines = _ANSWER_LINE.findall(response)
    return lines[-1].strip().rstrip(".") if lines else None


def soft_overlong_punishment(response_length: int, max_response_length: int, overlong_buffer_length: int) -> float:
    expected = max_response_length - overlong_buffer_length
    if response_length <= expected:
        return 0.0
    if response_length <= max_response_length:
        return (expected - response_length) / overlong_buffer_length
    return -1.0


def compute_score(
    reward_inputs: list[dict[str, Any]],
    max_response_length: int,
    overlong_buffer_length: int,
    overlong_penalty_factor: float = 1.0,
) -> list[dict[str, float]]:
    if not isinstance(reward_inputs, list):
        raise ValueError("dapo.compute_score is a batch reward function: set worker.reward.reward_type=batch.")
    if not 0 < overlong_buffer_length <= max_response_length:
        raise ValueError(
            f"overlong_buffer_length={overlong_buffer_length} must be in (0, max_response_length={max_response_length}]"
        )
    scores = []
    for reward_input in reward_inputs:
        answer = extract_answer(reward_input["response"])
        correct = answer is not None and grade_answer(answer, reward_input["ground_truth"])
        overlong = soft_overlong_punishment(
            reward_input["response_length"], max_response_length, overlong_buffer_length
        )
        scores.append(
            {
                "overall": (1.0 if correct else -1.0) + overlong_penalty_factor * overlong,
                "accuracy": 1.0 if correct else 0.0,
                "overlong": overlong,
            }
        )
    return scores
