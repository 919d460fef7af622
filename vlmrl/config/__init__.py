"""The run configuration: a typed schema with EasyR1's key names, and how a run's arguments become one.

The package is split by job:

* ``options``: the enums of the config's fields (dtypes, devices, reward and
  logger names...); the maths' enums (estimators, losses, KL) are ``vlmrl.algos``'.
* ``schema``: the dataclasses, one per section, each field with its help text.
* ``loading``: YAML and ``key=value`` overrides merged and checked against the
  schema (``parse_config``), and the config back as plain data (``to_dict``).
* ``help``: the ``--help`` text, read from the schema's attribute docstrings.
* ``errors``: ``ConfigError``, which lists every problem found at once.

The rules between values (batch sizes that divide, paths that exist, a reward
function that loads) are not here but in ``vlmrl.validate``, and the values
derived from a config are ``vlmrl.plan``'s; this package imports nothing of
vlmrl but the maths' enums.

The names are loaded on first use, so that ``vlmrl.config.options`` and
``ConfigError`` cost no torch import (the reward processes read the reward
enums); ``from vlmrl.config import Config`` works as with a plain module.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from vlmrl.config.errors import ConfigError
from vlmrl.config.options import (
    AgentFailurePolicy,
    AsyncPlacement,
    BadSamplePolicy,
    ConsumeOrder,
    Device,
    DType,
    LoggerName,
    LRSchedulerType,
    ModelKind,
    OldLogProbPass,
    JudgeParse,
    OptimizerStrategy,
    PartialRollout,
    RewardManagerType,
    RewardModelKind,
    RewardModelPlacement,
    RolloutName,
    StalePolicy,
    Strategy,
    TimeoutPolicy,
    WeightTransfer,
)

if TYPE_CHECKING:
    from vlmrl.config.help import field_docs, help_text, iter_options
    from vlmrl.config.loading import parse, parse_config, to_dict
    from vlmrl.config.schema import (
        DERIVED_KEYS,
        RENAMED_KEYS,
        ActorConfig,
        AlgorithmConfig,
        Config,
        CriticConfig,
        DataConfig,
        DistillationConfig,
        FSDPConfig,
        LoraConfig,
        ModelConfig,
        OffloadConfig,
        OptimConfig,
        RefConfig,
        RewardConfig,
        RewardModelConfig,
        AgentHooksConfig,
        AsyncConfig,
        AgentOptionsConfig,
        MultiTurnConfig,
        RolloutConfig,
        RolloutCorrectionConfig,
        TrainerConfig,
        ValOverrideConfig,
        WorkerConfig,
    )

_SCHEMA = (
    "DERIVED_KEYS",
    "RENAMED_KEYS",
    "ActorConfig",
    "AlgorithmConfig",
    "Config",
    "CriticConfig",
    "DataConfig",
    "DistillationConfig",
    "FSDPConfig",
    "LoraConfig",
    "ModelConfig",
    "OffloadConfig",
    "OptimConfig",
    "RefConfig",
    "RewardConfig",
    "RewardModelConfig",
    "AgentHooksConfig",
    "AsyncConfig",
    "AgentOptionsConfig",
    "MultiTurnConfig",
    "RolloutConfig",
    "RolloutCorrectionConfig",
    "TrainerConfig",
    "ValOverrideConfig",
    "WorkerConfig",
)
_LAZY: dict[str, str] = {
    **{name: "vlmrl.config.schema" for name in _SCHEMA},
    **{name: "vlmrl.config.loading" for name in ("parse", "parse_config", "to_dict")},
    **{name: "vlmrl.config.help" for name in ("field_docs", "help_text", "iter_options")},
}

__all__ = [
    "ActorConfig",
    "AlgorithmConfig",
    "AgentFailurePolicy",
    "AsyncPlacement",
    "BadSamplePolicy",
    "ConsumeOrder",
    "Config",
    "ConfigError",
    "CriticConfig",
    "DERIVED_KEYS",
    "DType",
    "DataConfig",
    "Device",
    "DistillationConfig",
    "FSDPConfig",
    "LRSchedulerType",
    "LoggerName",
    "LoraConfig",
    "ModelConfig",
    "OffloadConfig",
    "ModelKind",
    "OldLogProbPass",
    "OptimConfig",
    "OptimizerStrategy",
    "PartialRollout",
    "RENAMED_KEYS",
    "RefConfig",
    "RewardConfig",
    "RewardManagerType",
    "RewardModelConfig",
    "RewardModelKind",
    "RewardModelPlacement",
    "JudgeParse",
    "AgentHooksConfig",
    "AsyncConfig",
    "AgentOptionsConfig",
    "MultiTurnConfig",
    "RolloutConfig",
    "RolloutCorrectionConfig",
    "RolloutName",
    "StalePolicy",
    "Strategy",
    "TimeoutPolicy",
    "TrainerConfig",
    "ValOverrideConfig",
    "WeightTransfer",
    "WorkerConfig",
    "field_docs",
    "help_text",
    "iter_options",
    "parse",
    "parse_config",
    "to_dict",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))

