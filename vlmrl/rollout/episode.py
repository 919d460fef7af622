"""An episode while it is being played: a prompt, then model turns and what answered them, in two token views.

``Episode`` is the record every conversation grows in: the built-in multi-turn
loop's (``vlmrl.rollout.turns.loop``) and a user workflow's
(``vlmrl.rollout.workflow``). It keeps the engine's view of the tokens (one
placeholder per image, what a request sends) and the actor's (each image's
placeholder expanded to its patch tokens) side by side, with a loss mask (1 on
the tokens the model sampled), the engine's log-probs and the policy version
of each sampled token, every image shown, and one reward slot per model turn.

``to_trajectory`` turns it into the ``Trajectory`` training takes. An episode
of exactly one model turn and nothing after it is recorded as a single-turn
trajectory (no turns, no messages), exactly as the single-turn rollout records
one; any other episode is a conversation, which the reward function gets with
its messages and the metrics count by turns.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from vlmrl.records import Media, PromptSample, Trajectory
from vlmrl.rollout.engine.sampling import media_offsets
from vlmrl.rollout.turns.observations import Observation

Positions = Callable[[list[int], dict[str, torch.Tensor]], torch.Tensor]
"""``(actor token ids, mm inputs) -> (3, n)`` rotary positions of the model's family."""


@dataclass
class Episode:
    """One trajectory while its turns are played."""

    prompt: PromptSample
    group_id: int
    index: int
    """The sample's index in its group (0 .. n - 1)."""
    raw: list[int]
    """The engine's view: one placeholder token per image."""
    ids: list[int]
    """The actor's view: each image's placeholder expanded to its patch tokens."""
    prompt_length: int
    mask: list[int]
    log_probs: list[float]
    versions: list[int]
    mm_chunks: list[dict[str, torch.Tensor]]
    images: list[Any]
    """Every image shown so far, the prompt's first."""
    image_ids: list[str]
    """The content id of each image the engine is sent (``multi_modal_data``'s, in its order)."""
    new_images: list[Any] = field(default_factory=list)
    """The images shown after the prompt."""
    turn_ends: list[int] = field(default_factory=list)
    turn_rewards: list[float] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)
    last_text: str = ""
    stop_reason: str = ""
    reward: float | None = None
    """The episode's reward, when its workflow gives one; None: the reward function scores it."""
    closed: bool = True
    """Whether the last model turn ended with its end-of-turn token (a turn cut by max_tokens did not)."""
    state: dict[str, Any] = field(default_factory=dict)
    """Per episode: what its tools keep between calls (``ToolContext.state``)."""
    calls: list[dict] = field(default_factory=list)
    """The tool calls ``ctx.call_tool`` ran for this episode, recorded as the multi-turn loop records its own: what
    the reward function (``tool_calls``) and the ``agent/tool_*`` metrics see."""

    @classmethod
    def start(cls, prompt: PromptSample, group_id: int, index: int, image_ids: list[str]) -> Episode:
        """An episode of ``prompt`` alone; ``image_ids`` are the content ids of the prompt's images."""
        n = len(prompt.input_ids)
        return cls(
            prompt=prompt,
            group_id=group_id,
            index=index,
            raw=list(prompt.raw_prompt_ids),
            ids=list(prompt.input_ids),
            prompt_length=n,
            mask=[0] * n,
            log_probs=[0.0] * n,
            versions=[-1] * n,
            mm_chunks=[prompt.mm_inputs] if prompt.mm_inputs else [],
            images=list(prompt.images),
            image_ids=list(image_ids),
        )

    @property
    def sample_id(self) -> str:
        return f"{self.group_id}:{self.index}"

    def used(self) -> int:
        """Tokens after the prompt (the actor's view), model and context together."""
        return len(self.ids) - self.prompt_length

    @property
    def num_turns(self) -> int:
        return len(self.turn_ends)

    def multi_modal_data(self) -> dict[str, list]:
        """What a request of this episode sends the engine besides its tokens: vLLM's ``multi_modal_data``."""
        data = self.prompt.multi_modal_data
        if self.new_images:
            data = {**data, "image": [*data.get("image", []), *self.new_images]}
        return data

    def add_turn(
        self, token_ids: list[int], log_probs: list[float] | None, version: int | list[int], text: str,
        *, closed: bool = True,
    ) -> None:  # fmt: skip
        """A model turn: tokens the model sampled (trained), their log-probs and the version (or per-token
        versions) that sampled them. ``closed``: the turn ended with its end-of-turn token."""
        self.raw += token_ids
        self.ids += token_ids
        self.mask += [1] * len(token_ids)
        self.log_probs += list(log_probs) if log_probs is not None else [0.0] * len(token_ids)
        self.versions += list(version) if isinstance(version, list) else [version] * len(token_ids)
        self.turn_ends.append(len(self.ids) - 1)
        self.turn_rewards.append(0.0)
        self.messages.append({"role": "assistant", "content": text})
        self.last_text = text
        self.closed = closed

    def add_context(self, token_ids: list[int], raw_ids: list[int] | None = None) -> None:
        """Tokens the model did not sample (``raw_ids``: the engine's view of them, when it differs)."""
        self.raw += token_ids if raw_ids is None else raw_ids
        self.ids += token_ids
        self.mask += [0] * len(token_ids)
        self.log_probs += [0.0] * len(token_ids)
        self.versions += [-1] * len(token_ids)

    def add_observation(self, obs: Observation, messages: list[dict]) -> None:
        """A rendered observation (``ConversationRenderer.render``) and the messages it renders. Its ``opener`` (the
        next turn's first token, where a reply stops at it: GLM-4.1V) is left out when the episode ends with it."""
        if obs.opener is not None and self.raw and self.raw[-1] == obs.opener:
            self.add_context(obs.ids[1:], obs.raw_ids[1:])
        else:
            self.add_context(obs.ids, obs.raw_ids)
        if obs.images:
            self.mm_chunks.append(obs.mm_inputs)
            self.images += obs.images
            self.new_images += obs.images
            self.image_ids += obs.image_ids
        self.messages += messages

    def row(self) -> dict[str, Any]:
        """The row's columns as a tool or an environment gets them."""
        p = self.prompt
        return {**p.extra, "ground_truth": p.ground_truth, "data_source": p.data_source, "prompt": p.prompt_text}

    @property
    def is_single_turn(self) -> bool:
        """One model turn and nothing after it: recorded as a single-turn rollout."""
        return len(self.turn_ends) == 1 and self.turn_ends[0] == len(self.ids) - 1 and not self.new_images

    def to_trajectory(
        self,
        *,
        positions: Positions,
        pad_ids: tuple[int, ...],
        temperature: float,
        want_log_probs: bool,
        tool_calls: list[dict] | None = None,
        render_mismatch: bool | None = False,
        rollout_id: str = "",
        conversation: bool = False,
    ) -> Trajectory:
        """The training record of this episode. ``pad_ids``: the image and video pad tokens (image first).
        ``conversation``: recorded as a conversation even when it is one turn (the multi-turn loop's are)."""
        if not conversation and self.is_single_turn and self.prompt.position_ids is not None:
            # The rotary positions of text after the prompt continue one past the prompt's largest, on every
            # axis: no need to run the family's position function over the whole sequence.
            p = self.prompt_length
            trajectory = Trajectory.single_turn(
                self.prompt, self.group_id, self.index, self.ids[p:], self.last_text, temperature,
                self.log_probs[p:] if want_log_probs else None, 0, media_offsets(self.prompt.input_ids, pad_ids),
            )  # fmt: skip
            trajectory.versions = list(self.versions)
            trajectory.agent_reward, trajectory.rollout_id = self.reward, rollout_id
            return trajectory
        mm_inputs = _merge(self.mm_chunks)
        positions_input = {**mm_inputs, **{k: v for k, v in self.prompt.mm_inputs.items() if k == "second_per_grid_ts"}}
        position_ids = positions(self.ids, positions_input)
        image_offsets = media_offsets(self.ids, pad_ids[:1])
        video_offsets = media_offsets(self.ids, pad_ids[1:])
        if len(video_offsets) != len(self.prompt.videos):  # Qwen3-VL writes a video as one run per frame
            video_offsets = [-1] * len(self.prompt.videos)
        media = [Media("image", o, image) for o, image in zip(image_offsets, self.images, strict=True)]
        media += [Media("video", o, video) for o, video in zip(video_offsets, self.prompt.videos)]
        p = self.prompt
        return Trajectory(
            token_ids=self.ids,
            prompt_length=self.prompt_length,
            loss_mask=self.mask,
            position_ids=position_ids,
            group_id=self.group_id,
            sample_id=self.sample_id,
            temperature=temperature,
            log_probs=self.log_probs if want_log_probs else None,
            versions=self.versions,
            mm_inputs=mm_inputs,
            media=media,
            response_text=self.last_text,
            prompt_text=p.prompt_text,
            ground_truth=p.ground_truth,
            data_source=p.data_source,
            row_index=p.index,
            extra=p.extra,
            turn_rewards=self.turn_rewards,
            turn_ends=self.turn_ends,
            messages=self.messages,
            tool_calls=self.calls if tool_calls is None else tool_calls,
            stop_reason=self.stop_reason,
            prompt_media=len(p.images) + len(p.videos),
            render_mismatch=render_mismatch,
            agent_reward=self.reward,
            rollout_id=rollout_id,
        )


def _merge(chunks: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    keys = dict.fromkeys(k for chunk in chunks for k in chunk)
    return {k: torch.cat([chunk[k] for chunk in chunks if k in chunk], dim=0) for k in keys}
