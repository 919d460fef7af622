"""Environments a multi-turn rollout acts in: games and simulators, named by path.

``worker.rollout.multi_turn.env=my_env.py:GridEnv`` names a class. Each
trajectory gets its own instance, made with no arguments:

- ``reset(sample) -> observation``: ``sample`` holds the row's fields (its
  ``ground_truth``, ``data_source``, ``prompt``, other columns) and ``images``;
  the observation, if not empty, is shown before the model's first turn;
- ``step(action) -> (observation, reward, done, info)``: ``action`` is the text
  of the model's turn; the reward is that turn's reward.

An observation is the new messages only: a string (one user message), a
message dict, or a list of them, whose content may hold images as
``{"type": "image", "image": <PIL image>}``. ``reset`` and ``step`` may be
``async def``.
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Any


def as_messages(observation: Any) -> list[dict]:
    """An observation as a list of chat messages; TypeError if it is none of the accepted forms."""
    if observation is None or observation == "":
        return []
    if isinstance(observation, str):
        return [{"role": "user", "content": observation}]
    if isinstance(observation, dict):
        observation = [observation]
    if isinstance(observation, (list, tuple)) and all(isinstance(m, dict) and "role" in m for m in observation):
        for m in observation:
            for item in m.get("content") if isinstance(m.get("content"), list) else []:
                if isinstance(item, dict) and item.get("type") == "image" and item.get("image") is None:
                    raise TypeError('an image item of an observation must carry the image: {"type": "image", "image": img}')
        return list(observation)
    raise TypeError(
        f"an observation is {type(observation).__name__}; give a string, a message dict or a list of message dicts"
    )


def as_step(value: Any) -> tuple[list[dict], float, bool]:
    """``step``'s return value as (messages, reward, done); TypeError if it is not (obs, reward, done, info)."""
    if not isinstance(value, tuple) or len(value) != 4:
        raise TypeError("step(action) must return (observation, reward, done, info)")
    observation, reward, done, _ = value
    return as_messages(observation), float(reward or 0.0), bool(done)


async def call(method, *args, pool=None, timeout: float | None = None) -> Any:
    """Call an environment method, ``async def`` or not, within ``timeout`` seconds."""
    if inspect.iscoroutinefunction(method):
        return await asyncio.wait_for(method(*args), timeout)
    return await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(pool, lambda: method(*args)), timeout)
