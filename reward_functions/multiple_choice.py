"""Multiple choice: the response picks one option letter, A to Z.

Sequential reward function: called once per response with a ``reward_input``
dict and returns ``overall`` plus the logged sub-scores.

* The chosen letter is read from the content of the last ``<answer>...</answer>``
  pair, else of the last ``\\boxed{}``, else from the whole response. Within
  that text, an explicit "answer is B" / "Answer: (B)" / "option B" wins;
  otherwise the text must *start* with the letter: ``B``, ``(B)``, ``B.``,
  ``B) 12 cm``. A lone lowercase letter (``b``) counts too. Anything else picks
  nothing, so "It could be A or B" earns no accuracy.
* The ground truth is read the same way (``B``, ``(B)``, ``B. 12 cm``); a ground
  truth with no letter is a data error and raises, naming it.
* ``format`` is 1.0 when the response is ``<think>...</think>`` followed by an
  ``<answer>`` pair that picks a letter, else 0.0 (hedging is not the format).
* ``accuracy`` is 1.0 when the chosen letter is the ground truth's.
* ``overall = (1 - format_weight) * accuracy + format_weight * format``.

>>> compute_score({"response": "<think>12 is C</think><answer>(C)</answer>", "response_length": 12, "ground_truth": "C"})
{'overall': 1.0, 'format': 1.0, 'accuracy': 1.0}
>>> compute_score({"response": "I think the answer is b.", "response_length": 7, "ground_truth": "(B) 12 cm"})
{'overall': 0.9, 'format': 0.0, 'accuracy': 1.0}
>>> compute_score({"response": "<think>?</think><answer>A</answer>", "response_length": 7, "ground_truth": "B"})
{'overall': 0.1, 'format': 1.0, 'accuracy': 0.0}
>>> compute_score({"response": "<think>?</think><answer>A or B</answer>", "response_length": 9, "ground_truth": "B"})
{'overall': 0.0, 'format': 0.0, 'accuracy': 0.0}
"""

from __future__ import annotations

import re
from typing import Any

REWARD_TYPE = "sequential"

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_FORMAT = re.compile(r"<think>.*?</think>\s*<answer>(.*?)</answer>", re.DOTALL)

# "answer is B", "Answer: (c)", "option D": a lowercase letter only in parentheses or at the end.
_PHRASE = re.compile(
    r"\b(?i:answer|option|choice)\s*(?i:is)?\s*:?\s*(?:\(([A-Za-z])\)|([A-Z])\b|([a-z])(?=[.,;!)]?\s*$))"
)
# The text starts with the option: "(b) ...", "B", "B. ...", "B) ...", "B: ...", or is one lowercase letter.
_OPTION = re.compile(r"\(([A-Za-z])\)|([A-Z])(?=[.:)]|$)|([a-z])[.)]?$")


def choice(text: str) -> str | None:
    """The option letter ``text`` picks, upper-cased, or None.

    >>> [choice(t) for t in ["B", "(c)", "D. 12 cm", "The answer is (A).", "Answer: e", "answer is a cat"]]
    ['B', 'C', 'D', 'A', 'E', None]
    >>> [choice(t) for t in ["A or B", "I like it", "b", ""]]
    [None, None, 'B', None]
    """
    text = text.strip()
    phrases = _PHRASE.findall(text)
    if phrases:
        return "".join(phrases[-1]).upper()
    option = _OPTION.match(text)
    return "".join(option.groups(default="")).upper() if option else None


def extract_choice(response: str) -> str | None:
    tagged = _ANSWER.findall(response)
    if tagged:
        return choice(tagged[-1])
    boxed = _BOXED.findall(response)
    return choice(boxed[-1] if boxed else response)


def compute_score(reward_input: dict[str, Any], format_weight: float = 0.1) -> dict[str, float]:
    if not isinstance(reward_input, dict):
        raise ValueError(
            "multiple_choice.compute_score is a sequential reward function: set worker.reward.reward_type=sequential."
        )
    truth = choice(reward_input["ground_truth"])
    if truth is None:
        raise ValueError(f"ground truth {reward_input['ground_truth']!r} names no option letter (A-Z)")
    response = reward_input["response"]
    formatted = _FORMAT.fullmatch(response.strip())
    format_score = 1.0 if formatted and choice(formatted.group(1)) is not None else 0.0
    accuracy_score = 1.0 if extract_choice(response) == truth else 0.0
    return {
        "overall": (1 - format_weight) * accuracy_score + format_weight * format_score,
        "format": format_score,
        "accuracy": accuracy_score,
    }
