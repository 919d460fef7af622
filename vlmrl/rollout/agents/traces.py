"""From the LLM calls an external agent made to training rows (``algorithm.trace_aggregation``).

An agent written in any framework talks to vlmrl's engine through an
OpenAI-compatible endpoint, which records every call against its rollout: the
prompt token ids, the sampled token ids, their log-probs and the policy version
that served it (a ``Call``). This module turns a rollout's calls into rows.

* ``transition``: one row per call, its prompt as context and its response as
  the trained tokens.
* ``trajectory``: a rollout's calls merged into as few rows as possible. A call
  whose prompt starts with the row so far (the previous context plus the
  previous response) continues the row: the prompt's new tokens are appended as
  observation (loss mask 0) and its response as trained tokens (mask 1). A call
  whose prompt does not start so begins a new row, and the mismatch is kept with
  both decoded views, so a user can see that the chat template is not
  append-only (Qwen3's drops earlier turns' reasoning) or that the agent edits
  its history.

The design follows Agent Lightning's trace adapter (triplets of prompt ids,
response ids and log-probs; "transition" and "trajectory" levels). Deliberate
differences: calls are ordered by their index rather than by arrival; a call
continues a row only if the images of the row are also the first images of its
prompt (equal token ids do not mean equal pixels) and it was sampled at the
row's temperature (the actor computes one row's log-probs at one
temperature); a row's per-token versions say which weights sampled each
token; a row with no trained token is dropped and counted rather than kept.

Token ids are in the actor's view, as ``Trajectory`` holds them: each image's
placeholder run expanded to its patch tokens. The endpoint records them so.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from vlmrl.algos.rollout_credit import TraceAggregation  # an option of the config, so it lives below it
from vlmrl.records import Media, Trajectory

__all__ = ["Aggregated", "Call", "Mismatch", "TraceAggregation", "TraceRow", "aggregate"]


@dataclass(frozen=True)
class Call:
    """One LLM call an agent made, as the endpoint recorded it."""

    rollout_id: str
    index: int
    """The call's place in its rollout (0, 1, ...), assigned by the endpoint as calls arrive."""
    prompt_ids: Sequence[int]
    """The prompt the model saw, in the actor's view (patch tokens expanded)."""
    response_ids: Sequence[int]
    log_probs: Sequence[float]
    """The sampling policy's log-prob of each response token."""
    version: int
    """The policy version (weight sync count) that served the call."""
    finish_reason: str = "stop"
    """The engine's: "stop" or "length"."""
    temperature: float = 1.0
    images: tuple[Any, ...] = ()
    """References to the prompt's images, in the order of their placeholder runs (compared with ``==``)."""
    reward: float = 0.0
    """What the agent reported for this call before its rollout ended (``POST /v1/rewards``,
    ``AgentLLM.emit_reward``): a turn reward, added on the call's last response token."""

    def __post_init__(self) -> None:
        if len(self.log_probs) != len(self.response_ids):
            raise ValueError(
                f"rollout {self.rollout_id} call {self.index}: {len(self.response_ids)} response tokens "
                f"but {len(self.log_probs)} log-probs"
            )


# Why rows are their own record rather than ``Trajectory``: a ``Trajectory`` needs
# the 3-D rotary positions and the processor's outputs (pixel values, grids) of
# its images at construction, and both come from the model family's processor,
# which a pure module does not load. A ``TraceRow`` holds everything the calls
# say, with image references; ``to_trajectory`` makes the record once the caller
# has resolved the images. The per-token fields have the meaning they have in
# ``Trajectory``, so the conversion copies them.
@dataclass
class TraceRow:
    """One training row made from consecutive calls of one rollout."""

    rollout_id: str
    calls: list[int]
    """The indices of the calls merged into this row, in order."""
    token_ids: list[int]
    prompt_length: int
    """The first call's prompt; never trained."""
    loss_mask: list[int]
    """1 on response tokens, 0 on the prompt and on the observation tokens between calls."""
    log_probs: list[float]
    """The sampling log-prob of each response token, 0 elsewhere."""
    versions: list[int]
    """The version that sampled each response token, -1 elsewhere."""
    turn_ends: list[int]
    """The index of each non-empty response's last token."""
    temperature: float
    finish_reason: str
    """The last call's."""
    images: tuple[Any, ...] = ()
    """The row's image references, in sequence order (the last call's prompt images)."""
    turn_rewards: list[float] = field(default_factory=list)
    """One per ``turn_ends``: the rewards the agent reported for the calls of that response (a call with no
    response adds its reward to the row's previous turn)."""

    @property
    def call_span(self) -> tuple[int, int]:
        """``(first, last)`` call index of the row, both included."""
        return self.calls[0], self.calls[-1]

    @property
    def trained_tokens(self) -> int:
        return sum(self.loss_mask)

    def to_trajectory(
        self,
        *,
        group_id: int,
        position_ids: torch.Tensor | None = None,
        mm_inputs: dict[str, torch.Tensor] | None = None,
        media: list[Media] | None = None,
        sample_id: str | None = None,
        **fields: Any,
    ) -> Trajectory:
        """The row as a ``Trajectory`` of task ``group_id``.

        ``position_ids`` default to text positions (``0..n-1`` on all three
        axes), which is right only without images; a row with images needs the
        family's positions, ``mm_inputs`` and its ``media`` (one per image
        reference). ``sample_id`` defaults to "<rollout id>:<first call index>",
        unique since every call belongs to one row. ``fields`` are passed on
        (``ground_truth``, ``extra``, ``response_text``, ...).
        """
        n = len(self.token_ids)
        media = list(media or [])
        if len(media) != len(self.images):
            raise ValueError(
                f"rollout {self.rollout_id} calls {self.call_span}: {len(self.images)} images but {len(media)} media"
            )
        if position_ids is None:
            if self.images:
                raise ValueError(
                    f"rollout {self.rollout_id} calls {self.call_span}: a row with images needs the model family's "
                    "position ids"
                )
            position_ids = torch.arange(n, dtype=torch.long).expand(3, n)
        return Trajectory(
            token_ids=list(self.token_ids),
            prompt_length=self.prompt_length,
            loss_mask=list(self.loss_mask),
            position_ids=position_ids,
            group_id=group_id,
            sample_id=sample_id or f"{self.rollout_id}:{self.calls[0]}",
            temperature=self.temperature,
            log_probs=list(self.log_probs),
            versions=list(self.versions),
            mm_inputs=dict(mm_inputs or {}),
            media=media,
            turn_ends=list(self.turn_ends),
            turn_rewards=list(self.turn_rewards),
            stop_reason=self.finish_reason,
            rollout_id=self.rollout_id,  # rows of one rollout weigh as one under loss_avg_mode=per_rollout_mean
            **fields,
        )


@dataclass(frozen=True)
class Mismatch:
    """A call that did not continue its rollout's row (``trajectory`` aggregation), for the log."""

    rollout_id: str
    call_index: int
    reason: str
    """"tokens" (the prompt does not start with the row), "images" (same tokens, other images) or "temperature"."""
    diverges_at: int
    """The first token index where the row and the prompt differ (the shorter length if one is a prefix)."""
    previous: str
    """The row so far (previous context and response), decoded."""
    current: str
    """The call's prompt, decoded."""


@dataclass
class Aggregated:
    """What ``aggregate`` made of a batch of rollouts."""

    rows: list[TraceRow] = field(default_factory=list)
    mismatches: list[Mismatch] = field(default_factory=list)
    empty_rollouts: list[str] = field(default_factory=list)
    """Rollouts that made no call (the agent answered without the model, or failed first)."""
    untrained_rows: int = 0
    """Rows dropped because they had no response token (every call in them returned nothing)."""

    def metrics(self) -> dict[str, float]:
        return {
            "trace/rows": float(len(self.rows)),
            "trace/mismatches": float(len(self.mismatches)),
            "trace/empty_rollouts": float(len(self.empty_rollouts)),
            "trace/untrained_rows": float(self.untrained_rows),
        }


Decode = Callable[[Sequence[int]], str]


def aggregate(
    calls_by_rollout: Mapping[str, Sequence[Call]],
    mode: TraceAggregation | str,
    decode: Decode,
) -> Aggregated:
    """Turn each rollout's calls into rows, rollouts in the mapping's order, calls by index.

    Args:
        calls_by_rollout: rollout id -> its calls, in any order; an empty list is a rollout that made no call.
        mode: ``trajectory`` or ``transition``.
        decode: token ids -> text (the tokenizer's ``decode``), used only for mismatches.

    Returns:
        The rows, the mismatches (``trajectory`` only) and the counts.
    """
    mode = TraceAggregation(mode)
    out = Aggregated()
    for rollout_id, calls in calls_by_rollout.items():
        ordered = _ordered(rollout_id, calls)
        if not ordered:
            out.empty_rollouts.append(rollout_id)
            continue
        if mode is TraceAggregation.transition:
            rows = [_start(c) for c in ordered]
        else:
            rows = _merge(ordered, decode, out.mismatches)
        kept = [r for r in rows if r.trained_tokens]
        out.untrained_rows += len(rows) - len(kept)
        out.rows += kept
    return out


def _ordered(rollout_id: str, calls: Sequence[Call]) -> list[Call]:
    """The calls by index, checked to belong to ``rollout_id`` and to have distinct indices."""
    for c in calls:
        if c.rollout_id != rollout_id:
            raise ValueError(f"call {c.index} of rollout {c.rollout_id} was filed under rollout {rollout_id}")
    ordered = sorted(calls, key=lambda c: c.index)
    indices = [c.index for c in ordered]
    if len(set(indices)) != len(indices):
        raise ValueError(f"rollout {rollout_id}: repeated call indices in {indices}")
    return ordered


def _start(c: Call) -> TraceRow:
    """A row holding one call: its prompt as context, its response trained."""
    p, r = len(c.prompt_ids), len(c.response_ids)
    return TraceRow(
        rollout_id=c.rollout_id,
        calls=[c.index],
        token_ids=[*c.prompt_ids, *c.response_ids],
        prompt_length=p,
        loss_mask=[0] * p + [1] * r,
        log_probs=[0.0] * p + [float(x) for x in c.log_probs],
        versions=[-1] * p + [c.version] * r,
        turn_ends=[p + r - 1] if r else [],
        temperature=c.temperature,
        finish_reason=c.finish_reason,
        images=tuple(c.images),
        turn_rewards=[float(c.reward)] if r else [],
    )


def _extend(row: TraceRow, c: Call) -> None:
    """Append ``c`` to ``row``, whose tokens its prompt starts with: new prompt tokens as observation."""
    observation = list(c.prompt_ids[len(row.token_ids) :])
    o, r = len(observation), len(c.response_ids)
    row.calls.append(c.index)
    row.token_ids += observation + list(c.response_ids)
    row.loss_mask += [0] * o + [1] * r
    row.log_probs += [0.0] * o + [float(x) for x in c.log_probs]
    row.versions += [-1] * o + [c.version] * r
    if r:
        row.turn_ends.append(len(row.token_ids) - 1)
        row.turn_rewards.append(float(c.reward))
    elif row.turn_rewards:
        row.turn_rewards[-1] += float(c.reward)
    row.finish_reason = c.finish_reason
    row.images = tuple(c.images)


def _merge(calls: list[Call], decode: Decode, mismatches: list[Mismatch]) -> list[TraceRow]:
    rows = [_start(calls[0])]
    for c in calls[1:]:
        row = rows[-1]
        reason = _break_reason(row, c)
        if reason is None:
            _extend(row, c)
            continue
        mismatches.append(
            Mismatch(
                rollout_id=c.rollout_id,
                call_index=c.index,
                reason=reason,
                diverges_at=_common_prefix(row.token_ids, c.prompt_ids),
                previous=decode(row.token_ids),
                current=decode(list(c.prompt_ids)),
            )
        )
        rows.append(_start(c))
    return rows


def _break_reason(row: TraceRow, c: Call) -> str | None:
    """Why ``c`` cannot continue ``row``, or None when it can."""
    n = len(row.token_ids)
    if len(c.prompt_ids) < n or list(c.prompt_ids[:n]) != row.token_ids:
        return "tokens"
    if tuple(c.images[: len(row.images)]) != row.images:
        return "images"
    if c.temperature != row.temperature:
        return "temperature"
    return None


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
