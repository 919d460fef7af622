"""The records that travel between the stages of a step, with every field named here.

``PromptSample`` is what the dataset yields for one row. ``Batch`` is a step's
worth of rollouts: the rollout fills the token fields, the reward manager the
scores, the workers the log-probs, the driver the advantages. Fields are
optional until their stage runs, and reading one that has not been filled
fails with its name rather than with a ``KeyError`` somewhere else.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class PromptSample:
    """One dataset row, ready for both the rollout and the actor."""

    index: int
    """Row index in its dataset."""
    raw_prompt_ids: list[int]
    """Chat-templated prompt with one placeholder token per image or video: vLLM expands these itself."""
    input_ids: list[int]
    """The same prompt with each placeholder expanded to its patch tokens: what the actor sees."""
    images: list[Any]
    """The row's images as PIL images, already resized to the processor's grid."""
    mm_inputs: dict[str, torch.Tensor]
    """Processor outputs for the actor (pixel_values, image_grid_thw, pixel_values_videos,
    video_grid_thw), only the keys of the media the row has; empty for a text-only row."""
    ground_truth: str
    data_source: str
    prompt_text: str
    extra: dict[str, Any] = field(default_factory=dict)
    """The row's other columns (not prompt, answer, images or videos), passed to the reward function."""
    videos: list[Any] = field(default_factory=list)
    """The row's videos (``vlmrl.data.media.Video``: sampled frames on the processor's grid)."""
    position_ids: torch.Tensor | None = None
    """(3, len(input_ids)) rotary positions (temporal, height, width) of the expanded prompt."""
    uid: str = ""
    """Stable id of the row: "FILE:ROW", its source and its index there."""

    @property
    def attention_mask(self) -> list[int]:
        """All ones: a sample is unpadded; the rollout pads batches."""
        return [1] * len(self.input_ids)

    @property
    def multi_modal_data(self) -> dict[str, list]:
        """The media as vLLM's ``multi_modal_data`` wants them; empty for a text-only row."""
        data: dict[str, list] = {}
        if self.images:
            data["image"] = list(self.images)
        if self.videos:
            data["video"] = [video.for_vllm() for video in self.videos]
        return data


@dataclass
class Batch:
    """A step's rollouts; tensors are batch-first with B = prompts x n rows."""

    input_ids: torch.Tensor
    """(B, P + R) left-padded prompt followed by right-padded response."""
    attention_mask: torch.Tensor
    """(B, P + R) 1 on real tokens."""
    position_ids: torch.Tensor
    """(B, 3, P + R) multimodal rotary positions (temporal, height, width)."""
    responses: torch.Tensor
    """(B, R) response token ids, right-padded."""
    response_mask: torch.Tensor
    """(B, R) 1 on response tokens (EOS included), 0 on padding."""
    group_ids: torch.Tensor
    """(B,) the prompt each sample answers; GRPO groups by it, never by position."""
    mm_inputs: list[dict[str, torch.Tensor]]
    """Per-sample processor outputs (empty dict for text-only samples)."""
    response_texts: list[str]
    prompt_texts: list[str]
    ground_truths: list[str]
    data_sources: list[str]
    row_indices: list[int]
    """Each sample's row in its dataset."""
    images: list[list[Any]] = field(default_factory=list)
    extra_fields: list[dict[str, Any]] = field(default_factory=list)
    """Each sample's row's extra columns (``PromptSample.extra``), for the reward function."""
    rollout_log_probs: torch.Tensor | None = None
    """(B, R) log-probs vLLM assigned to the sampled tokens."""
    old_log_probs: torch.Tensor | None = None
    """(B, R) actor log-probs before the update."""
    ref_log_probs: torch.Tensor | None = None
    """(B, R) frozen reference model log-probs."""
    token_level_scores: torch.Tensor | None = None
    """(B, R) the scalar reward placed on the last response token."""
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

    def __len__(self) -> int:
        return self.responses.shape[0]

    @property
    def prompt_length(self) -> int:
        return self.input_ids.shape[1] - self.responses.shape[1]

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
                out[f.name] = [value[i] for i in rows] if value else []
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
