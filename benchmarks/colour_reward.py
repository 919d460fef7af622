"""The benchmark's reward, used by vlmrl and by TRL alike: does the response name the image's colour anywhere?

The benchmark's tiny model is randomly initialised and samples 128 tokens of
noise, so an exact-answer reward (``reward_functions/synthetic_colour.py``)
is 0 for every sample: no advantage, no update, nothing to compare. A
substring match scores about a third of those samples, which gives both
trainers a gradient. EasyR1's sequential signature; keyword arguments the
config passes (the quickstart's ``format_weight``) are ignored.

>>> compute_score({"response": "xx redd yy", "ground_truth": "red"})
{'overall': 1.0}
>>> compute_score({"response": "blue", "ground_truth": "green"})
{'overall': 0.0}
"""

from __future__ import annotations

REWARD_TYPE = "sequential"


def score(response: str, ground_truth: str) -> float:
    return float(ground_truth.strip().lower() in response.lower())


def compute_score(reward_input: dict, **_ignored) -> dict[str, float]:
    return {"overall": score(reward_input["response"], reward_input["ground_truth"])}
