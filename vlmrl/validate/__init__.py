"""The rules a configuration must follow, checked in full before Ray starts or any model is read.

``load_config`` parses the arguments against the schema (``vlmrl.config``)
and then runs every rule here, so one call reports every problem at once:
unknown keys and bad values, and broken invariants, each naming its key and
value, the rule it breaks and the fix. Keys for features vlmrl does not have
yet are accepted by the schema; where ignoring them would change what trains
or how much memory it takes, a rule says so and names the setting to use
instead (where they only change speed, the plan carries a note).

The rules are grouped by what they look at:

* ``files``: what the run reads from outside the config (paths, the reward
  function, the checkpoint to resume, the loggers' packages);
* ``numbers``: single values and batch arithmetic;
* ``features``: settings that must agree with each other, the devices, and
  what vlmrl does not support yet;
* ``models``: the model's family (its ``model_type``) has an adapter.
"""

from __future__ import annotations

from collections.abc import Callable

from vlmrl.config import Config, ConfigError
from vlmrl.config.loading import parse
from vlmrl.plan import Cluster, detect_cluster
from vlmrl.validate.agents import external_agent_problems, multi_turn_problems
from vlmrl.validate.workflow import workflow_problems
from vlmrl.validate.async_rl import async_problems
from vlmrl.validate.reward_model import reward_model_problems
from vlmrl.validate.rollout_correction import rollout_correction_problems
from vlmrl.validate.distillation import distillation_problems
from vlmrl.validate.normalisation import normalisation_problems
from vlmrl.validate.features import (
    device_problems,
    estimator_problems,
    kl_problems,
    lora_problems,
    loss_mode_problems,
    not_supported_yet,
    proximal_problems,
)
from vlmrl.validate.files import checkpoint_problems, logger_problems, model_problems, path_problems
from vlmrl.validate.models import family_problems
from vlmrl.validate.numbers import batch_problems, range_problems, schedule_problems, validation_problems

__all__ = ["load_config", "logger_problems", "validate"]


def load_config(
    cli_args: list[str],
    cluster: Cluster | None = None,
    pending: Callable[[], tuple[str, ...]] | None = None,
    base: dict | None = None,
) -> Config:
    """Build the config from ``config=<yaml>`` and ``key=value`` arguments and validate it.

    ``cluster`` is what the machine offers (``vlmrl.plan.detect_cluster()`` when
    not given). Raises ConfigError listing every problem found: unknown keys,
    wrong types and values, and broken invariants, all at once. ``pending``,
    asked once the arguments are parsed, gives the directories the run builds
    before it starts (``vlmrl.testing.resolvers.TinyResolver.pending``): paths
    under them count as there and are not read. ``base``: a config tree as a mapping, in place of a YAML file.
    """
    config, problems = parse(cli_args, base)
    problems.extend(validate(config, cluster, pending() if pending is not None else ()))
    if problems:
        raise ConfigError(problems)
    return config


def validate(config: Config, cluster: Cluster | None = None, pending: tuple[str, ...] = ()) -> list[str]:
    """Check every invariant that needs neither Ray nor a model; return all problems.

    ``cluster`` is what the machine offers (detected when not given). Each
    problem names its key and value, the rule it breaks and the fix. Paths
    under a ``pending`` directory (built before the run starts) count as there.
    """
    cluster = detect_cluster() if cluster is None else cluster
    # The order is the order problems are listed in.
    return [
        *path_problems(config, pending),
        *model_problems(config),
        *family_problems(config, cluster),
        *range_problems(config),
        *batch_problems(config),
        *schedule_problems(config),
        *kl_problems(config.algorithm),
        *estimator_problems(config),
        *normalisation_problems(config),
        *rollout_correction_problems(config),
        *distillation_problems(config, pending),
        *loss_mode_problems(config),
        *proximal_problems(config),
        *lora_problems(config),
        *device_problems(config, cluster),
        *validation_problems(config),
        *workflow_problems(config),
        *multi_turn_problems(config),
        *external_agent_problems(config),
        *async_problems(config),
        *reward_model_problems(config, cluster, pending),
        *checkpoint_problems(config.trainer),
        *logger_problems(config.trainer.logger),
        *not_supported_yet(config, cluster),
    ]
