"""The judge quickstart's reward: a judge VLM's verdict, next to the exact-match rule it replaces.

A batch function taking ``reward_model``: the step's responses go to the judge
in one request (the built-in yes/no question with each sample's image). The
rule is computed too, but only logged: ``agreement`` is how often the judge
says what exact match would, which tells whether the judge can be trusted.
"""

from __future__ import annotations

REWARD_TYPE = "batch"


def compute_score(reward_inputs: list[dict], reward_model) -> list[dict]:
    verdicts = reward_model.score(reward_inputs)
    scores = []
    for reward_input, judge in zip(reward_inputs, verdicts):
        exact = float(reward_input["response"].strip().strip(".!").lower() == reward_input["ground_truth"].lower())
        scores.append({"overall": judge, "exact_match": exact, "agreement": float(judge == exact)})
    return scores
