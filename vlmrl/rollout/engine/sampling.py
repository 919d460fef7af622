"""What a rollout may sample, and how its requests are seeded.

A randomly initialised (or badly drifting) policy can sample vision special
tokens; a response holding one breaks the actor's forward ("Image features and
image tokens do not match"). Those tokens (the model family's
``banned_tokens``) are banned at sampling time, and the actor applies the same
ban when it computes log-probs, so the policy that is trained is exactly the
one that sampled.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from vlmrl.records import PromptSample
from vlmrl.rollout.engine import EngineRequest, Sampling

def sampling_mask(tokenizer: Any, vocab_size: int, banned: tuple[str, ...]) -> torch.Tensor:
    """(vocab_size,) bool: the tokens a response may contain.

    Excluded: ``banned`` (the model family's ``banned_tokens``, its vision
    markers), and the embedding rows past the tokenizer's vocabulary (padding
    rows no text can decode to).
    """
    allowed = torch.zeros(vocab_size, dtype=torch.bool)
    allowed[: min(len(tokenizer), vocab_size)] = True
    vocab = tokenizer.get_vocab()
    for token in banned:
        if token in vocab:
            allowed[vocab[token]] = False
    return allowed


def group_seed(engine_seed: int, group_id: int, n: int) -> int:
    """The first sample's seed of a prompt group; its n samples get this + 0 .. n - 1.

    Seeded by group id, a step's rollouts do not depend on what the engine
    sampled before, nor on how the prompts were split over workers: a resumed
    run samples what an uninterrupted one would.
    """
    return engine_seed * 1_000_000_007 + group_id * n


def seeded_requests(
    prompts: list[PromptSample], group_ids: list[int], sampling: Sampling, engine_seed: int
) -> list[EngineRequest]:
    """One request per prompt, seeded by its group id (``group_seed``); ids are unique within the list."""
    return [
        EngineRequest(
            request_id=f"{i}:{group_id}",
            prompt_token_ids=prompt.raw_prompt_ids,
            multi_modal_data=prompt.multi_modal_data or {},
            sampling=dataclasses.replace(sampling, seed=group_seed(engine_seed, group_id, sampling.n)),
        )
        for i, (prompt, group_id) in enumerate(zip(prompts, group_ids, strict=True))
    ]


def media_offsets(token_ids: list[int], pad_ids: tuple[int, ...]) -> list[int]:
    """Where each run of media pad tokens starts, in order (one run per image; Qwen3-VL splits a video).

    >>> media_offsets([5, 9, 9, 6, 7, 9, 8], (9,))
    [1, 5]
    """
    return [i for i, t in enumerate(token_ids) if t in pad_ids and (i == 0 or token_ids[i - 1] != t)]
