"""Reward for the synthetic colour task (``vlmrl.testing.synthetic``).

EasyR1-style sequential reward function: called once per response with a
``reward_input`` dict and returns ``overall`` plus the sub-scores that are
logged.

Scoring rules (decided here, kept deliberately strict so that the reward
cannot be gamed by listing every colour):

* ``format`` is 1.0 when the response holds a complete ``<answer>...</answer>``
  pair, else 0.0.
* ``accuracy`` is 1.0 when the extracted answer equals the ground truth,
  compared case-insensitively with surrounding whitespace and trailing
  ``.!`` removed. The extracted answer is the content of the *last* answer
  pair; without tags, the whole response is taken as a bare answer, so
  ``"Red."`` is correct but ``"It is red"`` is not.
* ``overall = (1 - format_weight) * accuracy + format_weight * format``, as in
  EasyR1's reward functions.

>>> compute_score({"response": "<answer> Red </answer>", "response_length": 5, "ground_truth": "red"})
{'overall': 1.0, 'accuracy': 1.0, 'format': 1.0}
>>> compute_score({"response": "blue.", "response_length": 2, "ground_truth": "blue"})
{'overall': 0.9, 'accuracy': 1.0, 'format': 0.0}
>>> compute_score({"response": "<answer>red</answer>", "response_length": 4, "ground_truth": "green"})
{'overall': 0.1, 'accuracy': 0.0, 'format': 1.0}
"""

from __future__ import annotations

import re

REWARD_TYPE = "sequential"

_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)


def _normalise(text: str) -> str:
    return text.strip().rstrip(".!").strip().lower()


def extract_answer(response: str) -> tuple[str, bool]:
    """Return (answer text, whether it came from an answer tag pair)."""
    tagged = _ANSWER_RE.findall(response)
    if tagged:
        return tagged[-1], True
    return response, False


def compute_score(reward_input: dict, format_weight: float = 0.1) -> dict[str, float]:
    if not isinstance(reward_input, dict):
        raise ValueError("synthetic_colour.compute_score is a sequential reward function: pass one dict per response.")
    answer, tagged = extract_answer(reward_input["response"])
    accuracy = float(_normalise(answer) == _normalise(reward_input["ground_truth"]))
    format_score = float(tagged)
    return {
        "overall": (1.0 - format_weight) * accuracy + format_weight * format_score,
        "accuracy": accuracy,
        "format": format_score,
    }
