"""The option values that the config owns: the enums of its fields, other than the maths' enums.

This module imports nothing but the standard library, and ``vlmrl.config``
loads its other modules lazily, so ``from vlmrl.config.options import ...``
stays cheap: a reward process (``vlmrl.reward.sandbox``) loads a user's
function without importing torch. The enums of the maths (advantage
estimators, losses, KL) belong to ``vlmrl.algos``, next to the code they pick.
"""

from __future__ import annotations

import enum


class _Choice(enum.StrEnum):
    """A str Enum whose error for an unknown value lists the valid ones (as ``vlmrl.algos``' ConfigEnum does;
    this module stays importable without torch, so it cannot use that one)."""

    @classmethod
    def _missing_(cls, value: object):
        valid = ", ".join(repr(m.value) for m in cls)
        raise ValueError(f"{value!r} is not a valid {cls.__name__}; choose one of: {valid}")

__all__ = [
    "AgentFailurePolicy",
    "AsyncPlacement",
    "BadSamplePolicy",
    "DType",
    "Device",
    "LRSchedulerType",
    "LoggerName",
    "ModelKind",
    "OldLogProbPass",
    "OptimizerStrategy",
    "PartialRollout",
    "JudgeParse",
    "RewardManagerType",
    "RewardModelKind",
    "RewardModelPlacement",
    "RolloutName",
    "StalePolicy",
    "Strategy",
    "TimeoutPolicy",
    "WeightTransfer",
]


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
    """AdamW with both moments in bfloat16 and Kahan-compensated bfloat16 weights (EasyR1; vlmrl.train.optimizers)."""


class LRSchedulerType(enum.StrEnum):
    """The learning-rate schedule after warm-up (``optim.lr_scheduler_type``)."""

    constant = "constant"
    cosine = "cosine"


class ModelKind(enum.StrEnum):
    """What a model directory holds, read from its config.json when the config is validated (``vlmrl.plan.model_kind``)."""

    vision_language = "vision_language"
    """A vision-language model (its config has a ``vision_config``), loaded with ``AutoModelForImageTextToText``."""
    text = "text"
    """A text-only causal LM (a ``*ForCausalLM`` architecture), loaded with ``AutoModelForCausalLM``; its processor
    may be a tokenizer alone."""


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


class BadSamplePolicy(str, enum.Enum):
    """What a row that cannot be turned into a sample does to the run (``data.on_bad_sample``)."""

    error = "error"
    """Stop with an error naming the file, the row and the key."""
    skip = "skip"
    """Leave the row out, count it and log it with its file and row."""


class AgentFailurePolicy(enum.StrEnum):
    """What a rollout whose agent raised, timed out, died or made no call does (``worker.rollout.agent_options.on_failure``)."""

    drop = "drop"
    """Count it and leave it out: its group's baseline is computed over the rollouts that finished."""
    fail = "fail"
    """Fail the step with the rollout's id, status and error."""


class AsyncPlacement(_Choice):
    """Where asynchronous training's rollouts run (``worker.rollout.async_rl.placement``)."""

    colocated = "colocated"
    """One pool: every worker hosts the FSDP actor and a vLLM engine, as in synchronous training. Groups admitted
    ahead are generated between updates, and their rewards are scored while the trainer trains."""
    disaggregated = "disaggregated"
    """Rollout servers with their own engines (``rollout_workers`` of them), apart from the trainer workers, which
    build no engine. Generation runs while the trainer trains; weights go to the servers after each update
    (``weight_transfer``), interrupting the responses in flight (``partial_rollout``)."""


class StalePolicy(_Choice):
    """What happens to a group whose oldest token is more than ``eta`` versions old when it would train."""

    drop = "drop"
    """Discard it; its slot is given back and a new group is admitted in its place."""
    requeue = "requeue"
    """Put its prompt back among the waiting groups, to be generated again with newer weights."""
    accept = "accept"
    """Train it anyway and count it in ``accepted_stale`` (the bound is then a soft one)."""


class ConsumeOrder(_Choice):
    """Which admitted groups a step takes (``worker.rollout.async_rl.consume_order``)."""

    admitted = "admitted"
    """The oldest admitted first, in data order: a step waits for its oldest group however slow it is."""
    finished = "finished"
    """Those that finished first (on rollout servers): a slow rollout keeps generating while faster groups train,
    as Agent Lightning's and AReaL's trainers take what is ready; the step's rows stay in admission order."""


class PartialRollout(_Choice):
    """What a weight update does to responses being generated (``worker.rollout.async_rl.partial_rollout``)."""

    keep_kv = "keep_kv"
    """They go on with the new weights from the next token on, keeping the KV cache the old weights computed
    (PipelineRL's in-flight update); their earlier tokens keep their version."""
    reprefill = "reprefill"
    """They are aborted and re-prefilled from prompt + partial response by the new weights, then go on."""


class WeightTransfer(_Choice):
    """How the trainer's weights reach the rollout servers (``worker.rollout.async_rl.weight_transfer``)."""

    auto = "auto"
    """collective on GPU (an NCCL broadcast), object_store on CPU."""
    object_store = "object_store"
    """Through Ray's object store: the trainer's rank 0 puts the buckets once and every server fetches them."""
    collective = "collective"
    """A broadcast from the trainer's rank 0 to the servers in a process group of their own (NCCL on GPU, gloo
    on CPU), apart from the trainer's FSDP group."""


class RewardManagerType(str, enum.Enum):
    """How the reward function is called (EasyR1's ``REWARD_TYPE``)."""

    sequential = "sequential"
    """``compute_score(reward_input: dict, **kwargs) -> dict``, once per response."""
    batch = "batch"
    """``compute_score(reward_inputs: list[dict], **kwargs) -> list[dict]``, once per step."""


class RewardModelKind(enum.StrEnum):
    """What ``worker.reward.reward_model`` is."""

    judge = "judge"
    """A generative VLM (or LLM) served by vLLM that reads the prompt's images, the question and the response and
    writes a verdict (LLM-as-a-judge)."""
    score = "score"
    """A sequence-classification model (``*ForSequenceClassification``, one label) run by transformers: one scalar
    per conversation, as verl's reward-model worker gives."""


class RewardModelPlacement(enum.StrEnum):
    """Where the reward model runs."""

    colocated = "colocated"
    """In every training worker's process, on its device, taking turns with the policy as the reference model does;
    a step's requests are shared out over the workers."""
    separate = "separate"
    """In its own Ray actor with its own devices (``num_gpus``, or ``num_cpus`` on CPU), so judging overlaps the
    policy's log-prob passes."""


class JudgeParse(enum.StrEnum):
    """How a judge's text becomes a score."""

    yes_no = "yes_no"
    """The first word, lower-cased and stripped of punctuation: yes scores 1, no scores 0; anything else is invalid."""
    number = "number"
    """The first number in the text, divided by ``max_score``; none, or one outside [0, max_score], is invalid."""


class TimeoutPolicy(str, enum.Enum):
    """What a call that exceeds ``worker.reward.timeout`` gives."""

    error = "error"
    """The step fails with an error naming the sample."""
    zero = "zero"
    """The sample(s) of that call score 0 (overall and every sub-score), counted in ``reward/timeouts``."""


class LoggerName(str, enum.Enum):
    """Where metrics and validation samples go (``trainer.logger``); ``vlmrl.loggers`` has one logger per member."""

    console = "console"
    """A compact line per step on stdout."""
    file = "file"
    """JSON lines, one per step, in <experiment dir>/metrics.jsonl."""
    mlflow = "mlflow"
    """MLflow; an embedded SQLite store in the experiment dir unless MLFLOW_TRACKING_URI is set."""
    tensorboard = "tensorboard"
    """TensorBoard event files in <experiment dir>/tensorboard/."""
    wandb = "wandb"
    """Weights & Biases (needs the wandb package)."""
    swanlab = "swanlab"
    """SwanLab (needs the swanlab package)."""
