"""What every rollout kind is to the rest of vlmrl: prompts in, trajectories and typed stats out.

A rollout kind is chosen once, by ``vlmrl.workflows.build``, from the config:
the built-in ``single_turn``, ``multi_turn`` and ``openai_agent``, or a user's
workflow class (``vlmrl.rollout.workflow``). The rollout worker calls
``rollout``; the driver reads the kind's declared properties (``credit``,
``variable_rows``) from its class, never the config flags that chose it.
"""

from __future__ import annotations

import enum
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

from vlmrl.records import PromptSample, Trajectory
from vlmrl.rollout.engine import Sampling


class Credit(enum.Enum):
    """Over what the advantage's group baseline counts."""

    per_row = "per_row"
    """Each trajectory is a sample of its prompt's group."""
    per_rollout = "per_rollout"
    """A rollout may make several rows (an agent's calls): the group's samples are rollouts, and every row of a
    rollout gets the rollout's advantage."""


@dataclass
class RolloutStats:
    """What one rollout call reports besides its trajectories."""

    seconds: dict[str, float] = field(default_factory=dict)
    """The call's pieces (``engine``, ``tools``, ...): logged as ``timing_s/gen/<piece>``, the slowest worker's."""
    counts: dict[str, float] = field(default_factory=dict)
    """Metric key -> count (``agent/rollouts/ok``, ``workflow/dropped``, ...); counts add up over workers."""

    def add_counts(self, other: RolloutStats) -> None:
        for key, value in other.counts.items():
            self.counts[key] = self.counts.get(key, 0.0) + value


class RolloutKind(ABC):
    """A way of turning prompts into trajectories on one engine."""

    name: ClassVar[str] = ""
    credit: ClassVar[Credit] = Credit.per_row
    variable_rows: ClassVar[bool] = False
    """Whether a prompt may give other than n rows (rows dropped, or several rows per rollout). The step then
    computes advantages over what came back and trims the rows to whole mini-batches."""
    serves_between_steps: ClassVar[bool] = False
    """Whether the engine also serves requests between the steps' rollouts (an agent endpoint): weight loads
    then pause it (``paused``)."""

    @abstractmethod
    def rollout(
        self, prompts: list[PromptSample], group_ids: list[int], sampling: Sampling
    ) -> tuple[list[Trajectory], RolloutStats]:
        """``sampling.n`` samples per prompt (as trajectories, in prompt order) and the call's stats."""

    @property
    def paused(self) -> threading.Event | None:
        """Set while weights load, when the engine serves between steps (``serves_between_steps``)."""
        return None

    def close(self) -> None:
        """Stop what the kind started (processes, servers)."""
