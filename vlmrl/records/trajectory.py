"""One rollout as a flat record: the tokens of the whole conversation and what each one is.

A ``Trajectory`` is the unit the rollout hands to training. It holds every
token of the sequence in order (the prompt, the model's turns and, later, the
tool or environment turns in between) with a per-token loss mask (1 where the
model sampled the token and it is trained, 0 on context), the log-prob the
sampling policy gave each sampled token, and the policy version that sampled
it. A single-turn rollout is the one-turn case: a prompt, then one stretch of
sampled tokens.

Deliberate deviation from prime-rl's record, which has no prompt/completion
split at all: ``prompt_length`` marks where the first turn starts. Nothing
before it is ever trained, and the padded view left-pads the prompt and
right-pads the rest, so rows of a step line up at the first sampled token and
the per-token tensors of the maths keep their ``(B, R)`` shape. Multi-turn
trajectories fit the same view: their tool turns are tokens after
``prompt_length`` with loss mask 0.

The padded view the passes need is made from a list of trajectories in one
place, ``vlmrl.records.views.to_batch``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from vlmrl.records.prompt import PromptSample
from vlmrl.records.shipping import ShipsTensors


@dataclass(frozen=True)
class Media:
    """An image or a video the sequence shows, and the token where its placeholder run starts."""

    kind: str
    """"image" or "video"."""
    offset: int
    """Index in ``Trajectory.token_ids`` of the first token of its run of pad tokens."""
    item: Any
    """The PIL image, or the ``vlmrl.data.media.Video``."""


@dataclass
class Trajectory(ShipsTensors):
    token_ids: list[int]
    """Every token of the sequence, in order: the prompt (media placeholders expanded), then the turns."""
    prompt_length: int
    """Tokens of the prompt, before the first turn; never trained."""
    loss_mask: list[int]
    """Per token: 1 where the model sampled it and it is trained, 0 on context (prompt, tool output)."""
    position_ids: torch.Tensor
    """(3, len(token_ids)) rotary positions (temporal, height, width)."""
    group_id: int
    """The prompt this answers; GRPO groups by it."""
    sample_id: str
    """Unique in the run: "<group id>:<sample index>". Workers keep trajectories under it."""
    temperature: float
    """The sampling temperature of the call that made it; log-probs are computed at this temperature."""
    log_probs: list[float] | None = None
    """Per token: the sampling policy's log-prob of each sampled token (0 on context); None when not asked."""
    versions: list[int] = field(default_factory=list)
    """Per token: the policy version that sampled it, -1 on context."""
    mm_inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    """Processor outputs for the model's forward (pixel values, grids) of every medium, in sequence order."""
    media: list[Media] = field(default_factory=list)
    response_text: str = ""
    """The model's text after the prompt (for a single turn, its response)."""
    prompt_text: str = ""
    ground_truth: str = ""
    data_source: str = ""
    row_index: int = -1
    """The row in its dataset."""
    extra: dict[str, Any] = field(default_factory=dict)
    """The row's other columns, for the reward function."""
    turn_rewards: list[float] = field(default_factory=list)
    """Multi-turn: one reward per model turn (tool or environment rewards), 0 where none was given."""
    turn_ends: list[int] = field(default_factory=list)
    """Multi-turn: the index in ``token_ids`` of each model turn's last token; turn rewards are placed there."""
    messages: list[dict] = field(default_factory=list)
    """Multi-turn: the conversation after the prompt (assistant, tool or environment messages; images as
    ``{"type": "image"}`` items, in the order of ``images`` after the prompt's)."""
    tool_calls: list[dict] = field(default_factory=list)
    """Multi-turn: every call the model made, in order: name, arguments, status, seconds, turn."""
    stop_reason: str = ""
    """Multi-turn: why the trajectory ended: done, max_turns, length or error."""
    prompt_media: int = -1
    """How many of ``media`` are the prompt's (the rest came from tools or the environment); -1: all of them."""
    render_mismatch: bool | None = False
    """Multi-turn: the token ids differ from a full re-render of the conversation by the chat template; None: not
    checked (the agent loop checks the first trajectory of each group)."""
    agent_reward: float | None = None
    """The reward an external agent (``worker.rollout.agent``) returned for this row's rollout; None: the reward
    function scores the rollout's last row."""
    rollout_id: str = ""
    """The rollout this row belongs to when one rollout spans several rows (an external agent's calls); ""
    makes the row a rollout of its own. ``loss_avg_mode=per_rollout_mean`` weighs rollouts, not rows."""

    @property
    def rollout(self) -> str:
        """The rollout id, or the sample id for a row that is a rollout of its own."""
        return self.rollout_id or self.sample_id

    @property
    def num_turns(self) -> int:
        """Model turns: one for a single-turn rollout."""
        return max(1, len(self.turn_ends))

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if len(self.loss_mask) != n or tuple(self.position_ids.shape) != (3, n):
            raise ValueError(
                f"trajectory {self.sample_id}: {n} tokens but a loss mask of {len(self.loss_mask)} and positions "
                f"of shape {tuple(self.position_ids.shape)}"
            )
        if self.log_probs is not None and len(self.log_probs) != n:
            raise ValueError(f"trajectory {self.sample_id}: {n} tokens but {len(self.log_probs)} log-probs")
        if self.versions and len(self.versions) != n:
            raise ValueError(f"trajectory {self.sample_id}: {n} tokens but {len(self.versions)} versions")

    @property
    def completion_ids(self) -> list[int]:
        """The tokens after the prompt: the model's turns and what answered them."""
        return self.token_ids[self.prompt_length :]

    @property
    def images(self) -> list[Any]:
        return [m.item for m in self.media if m.kind == "image"]

    @property
    def has_own_media(self) -> bool:
        """Whether media came after the prompt (tool or environment images), which the driver does not hold."""
        return 0 <= self.prompt_media < len(self.media)

    @property
    def media_are_the_prompts(self) -> bool:
        """Whether its media are exactly its prompt's, which the driver holds (not an agent's or a tool's)."""
        return self.prompt_media != 0 and not self.has_own_media

    def slim(self) -> Trajectory:
        """The same record without pixels or media payloads (their kinds and offsets stay): what a worker
        sends back to the driver, which already holds the row's media and puts them back (``with_media``).
        A trajectory whose media are not just its prompt's (``media_are_the_prompts``) is sent whole."""
        if not self.media_are_the_prompts:
            return self
        return dataclasses.replace(
            self, mm_inputs={}, media=[Media(m.kind, m.offset, None) for m in self.media]
        )

    def with_media(self, items: list[Any]) -> Trajectory:
        """This record with its media payloads ``items`` (in sequence order) put back."""
        if len(items) != len(self.media):
            raise ValueError(f"trajectory {self.sample_id}: {len(self.media)} media but {len(items)} items given")
        return dataclasses.replace(self, media=[Media(m.kind, m.offset, item) for m, item in zip(self.media, items)])

    @classmethod
    def single_turn(
        cls,
        prompt: PromptSample,
        group_id: int,
        sample_index: int,
        token_ids: list[int],
        text: str,
        temperature: float,
        log_probs: list[float] | None = None,
        version: int = 0,
        media_offsets: list[int] | None = None,
    ) -> Trajectory:
        """A prompt and one sampled response.

        The response's positions continue one past the prompt's largest
        position on all three axes, as text does in Qwen-VL's rotary scheme.
        """
        if prompt.position_ids is None:
            raise ValueError(f"row {prompt.index}: the prompt has no position ids (the dataset computes them)")
        p, r = len(prompt.input_ids), len(token_ids)
        start = int(prompt.position_ids.max()) + 1 if p else 0
        response_positions = (start + torch.arange(r, dtype=torch.long)).expand(3, r)
        kinds = ["image"] * len(prompt.images) + ["video"] * len(prompt.videos)
        items = list(prompt.images) + list(prompt.videos)
        offsets = media_offsets if media_offsets and len(media_offsets) == len(items) else [-1] * len(items)
        media = [Media(k, o, m) for k, o, m in zip(kinds, offsets, items)]
        return cls(
            token_ids=list(prompt.input_ids) + list(token_ids),
            prompt_length=p,
            loss_mask=[0] * p + [1] * r,
            position_ids=torch.cat([prompt.position_ids.long(), response_positions], dim=1),
            group_id=group_id,
            sample_id=f"{group_id}:{sample_index}",
            temperature=temperature,
            log_probs=None if log_probs is None else [0.0] * p + list(log_probs),
            versions=[-1] * p + [version] * r,
            mm_inputs=prompt.mm_inputs,
            media=media,
            response_text=text,
            prompt_text=prompt.prompt_text,
            ground_truth=prompt.ground_truth,
            data_source=prompt.data_source,
            row_index=prompt.index,
            extra=prompt.extra,
        )
