"""Which rollout kind a config chooses, read from the config alone (the plan, validation and the driver ask this;
``vlmrl.workflows`` builds the kind)."""

from __future__ import annotations

from vlmrl.config.schema import RolloutConfig


def workflow_name(rollout: RolloutConfig) -> str:
    """The kind the config chooses: ``worker.rollout.workflow``, or the kind an older switch turns on
    (``agent=...`` is ``openai_agent``, ``multi_turn.enable=true`` is ``multi_turn``; validation refuses a
    ``workflow`` that says otherwise)."""
    if rollout.agent:
        return "openai_agent"
    if rollout.multi_turn.enable:
        return "multi_turn"
    return rollout.workflow

