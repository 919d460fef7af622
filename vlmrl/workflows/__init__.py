"""The rollout kinds, chosen once from the config: the built-ins and a user's workflow class.

``worker.rollout.workflow`` names the kind: ``single_turn`` (the default),
``multi_turn`` (tools or an environment, ``worker.rollout.multi_turn.*``),
``openai_agent`` (the user's agent over an OpenAI-compatible endpoint,
``worker.rollout.agent``), or ``path/to/file.py:Class``, a workflow written on
``vlmrl.rollout.workflow``. The older switches choose their kind too:
``multi_turn.enable=true`` is ``multi_turn`` and ``agent=...`` is
``openai_agent`` (``workflow_name``).

``build`` makes the kind a rollout worker runs; ``properties`` is what the
driver asks about a kind (its credit, whether a prompt's rows vary) without
building it. A new built-in is one module here with a ``RolloutKind`` subclass
and one line of ``BUILTINS``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from vlmrl.config import Config
from vlmrl.config.kinds import workflow_name  # also vlmrl.workflows.workflow_name, for the validators
from vlmrl.rollout.kind import Credit, RolloutKind
from vlmrl.rollout.workflow import WorkflowRollouts, check_workflow_class
from vlmrl.user_code import load_object

BUILTINS = {
    "single_turn": "vlmrl.workflows.single_turn:SingleTurn",
    "multi_turn": "vlmrl.workflows.multi_turn:MultiTurn",
    "openai_agent": "vlmrl.workflows.openai_agent:OpenAIAgent",
}
"""Built-in name -> its ``RolloutKind`` class, as module:Class."""

KEY = "worker.rollout.workflow"


def is_builtin(name: str) -> bool:
    return name in BUILTINS


def _builtin(name: str) -> type[RolloutKind]:
    module, cls = BUILTINS[name].split(":")
    return getattr(importlib.import_module(module), cls)


def load_workflow_class(spec: str) -> type:
    """The user's workflow class named by ``spec`` (path/to/file.py:Class), checked (``ValueError`` says what is
    wrong, naming the file and the class)."""
    cls = load_object(spec, KEY)
    problems = check_workflow_class(cls, spec)
    if problems:
        raise ValueError("; ".join(problems))
    return cls


@dataclass(frozen=True)
class KindProperties:
    """What the driver asks of the chosen kind."""

    name: str
    credit: Credit
    variable_rows: bool


def properties(config: Config) -> KindProperties:
    """The properties of the kind ``config`` chooses, read from its class (a user workflow class may declare
    its own ``credit``), without building it."""
    name = workflow_name(config.worker.rollout)
    if is_builtin(name):
        cls = _builtin(name)
        return KindProperties(name, cls.credit, cls.variable_rows)
    user = load_workflow_class(name)
    return KindProperties(name, getattr(user, "credit", Credit.per_row), WorkflowRollouts.variable_rows)


def build(config: Config, plan, engine, processor, pad_ids: tuple[int, ...]) -> RolloutKind:
    """The kind a rollout worker runs on ``engine``."""
    name = workflow_name(config.worker.rollout)
    if is_builtin(name):
        return _builtin(name).build(config, plan, engine, processor, pad_ids)
    from vlmrl.workflows.user import build_user_workflow

    return build_user_workflow(config, engine, processor, pad_ids, load_workflow_class(name)(**_kwargs(config)))


def _kwargs(config: Config) -> dict[str, Any]:
    return dict(config.worker.rollout.workflow_kwargs)
