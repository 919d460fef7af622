"""A small Batch for reward tests: what the driver would hold after a rollout, minus the model."""

from __future__ import annotations

import torch
from PIL import Image

from vlmrl.records import Batch


def make_batch(responses: list[str], lengths: list[int], width: int = 6) -> Batch:
    b = len(responses)
    response_mask = (torch.arange(width) < torch.tensor(lengths)[:, None]).long()
    image = Image.new("RGB", (28, 14), "red")
    return Batch(
        input_ids=torch.zeros(b, 2 + width, dtype=torch.long),
        attention_mask=torch.ones(b, 2 + width, dtype=torch.long),
        position_ids=torch.zeros(b, 3, 2 + width, dtype=torch.long),
        responses=torch.zeros(b, width, dtype=torch.long),
        response_mask=response_mask,
        group_ids=torch.arange(b) // 2,
        mm_inputs=[{}] * b,
        response_texts=responses,
        prompt_texts=[f"prompt {i // 2}" for i in range(b)],
        ground_truths=["red"] * b,
        data_sources=["colours"] * b,
        row_indices=[i // 2 for i in range(b)],
        images=[[image] if i % 2 == 0 else [] for i in range(b)],
        extra_fields=[{"difficulty": i, "prompt": "a column named like a vlmrl key"} for i in range(b)],
    )
