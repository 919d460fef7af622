"""The async benchmark's reward: the quickstart's accuracy, after waiting 0.2-2 s per prompt group.

The wait stands for I/O (a sandbox, a judge model behind a queue). Such a reward sends its requests
together and waits for the slowest, as a client of a judge service does: a call waits for the longest
wait among the groups it scores, not their sum. Each group's wait is drawn from a hash of its prompt,
so every run waits the same for the same group. ``wait=false`` is the negative control's instant reward.

>>> compute_score([{"response": "red", "ground_truth": "red", "prompt": "p"}], wait=False)
[{'overall': 1.0}]
"""

from __future__ import annotations

import hashlib
import time

REWARD_TYPE = "batch"
LOW, HIGH = 0.2, 2.0


def group_wait(prompt: str) -> float:
    """Seconds the group of ``prompt`` waits, uniform in [LOW, HIGH] by its hash."""
    u = int(hashlib.sha1(prompt.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
    return LOW + (HIGH - LOW) * u


def compute_score(reward_inputs: list[dict], wait: bool = True, **_ignored) -> list[dict[str, float]]:
    if wait and reward_inputs:
        # The groups' requests are in flight together: the call returns when the slowest is answered.
        time.sleep(max(group_wait(x["prompt"]) for x in reward_inputs))
    return [
        {"overall": float(x["response"].strip().lower() == x["ground_truth"].strip().lower())} for x in reward_inputs
    ]
