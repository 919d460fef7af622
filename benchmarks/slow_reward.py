"""The async benchmark's reward: the quickstart's accuracy, after a wait of 0.2-2 s per prompt group.

The wait stands for I/O a reward does (a sandbox, a judge model behind a queue). It is drawn per prompt
from a hash of the prompt, so every run waits the same for the same group, and is split over the group's
n calls (``n`` is passed by the benchmark). ``wait=false`` is the negative control's instant reward.

>>> compute_score({"response": "red", "ground_truth": "red", "prompt": "p"}, n=4, wait=False)
{'overall': 1.0}
"""

from __future__ import annotations

import hashlib
import time

REWARD_TYPE = "sequential"
LOW, HIGH = 0.2, 2.0


def group_wait(prompt: str) -> float:
    """Seconds the group of ``prompt`` waits, uniform in [LOW, HIGH] by its hash."""
    u = int(hashlib.sha1(prompt.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
    return LOW + (HIGH - LOW) * u


def compute_score(reward_input: dict, n: int = 1, wait: bool = True, **_ignored) -> dict[str, float]:
    if wait:
        time.sleep(group_wait(reward_input["prompt"]) / n)
    right = reward_input["response"].strip().lower() == reward_input["ground_truth"].strip().lower()
    return {"overall": float(right)}
