r"""Geometry with a judge: the rule grades the boxed answer, a judge VLM grades the reasoning.

A batch reward function that takes ``reward_model`` (``worker.reward.reward_model``):
vlmrl hands it a handle to the judge, and the whole step's responses go to the
judge in one request. The judge is asked the question in
``examples/format_prompt/judge_reasoning.jinja`` with the problem's image, and
answers yes or no.

* ``accuracy``: mathruler's grade of the last ``\boxed{}`` against the ground truth (as ``math.py``).
* ``judge``: 1 when the judge says the reasoning is sound, else 0.
* ``overall = (1 - judge_weight) * accuracy + judge_weight * accuracy * judge``: the judge can only take
  credit away from a right answer reached by wrong reasoning; it never rewards a wrong answer, which keeps a
  policy from learning to please the judge instead of solving the problem.
"""

from __future__ import annotations

from typing import Any

from mathruler.grader import extract_boxed_content, grade_answer

REWARD_TYPE = "batch"


def accuracy(response: str, ground_truth: str) -> float:
    if "\\boxed{" not in response:
        return 0.0
    return 1.0 if grade_answer(extract_boxed_content(response), ground_truth) else 0.0


def compute_score(reward_inputs: list[dict[str, Any]], reward_model, judge_weight: float = 0.5) -> list[dict]:
    verdicts = reward_model.score(reward_inputs)  # one request for the step, in order
    scores = []
    for reward_input, judge in zip(reward_inputs, verdicts):
        acc = accuracy(reward_input["response"], reward_input["ground_truth"])
        scores.append(
            {"overall": (1 - judge_weight) * acc + judge_weight * acc * judge, "accuracy": acc, "judge": judge}
        )
    return scores
