"""The run configuration: a typed schema with EasyR1's key names.

Loading merges three layers: the dataclass defaults, then a YAML file, then
``key=value`` overrides from the command line. The merge is done on plain
dictionaries and then checked field by field against the schema, so that one
run reports every unknown key, wrong type and invalid enum value at once
(OmegaConf's structured merge stops at the first). Enum fields take the
enum's value as a string, so ``algorithm.adv_estimator=grpo`` in YAML or on
the CLI becomes ``AdvantageEstimator.grpo``.

The loaded config is frozen in spirit: nothing downstream writes into it.
Values that follow from it (batch sizes per worker, steps per epoch) come from
``vlmrl.plan.resolve``.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from vlmrl.data.options import BadSamplePolicy
from vlmrl.plan import world_size
from vlmrl.reward.function import RewardFunctionError, load_reward_function
from vlmrl.reward.options import RewardManagerType, TimeoutPolicy
from vlmrl.trainer.core_algos import AdvantageEstimator, KLEstimator, LossAvgMode
from vlmrl.trainer.tracking import LoggerName, logger_problems


class ConfigError(ValueError):
    """Every problem found in a configuration, one per line, each with its fix."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__(
            f"{len(problems)} problem(s) in the configuration:\n" + "\n".join(f"  - {p}" for p in problems)
        )


class DType(str, enum.Enum):
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


@dataclass
class DataConfig:
    train_files: str = ""
    """Training data: a local parquet/json/jsonl file, several separated by commas."""
    val_files: str = ""
    """Validation data, same forms as train_files."""
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    image_key: str = "images"
    image_dir: str | None = None
    """Directory that relative image paths in the data are resolved against."""
    max_prompt_length: int = 512
    """Longest prompt in tokens, image tokens included."""
    max_response_length: int = 512
    rollout_batch_size: int = 512
    """Prompts per training step; each is sampled worker.rollout.n times."""
    val_batch_size: int = -1
    """Prompts per validation batch; -1 takes the whole validation set at once."""
    format_prompt: str | None = None
    """Path to a jinja template that renders the prompt text as {{ content }}."""
    override_chat_template: str | None = None
    shuffle: bool = True
    seed: int = 1
    min_pixels: int = 262144
    max_pixels: int = 4194304
    filter_overlong_prompts: bool = True
    video_key: str = "videos"
    """Column of a row's videos: a video file, or a list of videos, each a file or a list of frames."""
    video_fps: float = 2.0
    """Frames per second sampled from each video file."""
    filter_overlong_prompts_workers: int = 1
    """Processes that check the rows (length after image and video tokens, readability) at start-up."""
    on_bad_sample: BadSamplePolicy = BadSamplePolicy.error
    """vlmrl addition: a row that cannot be used (unreadable image or video, placeholder count that does
    not match, empty prompt, missing answer) stops the run (error), or is left out, counted and logged
    with its file and row (skip)."""


@dataclass
class AlgorithmConfig:
    gamma: float = 1.0
    lam: float = 1.0
    adv_estimator: AdvantageEstimator = AdvantageEstimator.grpo
    norm_adv_by_std_in_grpo: bool = True
    """Divide GRPO advantages by the group's std; false gives Dr.GRPO."""
    disable_kl: bool = False
    use_kl_loss: bool = True
    """KL to the reference model as a loss term (GRPO) rather than a reward penalty."""
    kl_penalty: KLEstimator = KLEstimator.low_var_kl
    kl_coef: float = 1e-2


@dataclass
class ModelConfig:
    model_path: str = ""
    tokenizer_path: str | None = None
    trust_remote_code: bool = False
    enable_gradient_checkpointing: bool = False
    freeze_vision_tower: bool = False


@dataclass
class OptimConfig:
    lr: float = 1e-6
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    weight_decay: float = 1e-2
    lr_warmup_ratio: float = 0.0


@dataclass
class FSDPConfig:
    torch_dtype: DType = DType.bfloat16
    """Dtype of the actor and reference weights; float32 on CPU."""


@dataclass
class ActorConfig:
    global_batch_size: int = 128
    """Prompts per policy update (mini-batch); each carries its n samples."""
    micro_batch_size_per_device_for_update: int = 4
    micro_batch_size_per_device_for_experience: int = 16
    max_grad_norm: float = 1.0
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.3
    clip_ratio_dual: float = 3.0
    loss_avg_mode: LossAvgMode = LossAvgMode.token_mean
    ppo_epochs: int = 1
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)


@dataclass
class RolloutConfig:
    n: int = 5
    """Samples per prompt (the GRPO group size)."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int = 1
    dtype: DType = DType.bfloat16
    gpu_memory_utilization: float = 0.6
    enforce_eager: bool = False
    ignore_eos: bool = False
    """Training rollouts always run to max_response_length (validation still stops at EOS)."""
    max_num_batched_tokens: int = 8192
    cpu_kvcache_space_gb: int = 1
    """KV cache of the vLLM CPU backend, in GiB (VLLM_CPU_KVCACHE_SPACE)."""
    val_override_config: dict[str, Any] = field(default_factory=dict)
    """Sampling at validation: one greedy sample per prompt, with these keys
    (temperature, top_p, top_k, n) overriding that."""


@dataclass
class RewardConfig:
    reward_type: RewardManagerType | None = None
    """sequential or batch; unset takes the function's or its module's REWARD_TYPE."""
    reward_function: str = ""
    """path/to/file.py:function or package.module:function."""
    reward_function_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of every call of the reward function."""
    num_cpus: int = 1
    """CPUs reserved for each reward actor (one for training, one for validation); a
    sequential function is scored in this many processes in parallel."""
    timeout: float | None = 300.0
    """vlmrl addition: seconds one call of the reward function may take (one response for a
    sequential function, the step's whole batch for a batch function); null for no limit."""
    on_timeout: TimeoutPolicy = TimeoutPolicy.error
    """vlmrl addition: a call past the timeout fails the step (error), or scores 0 and is
    counted in reward/timeouts (zero)."""


@dataclass
class WorkerConfig:
    actor: ActorConfig = field(default_factory=ActorConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)


@dataclass
class TrainerConfig:
    total_epochs: int = 15
    max_steps: int | None = None
    """Stop after this many steps even if epochs remain."""
    project_name: str = "vlmrl"
    experiment_name: str = "default"
    logger: list[LoggerName] = field(
        default_factory=lambda: [LoggerName.console, LoggerName.file, LoggerName.mlflow]
    )
    """Where metrics and validation samples go: console, file, mlflow, tensorboard, wandb, swanlab."""
    output_dir: str = "outputs"
    """Experiment directory root: <output_dir>/<project_name>/<experiment_name>/."""
    val_freq: int = -1
    """Validate every this many steps; -1 validates only at the end."""
    val_before_train: bool = False
    """Validate once before the first step (logged as step 0)."""
    val_only: bool = False
    """Run validation once (on the resumed checkpoint, or the base model) and exit."""
    val_generations_to_log: int = 0
    """Validation samples (prompt, images, response, scores) sent to the loggers at each validation."""
    save_freq: int = -1
    """Save a checkpoint every this many steps; -1 saves only at the end (and on SIGTERM/SIGINT)."""
    save_limit: int = -1
    """Keep only the newest this many complete checkpoints; -1 keeps all."""
    save_model_only: bool = False
    """Save the actor's weights without the optimizer state."""
    save_checkpoint_path: str | None = None
    """Checkpoint directory; defaults to <experiment dir>/checkpoints."""
    load_checkpoint_path: str | None = None
    """Resume from this global_step_<k> directory."""
    find_last_checkpoint: bool = True
    """Without load_checkpoint_path, resume from the newest complete checkpoint in the checkpoint directory."""
    save_hf_weights: bool = True
    """vlmrl addition: the final checkpoint also holds the actor as a HF model directory (actor/huggingface)."""
    n_gpus_per_node: int = 1
    """Workers per node (CPU workers on CPU-only machines)."""
    nnodes: int = 1


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)


# ---------------------------------------------------------------- loading


def _tiny_asset(name: str) -> str:
    """``${tiny:model_dir}`` / ``${tiny:train_file}`` / ``${tiny:val_file}`` in a YAML.

    Builds the tiny random Qwen2.5-VL and its synthetic data on first use (into
    $VLMRL_CACHE_DIR or <repo>/.cache/vlmrl), so the CPU quickstart runs on a
    machine with no model hub.
    """
    from vlmrl.testing.assets import TinyAssets, ensure_tiny_assets

    fields = [f.name for f in dataclasses.fields(TinyAssets)]
    if name not in fields:
        raise ConfigError([f"${{tiny:{name}}}: unknown tiny asset; choose one of: {', '.join(fields)}"])
    return str(getattr(ensure_tiny_assets(), name))


OmegaConf.register_resolver("tiny", _tiny_asset, replace=True)


def load_config(cli_args: list[str]) -> Config:
    """Build the config from ``config=<yaml>`` and ``key=value`` arguments.

    Raises ConfigError listing every problem found.
    """
    yaml_path = None
    overrides = []
    for arg in cli_args:
        if arg.startswith("config="):
            yaml_path = arg.split("=", 1)[1]
        else:
            overrides.append(arg)
    problems: list[str] = []
    for arg in overrides:
        if "=" not in arg:
            problems.append(f"command-line argument {arg!r}: expected key=value (for example trainer.max_steps=3)")
    if yaml_path is not None and not Path(yaml_path).is_file():
        raise ConfigError([f"config={yaml_path}: no such file", *problems])
    try:
        merged = OmegaConf.load(yaml_path) if yaml_path is not None else OmegaConf.create({})
        merged = OmegaConf.merge(merged, OmegaConf.from_dotlist([a for a in overrides if "=" in a]))
        raw = OmegaConf.to_container(merged, resolve=True)
    except ConfigError:
        raise
    except (yaml.YAMLError, OmegaConfBaseException, TypeError, ValueError) as e:
        if isinstance(e.__cause__, ConfigError):
            raise ConfigError(e.__cause__.problems + problems) from e
        where = f"config={yaml_path} or the command line" if yaml_path else "the command line"
        raise ConfigError([f"{where}: {type(e).__name__}: {e}".strip(), *problems]) from e
    config = _build(Config, raw or {}, "", problems)
    problems.extend(validate(config))
    if problems:
        raise ConfigError(problems)
    return config


def _build(cls: type, raw: Any, prefix: str, problems: list[str]) -> Any:
    """Convert a plain dict into dataclass ``cls``, recording problems instead of raising."""
    if not isinstance(raw, dict):
        problems.append(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {raw!r}")
        return cls()
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in raw.items():
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            fix = f"did you mean {prefix}{close[0]}?" if close else f"valid keys: {', '.join(names)}"
            problems.append(f"{prefix}{key}: unknown key; {fix}")
            continue
        kwargs[key] = _convert(hints[key], value, f"{prefix}{key}", problems)
    return cls(**{k: v for k, v in kwargs.items() if v is not _INVALID})


_INVALID = object()


def _convert(tp: Any, value: Any, key: str, problems: list[str]) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _convert(inner, value, key, problems)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, key + ".", problems)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(value)
        except ValueError:
            valid = ", ".join(m.value for m in tp)
            problems.append(f"{key}={value!r}: not a valid option; choose one of: {valid}")
            return _INVALID
    if origin is list:
        if not isinstance(value, list):
            problems.append(f"{key}: expected a list, got {value!r}")
            return _INVALID
        converted = [_convert(args[0], v, f"{key}[{i}]", problems) for i, v in enumerate(value)]
        return _INVALID if _INVALID in converted else converted
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            problems.append(f"{key}: expected a list of {len(args)} values, got {value!r}")
            return _INVALID
        return tuple(_convert(a, v, key, problems) for a, v in zip(args, value))
    if origin is dict:
        if not isinstance(value, dict):
            problems.append(f"{key}: expected a mapping, got {value!r}")
            return _INVALID
        return value
    if tp is Any:
        return value
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is bool and not isinstance(value, bool):
        problems.append(f"{key}={value!r}: expected true or false")
        return _INVALID
    if tp is int and (isinstance(value, bool) or not isinstance(value, int)):
        problems.append(f"{key}={value!r}: expected an integer")
        return _INVALID
    if tp is str and value is None:
        # `key=` on the command line and `key: null` in YAML both mean "empty".
        return ""
    if tp is str and not isinstance(value, str):
        # YAML reads `experiment_name: 1` as an int; a string field takes it as text.
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        problems.append(f"{key}={value!r}: expected a string")
        return _INVALID
    if tp is float and not isinstance(value, float):
        problems.append(f"{key}={value!r}: expected a number")
        return _INVALID
    return value


# ------------------------------------------------------------- validation

VAL_OVERRIDE_KEYS = {"temperature", "top_p", "top_k", "n"}


def validate(config: Config) -> list[str]:
    """Check every invariant that does not need Ray or a model; return all problems."""
    problems = []
    data, actor, rollout = config.data, config.worker.actor, config.worker.rollout
    if not data.train_files:
        problems.append("data.train_files is empty: set it to a parquet/json/jsonl file")
    for key, files in (("data.train_files", data.train_files), ("data.val_files", data.val_files)):
        for f in filter(None, (s.strip() for s in files.split(","))):
            if "@" not in f and not Path(f).exists():
                problems.append(f"{key}: {f} does not exist")
    if not actor.model.model_path:
        problems.append("worker.actor.model.model_path is empty: set it to a local HF model directory")
    elif not Path(actor.model.model_path).exists():
        problems.append(f"worker.actor.model.model_path: {actor.model.model_path} does not exist")
    problems.extend(_reward_problems(config.worker.reward))
    if data.format_prompt and not Path(data.format_prompt).is_file():
        problems.append(f"data.format_prompt: {data.format_prompt} does not exist")
    for key, value in (
        ("data.rollout_batch_size", data.rollout_batch_size),
        ("data.max_prompt_length", data.max_prompt_length),
        ("data.max_response_length", data.max_response_length),
        ("worker.rollout.n", rollout.n),
        ("worker.actor.global_batch_size", actor.global_batch_size),
        ("worker.actor.micro_batch_size_per_device_for_update", actor.micro_batch_size_per_device_for_update),
        ("worker.actor.micro_batch_size_per_device_for_experience", actor.micro_batch_size_per_device_for_experience),
        ("worker.actor.ppo_epochs", actor.ppo_epochs),
        ("trainer.total_epochs", config.trainer.total_epochs),
        ("trainer.n_gpus_per_node", config.trainer.n_gpus_per_node),
        ("trainer.nnodes", config.trainer.nnodes),
    ):
        if value < 1:
            problems.append(f"{key}={value}: must be at least 1")
    if data.val_batch_size != -1 and data.val_batch_size < 1:
        problems.append(
            f"data.val_batch_size={data.val_batch_size}: must be at least 1, or -1 for the whole validation set"
        )
    if config.trainer.max_steps is not None and config.trainer.max_steps < 1:
        problems.append(f"trainer.max_steps={config.trainer.max_steps}: must be at least 1, or unset")
    problems.extend(logger_problems(config.trainer.logger))
    problems.extend(_check_validation(config))
    unknown = set(rollout.val_override_config) - VAL_OVERRIDE_KEYS
    if unknown:
        problems.append(
            f"worker.rollout.val_override_config: unknown keys {sorted(unknown)}; "
            f"valid keys: {', '.join(sorted(VAL_OVERRIDE_KEYS))}"
        )
    if len(actor.optim.betas) != 2:
        problems.append(f"worker.actor.optim.betas={actor.optim.betas}: give two numbers, e.g. [0.9, 0.999]")
    if data.min_pixels > data.max_pixels:
        problems.append(f"data.min_pixels={data.min_pixels} > data.max_pixels={data.max_pixels}: swap them")
    if not 0 < actor.clip_ratio_low < 1:
        problems.append(f"worker.actor.clip_ratio_low={actor.clip_ratio_low}: must be in (0, 1)")
    if actor.clip_ratio_high <= 0:
        problems.append(f"worker.actor.clip_ratio_high={actor.clip_ratio_high}: must be positive")
    if actor.clip_ratio_dual <= 1:
        problems.append(f"worker.actor.clip_ratio_dual={actor.clip_ratio_dual}: must be greater than 1")
    if rollout.n < 2 and config.algorithm.adv_estimator in (AdvantageEstimator.grpo, AdvantageEstimator.rloo):
        problems.append(
            f"worker.rollout.n={rollout.n}: {config.algorithm.adv_estimator.value} compares samples within a "
            "group, so it needs n >= 2"
        )
    if not config.algorithm.disable_kl and not config.algorithm.use_kl_loss:
        problems.append(
            "algorithm.use_kl_loss=false with KL enabled: the KL reward penalty is not implemented yet; "
            "set algorithm.use_kl_loss=true or algorithm.disable_kl=true"
        )
    if data.rollout_batch_size >= 1 and actor.global_batch_size >= 1:
        if data.rollout_batch_size % actor.global_batch_size:
            problems.append(
                f"data.rollout_batch_size={data.rollout_batch_size} is not a multiple of "
                f"worker.actor.global_batch_size={actor.global_batch_size}: each step's prompts must split into "
                "whole update mini-batches"
            )
    trainer = config.trainer
    if trainer.save_freq == 0 or trainer.save_freq < -1:
        problems.append(f"trainer.save_freq={trainer.save_freq}: must be at least 1, or -1 to save only at the end")
    if trainer.save_limit == 0 or trainer.save_limit < -1:
        problems.append(f"trainer.save_limit={trainer.save_limit}: must be at least 1, or -1 to keep every checkpoint")
    if trainer.load_checkpoint_path:
        ckpt = Path(trainer.load_checkpoint_path)
        if not (ckpt / "COMPLETE").is_file():
            problems.append(
                f"trainer.load_checkpoint_path={ckpt}: not a complete checkpoint (no COMPLETE marker); "
                "point it at a global_step_<k> directory that a finished save wrote"
            )
    if trainer.val_only and not data.val_files:
        problems.append("trainer.val_only=true needs data.val_files")
    if config.trainer.nnodes > 1:
        problems.append(
            f"trainer.nnodes={config.trainer.nnodes}: multi-node runs are not supported yet; use trainer.nnodes=1"
        )
    problems.extend(_check_world_divisibility(config))
    return problems


def _check_validation(config: Config) -> list[str]:
    problems = []
    trainer, override = config.trainer, config.worker.rollout.val_override_config
    if trainer.val_freq == 0 or trainer.val_freq < -1:
        problems.append(f"trainer.val_freq={trainer.val_freq}: must be at least 1, or -1 to validate only at the end")
    if trainer.val_generations_to_log < 0:
        problems.append(f"trainer.val_generations_to_log={trainer.val_generations_to_log}: must be 0 or more")
    def number(v):
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    def integer(v):
        return isinstance(v, int) and not isinstance(v, bool)

    rules = {  # key: (valid?, what it must be)
        "temperature": (lambda v: number(v) and v >= 0, "a number >= 0 (0 is greedy)"),
        "top_p": (lambda v: number(v) and 0 < v <= 1, "a number in (0, 1]"),
        "top_k": (lambda v: integer(v) and (v == -1 or v >= 1), "-1 or an integer >= 1"),
        "n": (lambda v: integer(v) and v >= 1, "an integer >= 1"),
    }
    for key, value in override.items():
        if key in rules and not rules[key][0](value):
            problems.append(f"worker.rollout.val_override_config.{key}={value!r}: must be {rules[key][1]}")
    return problems


def _reward_problems(reward: RewardConfig) -> list[str]:
    """The reward function must load here (file, function, imports, REWARD_TYPE) before any actor starts."""
    problems = []
    if not reward.reward_function:
        problems.append("worker.reward.reward_function is empty: set it to path/to/file.py:function")
    else:
        try:
            load_reward_function(reward.reward_function)
        except RewardFunctionError as e:
            problems.append(str(e))
    if reward.num_cpus < 1:
        problems.append(f"worker.reward.num_cpus={reward.num_cpus}: must be at least 1")
    if reward.timeout is not None and not reward.timeout > 0:
        problems.append(f"worker.reward.timeout={reward.timeout}: must be a positive number of seconds, or null for no limit")
    return problems


def _check_world_divisibility(config: Config) -> list[str]:
    problems = []
    world = world_size(config)
    actor, n = config.worker.actor, config.worker.rollout.n
    if world < 1 or n < 1:
        return problems
    for key, samples in (
        ("data.rollout_batch_size", config.data.rollout_batch_size * n),
        ("worker.actor.global_batch_size", actor.global_batch_size * n),
    ):
        if samples >= 1 and samples % world:
            problems.append(
                f"{key} x worker.rollout.n = {samples} samples do not split evenly over {world} worker(s) "
                "(trainer.n_gpus_per_node x trainer.nnodes)"
            )
    mini = actor.global_batch_size * n // max(world, 1)
    micro = actor.micro_batch_size_per_device_for_update
    if mini >= 1 and micro >= 1 and mini % micro:
        problems.append(
            f"worker.actor.micro_batch_size_per_device_for_update={micro} does not divide the {mini} samples "
            f"each worker gets per update (global_batch_size x n / workers); pick a divisor of {mini}"
        )
    return problems


def to_dict(config: Config) -> dict[str, Any]:
    """The config as plain data (enums as their values), for logging and saving."""
    return OmegaConf.to_container(OmegaConf.structured(config), enum_to_str=True)
