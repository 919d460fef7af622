"""What a run reads from outside its config: data, model and template paths, the reward function, the
checkpoint to resume from, and the packages of the loggers it names.

These checks look at the disk and at what is importable; they are still quick
(no model or data is read), so they run with the rest before Ray starts.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from vlmrl.config import Config, LoggerName, RewardConfig, TrainerConfig
from vlmrl.loggers.tracking import PACKAGES
from vlmrl.plan import ModelKindError, is_hub_id, model_kind, uses_critic
from vlmrl.reward.function import RewardFunctionError
from vlmrl.reward.model_reward import reward_spec
from vlmrl.reward.sandbox import check_loads
from vlmrl.user_code import resolved_from
from vlmrl.user_process import ENV_NAME, MARKER

__all__ = ["checkpoint_problems", "logger_problems", "model_problems", "path_problems", "reward_problems"]


def path_problems(config: Config, pending: tuple[str, ...] = ()) -> list[str]:
    """``pending``: directories built before the run starts (``${tiny:...}`` assets); paths under them count as there."""

    def missing(path: str) -> bool:
        return not Path(path).exists() and not any(path.startswith(root) for root in pending)

    problems = []
    data, model = config.data, config.worker.actor.model
    if not data.train_files:
        problems.append(
            "data.train_files is empty: set it to a parquet/json/jsonl file"
        )
    for key, files in (
        ("data.train_files", data.train_files),
        ("data.val_files", data.val_files),
    ):
        for f in filter(None, (s.strip() for s in files.split(","))):
            if "@" not in f and missing(f):
                problems.append(f"{key}: {f} does not exist{resolved_from(f)}")
    if not model.model_path:
        problems.append(
            "worker.actor.model.model_path is empty: set it to a local HF model directory or a Hub id"
        )
    elif missing(model.model_path) and not is_hub_id(model.model_path):
        problems.append(
            f"worker.actor.model.model_path: {model.model_path} does not exist{resolved_from(model.model_path)}"
        )
    optional_paths = [
        ("worker.actor.model.tokenizer_path", model.tokenizer_path, True),
        ("data.format_prompt", data.format_prompt, False),
        ("data.image_dir", data.image_dir, False),
    ]
    if uses_critic(config):
        optional_paths.append(
            (
                "worker.critic.model.model_path",
                config.worker.critic.model.model_path,
                True,
            )
        )
    for key, path, hub_ok in optional_paths:
        if path and missing(path) and not (hub_ok and is_hub_id(path)):
            problems.append(f"{key}: {path} does not exist{resolved_from(path)}")
    problems.extend(reward_problems(config.worker.reward, agent=config.worker.rollout.agent))
    return problems


def model_problems(config: Config) -> list[str]:
    """The kind of each local model (vision-language or text, from its config.json) and what it allows.

    Hub ids are left to the workers, which read the Hub's config with the same rule.
    """
    problems = []
    actor = config.worker.actor.model
    paths = [("worker.actor.model.model_path", actor.model_path)]
    if uses_critic(config) and config.worker.critic.model.model_path:
        paths.append(("worker.critic.model.model_path", config.worker.critic.model.model_path))
    kinds = {}
    for key, path in paths:
        if not path or not Path(path).is_dir():
            continue  # reported by path_problems, or a Hub id
        try:
            kinds[key] = model_kind(path)
        except ModelKindError as e:
            problems.append(f"{key}: {e}")
    sections = [("worker.actor", actor)] + ([("worker.critic", config.worker.critic.model)] if uses_critic(config) else [])
    for section, model in sections:
        path = model.model_path or actor.model_path
        config_file = Path(path) / "config.json" if path else None
        if not model.override_config or config_file is None or not config_file.is_file():
            continue
        model_config = json.loads(config_file.read_text())
        entries = set(model_config) | set(model_config.get("text_config") or {})
        for key in model.override_config:
            if key not in entries:
                problems.append(
                    f"{section}.model.override_config.{key}: {config_file} has no entry {key!r} (nor its "
                    "text_config); override an entry the model's config has"
                )
    actor_kind = kinds.get("worker.actor.model.model_path")
    if actor_kind == "text" and actor.freeze_vision_tower:
        problems.append(
            f"worker.actor.model.freeze_vision_tower=true but {actor.model_path} is a text-only model (no "
            "vision_config): it has no vision tower; set worker.actor.model.freeze_vision_tower=false"
        )
    critic_kind = kinds.get("worker.critic.model.model_path")
    if actor_kind == "vision_language" and critic_kind == "text":
        problems.append(
            f"worker.critic.model.model_path={config.worker.critic.model.model_path} is a text-only model but the "
            "actor is a vision-language model: the critic must read the same images; give the critic a "
            "vision-language model (or leave its model_path empty to start from the actor's)"
        )
    return problems


def reward_problems(reward: RewardConfig, agent: str | None = None) -> list[str]:
    """The reward function must load here (file, function, imports, REWARD_TYPE) before any actor starts.

    With an external ``agent`` it may be unset: the agent then returns every rollout's reward, and a rollout it
    returns None for fails its step, naming the rollout (``vlmrl.driver.scoring.Scorer.launch``).
    """
    problems = env_problems(reward.env)
    model = reward.reward_model
    spec = reward_spec(reward.reward_function, model.model_path)
    if not spec and not agent:
        problems.append(
            "worker.reward.reward_function is empty: set it to path/to/file.py:function, or set "
            "worker.reward.reward_model.model_path to reward with a model's score (or, with worker.rollout.agent, "
            "have the agent return each rollout's reward)"
        )
    elif spec:  # unset with an agent: every reward comes from the agent
        try:
            # In a reward process, as a run loads it: a module that exits or crashes at import ends that process.
            kind = model.kind.value if model.model_path else None
            env = dict(reward.env) if not problems else {}
            check_loads(spec, reward.reward_function_kwargs, reward.memory_limit_mb, kind, env)
        except RewardFunctionError as e:
            problems.append(str(e))
    if reward.num_cpus < 1:
        problems.append(f"worker.reward.num_cpus={reward.num_cpus}: must be at least 1")
    if reward.num_workers is not None and reward.num_workers < 1:
        problems.append(
            f"worker.reward.num_workers={reward.num_workers}: must be at least 1 (one reward actor scores one batch "
            "at a time), or null for 1 (with async_rl, max_head_offpolicyness + 1)"
        )
    if reward.timeout is not None and not reward.timeout > 0:
        problems.append(
            f"worker.reward.timeout={reward.timeout}: must be a positive number of seconds, or null for no limit"
        )
    if reward.memory_limit_mb is not None and reward.memory_limit_mb < 256:
        problems.append(
            f"worker.reward.memory_limit_mb={reward.memory_limit_mb}: must be at least 256 (Python itself needs "
            "about 100 MB of address space), or null for no limit"
        )
    return problems



def env_problems(env: dict[str, str]) -> list[str]:
    """worker.reward.env: names a process environment can hold, values that are text, not the sandbox's marker."""
    problems = []
    for name, value in env.items():
        if not isinstance(name, str) or not ENV_NAME.fullmatch(name):
            problems.append(
                f"worker.reward.env: {name!r} is not an environment variable name (letters, digits and _, not "
                "starting with a digit); rename it"
            )
        elif name == MARKER:
            problems.append(f"worker.reward.env.{name}: is set by vlmrl itself for every reward process; remove it")
        elif not isinstance(value, (str, int, float)) or "\0" in str(value):
            problems.append(
                f"worker.reward.env.{name}: must be text without NUL characters (the value is not shown: it may be a "
                "secret); give a string, or remove the key"
            )
    return problems


def checkpoint_problems(trainer: TrainerConfig) -> list[str]:
    problems = []
    if trainer.save_freq == 0 or trainer.save_freq < -1:
        problems.append(
            f"trainer.save_freq={trainer.save_freq}: must be at least 1, or -1 to save only at the end"
        )
    if trainer.save_every_minutes is not None and not trainer.save_every_minutes > 0:  # NaN fails too
        problems.append(
            f"trainer.save_every_minutes={trainer.save_every_minutes}: must be a positive number of minutes, or null "
            "to save only by trainer.save_freq and at the end"
        )
    if trainer.save_limit == 0 or trainer.save_limit < -1:
        problems.append(
            f"trainer.save_limit={trainer.save_limit}: must be at least 1, or -1 to keep every checkpoint"
        )
    if trainer.load_checkpoint_path:
        ckpt = Path(trainer.load_checkpoint_path)
        if not (ckpt / "COMPLETE").is_file():
            problems.append(
                f"trainer.load_checkpoint_path={ckpt}: not a complete checkpoint (no COMPLETE marker); "
                "point it at a global_step_<k> directory that a finished save wrote"
            )
    dump = Path(trainer.rollout_data_dir) if trainer.rollout_data_dir else None
    if dump is not None and dump.exists() and not dump.is_dir():
        problems.append(
            f"trainer.rollout_data_dir: {dump} is a file, not a directory{resolved_from(dump)}; name a directory "
            "for the step_<k>.jsonl files, or null to write none"
        )
    return problems


def logger_problems(names: list[LoggerName]) -> list[str]:
    """What is wrong with a ``trainer.logger`` list: repeated names and loggers whose package is missing."""
    problems = []
    repeated = sorted({n.value for n in names if names.count(n) > 1})
    if repeated:
        problems.append(f"trainer.logger names {', '.join(repeated)} more than once; list each logger once")
    for name in dict.fromkeys(names):
        package = PACKAGES.get(name)
        # find_spec only looks the package up: a missing one is reported without importing any.
        if package and importlib.util.find_spec(package) is None:
            problems.append(
                f"trainer.logger: {name.value} needs the {package} package, which is not installed; "
                f"`pip install {package}` or remove {name.value} from trainer.logger"
            )
    return problems
