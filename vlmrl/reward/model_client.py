"""The handle a reward function gets as its ``reward_model`` parameter, in a reward process.

The reward function runs in a child process of the reward-manager actor
(``vlmrl.reward.sandbox``), which is not a Ray worker. The handle therefore
asks the manager over the child's own pipes: it sends ``["ask", call_id,
method, args]`` as data (``vlmrl.user_process``) and blocks until the manager sends ``("answer", value)`` or
``("error", message)``. The manager batches the asks of all its processes and
sends them to the reward model (``vlmrl.reward.model_service``). The time a
call waits counts against ``worker.reward.timeout`` like the rest of the call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vlmrl.user_process import NotData, encode_data

PARAMETER = "reward_model"
"""The reward function's parameter that receives the handle."""


class RewardModelError(RuntimeError):
    """A request to the reward model failed; the message says which sample and why."""


class RewardModelClient:
    """``generate`` (judge), ``score`` (either kind): each takes a list and returns one result per item, in order."""

    def __init__(self, ask: Callable[[str, Any], Any], kind: str):
        self._ask = ask
        self.kind = kind
        """"judge" or "score": what ``worker.reward.reward_model.kind`` says."""

    def generate(self, conversations: list[list[dict]]) -> list[str]:
        """A judge's raw text for each conversation (chat messages; image parts as ``{"type": "image", "image": PIL}``)."""
        if self.kind != "judge":
            raise RewardModelError("generate() needs worker.reward.reward_model.kind=judge; a score model has score()")
        return self._ask("generate", list(conversations))

    def score(self, items: list[dict] | list[list[dict]]) -> list[float]:
        """One score per item: a reward input (the dict the reward function got), or a conversation.

        For a judge, a reward input is asked the configured question (``prompt_template``) with the
        sample's images, and the verdict parsed (``parse``); for a score model it is rated as the
        prompt's user turn plus the response. A verdict that does not parse, or a score that is not
        finite, follows ``on_invalid``: an error naming the sample, or 0 counted in reward_model/invalid.
        """
        return self._ask("score", list(items))

    def __call__(self, items):
        """``reward_model(items)`` is ``reward_model.score(items)``."""
        return self.score(items)


def make_ask(inbox, outbox, current_call: Callable[[], int]) -> Callable[[str, Any], Any]:
    """An ask function over a reward process's pipes (``inbox``/``outbox`` are its Connections)."""

    def ask(method: str, args: Any) -> Any:
        try:
            message = encode_data(["ask", current_call(), method, args])
        except NotData as e:
            raise RewardModelError(f"reward_model.{method}: its argument is not data (dicts, lists, strings, "
                                   f"numbers, PIL images): {e}") from e
        outbox.send_bytes(message)
        kind, value = inbox.recv()
        if kind == "error":
            raise RewardModelError(value)
        return value

    return ask
