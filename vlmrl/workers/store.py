"""What a worker keeps between the calls of a step: the trajectories it sampled, and the view over them.

The driver never sends a worker what it already holds. A training rollout
leaves its trajectories (pixels included) on the worker that sampled them,
and the driver gets slim copies back; each later pass names its rows by
sample id and sends only the per-token fields the pass needs (advantages,
old and reference log-probs, values, returns: a few floats per token).
A row that the balancer assigns to another worker travels once, in full,
with the first pass that needs it there. ``release`` ends the step.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from vlmrl.records import Batch, Trajectory
from vlmrl.records.views import to_batch

PER_TOKEN_FIELDS = ("old_log_probs", "ref_log_probs", "advantages", "values", "returns")
"""The per-token fields a pass may carry to a worker; each is (b, R) in the view's row order."""


@dataclass
class PassInput:
    """One worker's share of a pass: its rows by id, those it does not hold yet, and per-token fields."""

    sample_ids: list[str]
    new_rows: list[Trajectory] = field(default_factory=list)
    """Full trajectories (pixels included) of the rows among ``sample_ids`` that this worker does not hold."""
    fields: dict[str, torch.Tensor] = field(default_factory=dict)
    """Per-token fields by name (``PER_TOKEN_FIELDS``), rows in ``sample_ids`` order."""

    def __post_init__(self) -> None:
        unknown = set(self.fields) - set(PER_TOKEN_FIELDS)
        if unknown:
            raise ValueError(f"PassInput: unknown per-token fields {sorted(unknown)}; known: {PER_TOKEN_FIELDS}")


class TrajectoryStore:
    def __init__(self, max_prompt_length: int, max_response_length: int, pad_token_id: int):
        self.shape = dict(
            max_prompt_length=max_prompt_length, max_response_length=max_response_length, pad_token_id=pad_token_id
        )
        self.held: dict[str, Trajectory] = {}
        self._view: tuple[tuple[str, ...], Batch] | None = None
        """The last view built, by its row ids: the passes of a step ask for the same rows in the same order."""

    def hold(self, trajectories: list[Trajectory]) -> None:
        """Keep ``trajectories``; one under an id already held replaces it (the view is then rebuilt)."""
        if trajectories:
            self.held.update((t.sample_id, t) for t in trajectories)
            self._view = None

    def release(self) -> None:
        self.held.clear()
        self._view = None

    def batch(self, request: PassInput) -> Batch:
        """The padded view of the requested rows with the request's per-token fields set."""
        self.hold(request.new_rows)
        ids = tuple(request.sample_ids)
        if self._view is None or self._view[0] != ids:
            missing = [i for i in ids if i not in self.held]
            if missing:
                raise KeyError(f"rows {missing[:5]} ({len(missing)} in all) were neither held nor sent")
            self._view = (ids, to_batch([self.held[i] for i in ids], **self.shape))
        # A fresh Batch over the cached tensors, so one pass's fields never leak into the next.
        return dataclasses.replace(self._view[1], **{name: request.fields.get(name) for name in PER_TOKEN_FIELDS})
