"""A small Batch for reward tests: what the driver would hold after a rollout, minus the model."""

from __future__ import annotations

import torch
from PIL import Image

from vlmrl.records import Media, Trajectory
from vlmrl.records.views import to_batch

PROMPT = 2  # prompt tokens of every row


def make_batch(responses: list[str], lengths: list[int], width: int = 6):
    image = Image.new("RGB", (28, 14), "red")
    trajectories = []
    for i, (text, length) in enumerate(zip(responses, lengths)):
        n = PROMPT + length
        trajectories.append(
            Trajectory(
                token_ids=[0] * n,
                prompt_length=PROMPT,
                loss_mask=[0] * PROMPT + [1] * length,
                position_ids=torch.arange(n).expand(3, n),
                group_id=i // 2,
                sample_id=f"{i // 2}:{i % 2}",
                temperature=1.0,
                media=[Media("image", 0, image)] if i % 2 == 0 else [],
                response_text=text,
                prompt_text=f"prompt {i // 2}",
                ground_truth="red",
                data_source="colours",
                row_index=i // 2,
                extra={"difficulty": i, "prompt": "a column named like a vlmrl key"},
            )
        )
    return to_batch(trajectories, max_prompt_length=PROMPT, max_response_length=width, pad_token_id=0)
