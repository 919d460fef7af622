"""One supervised step on right-padded rows, the loss on each row's last tokens only: the format tunings' step."""

from __future__ import annotations


def step_on_targets(model, optimizer, inputs: dict, target_lengths: list[int]) -> None:
    """Train ``model`` one step on ``inputs`` (a right-padded batch), each row's loss on its last ``n`` real tokens.

    The targets (a tuned answer and its end token) end each row, so the prompt before them is context only.
    """
    import torch

    labels = torch.full_like(inputs["input_ids"], -100)
    for row, (length, n) in enumerate(zip(inputs["attention_mask"].sum(dim=1).tolist(), target_lengths)):
        labels[row, length - n : length] = inputs["input_ids"][row, length - n : length]
    optimizer.zero_grad()
    model(**inputs, labels=labels).loss.backward()
    optimizer.step()
