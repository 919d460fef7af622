"""The engine's logits processor that bans the tokens no response may contain (``vlmrl.rollout.engine.sampling``).

A class at module level, importable by name, because an engine with worker processes of its own (a rollout
server's tensor-parallel engine, vLLM's ``mp`` executor) sends its config, logits processors included, to them
by pickle; a class made per engine would not travel. The ids therefore travel in the engine's config instead,
under ``BANNED_KEY`` of vLLM's ``additional_config``. See ``vllm_sampler`` for why a processor, and what it saves.
"""

from __future__ import annotations

import torch
from vllm.v1.sample.logits_processor import LogitsProcessor

BANNED_KEY = "vlmrl_banned_token_ids"
"""The key of ``additional_config`` that holds the banned ids (a list of ints)."""


class BanTokens(LogitsProcessor):
    """Sets the logits of the banned ids to -inf for every request. It changes the argmax, so vLLM applies it
    before greedy and random sampling alike, and before the processed log-probs, as it applies
    ``allowed_token_ids``."""

    def __init__(self, vllm_config, device, is_pin_memory: bool):
        banned = (vllm_config.additional_config or {}).get(BANNED_KEY, [])
        self.banned = torch.tensor(banned, dtype=torch.long, device=device)

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update) -> None:
        pass  # the same ids for every request

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.banned.numel():
            logits.index_fill_(1, self.banned, float("-inf"))
        return logits
