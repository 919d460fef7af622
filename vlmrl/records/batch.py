"""A step's batch: the record the stages of a step pass on, with every field named here.

``Batch`` is a step's
trajectories (``vlmrl.records.trajectory``) with their padded view: the
rollout fills the token fields, the reward stage the scores, the workers the
log-probs, the driver the advantages; each stage's result is assigned by the
step loop, in one visible line. Fields are optional until their stage runs,
and reading one that has not been filled fails with its name rather than
with a ``KeyError`` somewhere else.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from vlmrl.records.trajectory import Trajectory


@dataclass
class Batch:
    """A step's trajectories and their padded view; tensors are batch-first with B = prompts x n rows.

    The per-sample facts (texts, ground truths, media, pixels) live in
    ``trajectories``; the tensors are the padded view made from them by
    ``vlmrl.records.views.to_batch`` (a left-padded prompt followed by the
    right-padded tokens after it), and the per-token fields the later stages
    add are in that view's response coordinates ``(B, R)``.
    """

    trajectories: list[Trajectory]
    input_ids: torch.Tensor
    """(B, P + R) left-padded prompt followed by the right-padded tokens after it."""
    attention_mask: torch.Tensor
    """(B, P + R) 1 on real tokens."""
    position_ids: torch.Tensor
    """(B, 3, P + R) multimodal rotary positions (temporal, height, width)."""
    responses: torch.Tensor
    """(B, R) the tokens after the prompt, right-padded."""
    response_mask: torch.Tensor
    """(B, R) the loss mask: 1 on sampled, trained tokens (EOS included), 0 on context and padding."""
    group_ids: torch.Tensor
    """(B,) the prompt each sample answers; GRPO groups by it, never by position."""
    temperatures: torch.Tensor
    """(B,) the sampling temperature of each row; its log-probs are computed at it."""
    policy_versions: torch.Tensor
    """(B, R) the policy version that sampled each token, -1 on context and padding."""
    rollout_log_probs: torch.Tensor | None = None
    """(B, R) log-probs vLLM assigned to the sampled tokens."""
    old_log_probs: torch.Tensor | None = None
    """(B, R) actor log-probs before the update."""
    ref_log_probs: torch.Tensor | None = None
    """(B, R) frozen reference model log-probs."""
    teacher_log_probs: torch.Tensor | None = None
    """(B, R) the distillation teacher's log-probs of the sampled tokens (algorithm.distillation)."""
    token_level_scores: torch.Tensor | None = None
    """(B, R) the scalar reward placed on the last trained token."""
    reward_metrics: dict[str, list[float]] = field(default_factory=dict)
    """Per-sample reward sub-scores by name, each of length B."""
    reward_baselines: torch.Tensor | None = None
    """(B,) ReMax: the reward of a greedy response to each sample's prompt."""
    values: torch.Tensor | None = None
    """(B, R) the critic's value of the state before each response token (GAE)."""
    token_level_rewards: torch.Tensor | None = None
    """(B, R) the scores with the KL penalty folded in (equal to the scores when KL is not in the reward)."""
    advantages: torch.Tensor | None = None
    """(B, R)."""
    returns: torch.Tensor | None = None
    """(B, R) the estimator's returns: the critic's regression target under GAE."""
    rollout_shares: torch.Tensor | None = None
    """(B,) ``loss_avg_mode=per_rollout_mean``: each row's share of its rollout's trained tokens over the rows of
    the update on every worker (1 for a row that is a rollout of its own); the actor's update sets it."""

    def __len__(self) -> int:
        return self.responses.shape[0]

    @property
    def prompt_length(self) -> int:
        """Width of the view's prompt part (P)."""
        return self.input_ids.shape[1] - self.responses.shape[1]

    # Per-sample facts, read from the trajectories.
    @property
    def sample_ids(self) -> list[str]:
        return [t.sample_id for t in self.trajectories]

    @property
    def rollout_ids(self) -> list[str]:
        """Each row's rollout (``Trajectory.rollout``): rows of one agent rollout share it."""
        return [t.rollout for t in self.trajectories]

    @property
    def mm_inputs(self) -> list[dict[str, torch.Tensor]]:
        return [t.mm_inputs for t in self.trajectories]

    @property
    def response_texts(self) -> list[str]:
        return [t.response_text for t in self.trajectories]

    @property
    def prompt_texts(self) -> list[str]:
        return [t.prompt_text for t in self.trajectories]

    @property
    def ground_truths(self) -> list[str]:
        return [t.ground_truth for t in self.trajectories]

    @property
    def data_sources(self) -> list[str]:
        return [t.data_source for t in self.trajectories]

    @property
    def row_indices(self) -> list[int]:
        return [t.row_index for t in self.trajectories]

    @property
    def images(self) -> list[list[Any]]:
        return [t.images for t in self.trajectories]

    @property
    def extra_fields(self) -> list[dict[str, Any]]:
        return [t.extra for t in self.trajectories]

    def require(self, *names: str) -> None:
        missing = [n for n in names if getattr(self, n) is None]
        if missing:
            raise RuntimeError(f"Batch fields {missing} are needed here but were not filled by an earlier stage")

    def select(self, index: list[int] | torch.Tensor) -> Batch:
        """Rows ``index`` of every per-sample field, in that order."""
        idx = torch.as_tensor(index, dtype=torch.long)
        rows = idx.tolist()
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                out[f.name] = value.index_select(0, idx)
            elif isinstance(value, list):
                out[f.name] = [value[i] for i in rows]
            elif isinstance(value, dict):
                out[f.name] = {k: [v[i] for i in rows] for k, v in value.items()}
            else:
                out[f.name] = value
        return Batch(**out)

    def split(self, size: int) -> list[Batch]:
        return [self.select(list(range(i, min(i + size, len(self))))) for i in range(0, len(self), size)]

    @staticmethod
    def concat(parts: list[Batch]) -> Batch:
        out = {}
        for f in dataclasses.fields(Batch):
            values = [getattr(p, f.name) for p in parts]
            if all(v is None for v in values):
                out[f.name] = None
            elif any(v is None for v in values):
                raise RuntimeError(f"Batch.concat: field {f.name} is filled in some parts and not in others")
            elif isinstance(values[0], torch.Tensor):
                out[f.name] = torch.cat(values, dim=0)
            elif isinstance(values[0], list):
                out[f.name] = [x for v in values for x in v]
            elif isinstance(values[0], dict):
                out[f.name] = {k: [x for v in values for x in v[k]] for k in values[0]}
            else:
                raise TypeError(f"Batch.concat: field {f.name} has unexpected type {type(values[0]).__name__}")
        return Batch(**out)
