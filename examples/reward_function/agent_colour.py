"""Reward for the agent quickstart (examples/agent_quickstart.yaml): the colour, asked for through a tool.

A sequential reward function (one dict per trajectory). The final answer is
scored as the single-turn colour task scores it
(``reward_functions/synthetic_colour.py``). A trajectory that made a tool call
the loop could not run (a call that cannot be read, an unknown tool, bad
arguments) scores 0 whatever it answered, and so, with ``require_reveal`` (the
default), does one that answered without looking: the task asks for the
colour of a picture only the tool shows, so a guess earns nothing.

Why the second rule: until the policy reads the tool's picture, an answer
after a broken call is right as often as one after a good call (1 in 4), so
nothing in the accuracy alone keeps the call's 16 tokens intact, and GRPO's
noisy early updates wore them down (``{"name": "reveal"}`` became ``{"}``) before
the picture could pay. With the rule a broken call costs what it should.
Without ``require_reveal``, answering at once paid as well as calling until the
picture was read, and the policy drifted to answering at once. The
sub-scores keep the plain ``accuracy`` apart, and ``revealed`` says whether the
trajectory saw the picture.

>>> ok = [{"name": "reveal", "status": "ok"}]
>>> compute_score({"response": "red", "ground_truth": "red", "tool_calls": ok})
{'overall': 1.0, 'accuracy': 1.0, 'revealed': 1.0, 'broken_call': 0.0}
>>> compute_score({"response": "red", "ground_truth": "red", "tool_calls": [{"name": "", "status": "parse_error"}]})
{'overall': 0.0, 'accuracy': 1.0, 'revealed': 0.0, 'broken_call': 1.0}
>>> compute_score({"response": "red", "ground_truth": "red"})
{'overall': 0.0, 'accuracy': 1.0, 'revealed': 0.0, 'broken_call': 0.0}
>>> compute_score({"response": "red", "ground_truth": "red"}, require_reveal=False)
{'overall': 1.0, 'accuracy': 1.0, 'revealed': 0.0, 'broken_call': 0.0}
"""

from __future__ import annotations

REWARD_TYPE = "sequential"

RUN = "ok"
"""The one tool-call status (``vlmrl.api.ToolStatus``) of a call the loop ran."""


def _normalise(text: str) -> str:
    return text.strip().rstrip(".!").strip().lower()


def compute_score(reward_input: dict, require_reveal: bool = True) -> dict[str, float]:
    if not isinstance(reward_input, dict):
        raise ValueError("agent_colour.compute_score is a sequential reward function: pass one dict per trajectory.")
    accuracy = float(_normalise(reward_input["response"]) == _normalise(reward_input["ground_truth"]))
    calls = reward_input.get("tool_calls") or []
    broken = any(c.get("status") != RUN for c in calls)
    revealed = any(c.get("status") == RUN and c.get("name") == "reveal" for c in calls)
    return {
        "overall": 0.0 if broken or (require_reveal and not revealed) else accuracy,
        "accuracy": accuracy,
        "revealed": float(revealed),
        "broken_call": float(broken),
    }
