"""Rewards per rollout when an external agent's rollout spans several rows (``worker.rollout.agent``).

A rollout is scored once: by the reward its agent returned, or else by the
reward function on its last row, whose response is the rollout's final answer
(the last call's). The score then goes to every row of the rollout, since
rows of one rollout must share their reward (``algos.rollout_advantages``
checks it). The step's reward metrics are means over rollouts, not rows, so
a rollout split into three rows counts once there too.

The reward function's sub-scores exist only for the rollouts it scored; an
agent-scored rollout has NaN there, which the means leave out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from vlmrl.records import Trajectory


@dataclass(frozen=True)
class RolloutScoring:
    """Which rows the reward function scores, and how the scores go back to every row."""

    rollout_of_row: list[int]
    """Each row's rollout, as its index in ``last_rows``."""
    last_rows: list[int]
    """Each rollout's last row (rollouts in first-seen order)."""
    agent_rewards: list[float | None]
    """Each rollout's reward from its agent, or None."""

    @classmethod
    def of(cls, trajectories: list[Trajectory]) -> RolloutScoring:
        position: dict[str, int] = {}
        rollout_of_row, last_rows, agent_rewards = [], [], []
        for row, t in enumerate(trajectories):
            r = position.setdefault(t.rollout, len(last_rows))
            if r == len(last_rows):
                last_rows.append(row)
                agent_rewards.append(t.agent_reward)
            elif t.agent_reward != agent_rewards[r]:
                raise ValueError(
                    f"rollout {t.rollout}: row {row} carries agent reward {t.agent_reward} but an earlier row "
                    f"carries {agent_rewards[r]}; the rows of a rollout share one reward"
                )
            last_rows[r] = row
            rollout_of_row.append(r)
        return cls(rollout_of_row, last_rows, agent_rewards)

    @property
    def rows_to_score(self) -> list[int]:
        """The rows the reward function scores: the last row of each rollout whose agent returned no reward."""
        return [row for row, reward in zip(self.last_rows, self.agent_rewards) if reward is None]

    def per_rollout(self, scored: dict[str, list[float]]) -> dict[str, list[float]]:
        """Each score per rollout: ``scored`` holds one value per row of ``rows_to_score``, in that order."""
        out: dict[str, list[float]] = {"overall": []}
        out.update({name: [] for name in scored if name != "overall"})
        values = iter(range(len(self.rows_to_score)))
        for reward in self.agent_rewards:
            k = next(values) if reward is None else None
            for name, column in out.items():
                if k is not None:
                    column.append(float(scored[name][k]))
                else:
                    column.append(float(reward) if name == "overall" else math.nan)
        return out

    def per_row(self, per_rollout: dict[str, list[float]]) -> dict[str, list[float]]:
        """Each rollout's scores repeated on every one of its rows."""
        return {name: [values[r] for r in self.rollout_of_row] for name, values in per_rollout.items()}
