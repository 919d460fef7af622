"""Rows of a batch as JSON lines: what validation logs (``trainer.val_generations_to_log``) and what each training
step trained (``trainer.rollout_data_dir``, verl's key).

One line per row: the step, the data row and the group, the prompt and the response as text, the ground truth, the
scores, the token ids with vLLM's log-probs, and the policy version that sampled each generated token (-1 on a tool's
or the environment's tokens). A conversation's line has every token after the prompt, which of them the model wrote
(``loss_mask``), the messages, the tool calls, the turn rewards and why it stopped; an external agent's row names its
rollout. A training step's rows also have their advantage (the mean over the row's trained tokens).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vlmrl.records import Batch


def generation_row(batch: Batch, i: int, step: int) -> dict[str, Any]:
    """Row ``i`` of ``batch`` as one JSON-ready dict."""
    t = batch.trajectories[i]
    length = len(t.completion_ids) if t.turn_ends else int(batch.response_mask[i].sum())
    log_probs = batch.rollout_log_probs
    row: dict[str, Any] = {
        "step": step,
        "row": batch.row_indices[i],
        "group": int(batch.group_ids[i]),
        "prompt": batch.prompt_texts[i],
        "response": batch.response_texts[i],
        "ground_truth": batch.ground_truths[i],
        "data_source": batch.data_sources[i],
        "scores": {k: v[i] for k, v in batch.reward_metrics.items()},
        "response_ids": batch.responses[i, :length].tolist(),
        "rollout_log_probs": log_probs[i, :length].tolist() if log_probs is not None else None,
        "versions": batch.policy_versions[i, :length].tolist(),
    }
    if batch.advantages is not None:
        mask = batch.response_mask[i].bool()
        row["advantage"] = float(batch.advantages[i][mask].mean()) if mask.any() else 0.0
    if t.rollout_id:  # an external agent's row: its rollout, and the calls merged into it
        row["rollout_id"] = t.rollout_id
    if t.turn_ends:  # a conversation: every token after the prompt, which of them the model wrote
        row.update(
            response_ids=t.completion_ids,
            loss_mask=t.loss_mask[t.prompt_length :],
            rollout_log_probs=t.log_probs[t.prompt_length :] if t.log_probs is not None else None,
            messages=t.messages,
            tool_calls=t.tool_calls,
            turn_rewards=t.turn_rewards,
            stop_reason=t.stop_reason,
            images=len(t.media),
        )
    return row


def write_generations(path: Path, batch: Batch, step: int, count: int | None = None) -> None:
    """The first ``count`` rows of ``batch`` (all of them for None) to ``path``, replacing what it held: a step
    trained again after a resume writes its file afresh."""
    count = len(batch) if count is None else min(count, len(batch))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as f:
        for i in range(count):
            f.write(json.dumps(generation_row(batch, i, step)) + "\n")
    tmp.replace(path)
