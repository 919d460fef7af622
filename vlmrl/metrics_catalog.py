"""Every metric key vlmrl logs, with what it measures: the one place the metrics reference is generated from.

A ``Metric`` names one key as the loggers write it (``metrics.jsonl``, MLflow, TensorBoard, ...), or a pattern
whose ``{placeholders}`` stand for names that come from the user or the data: a score the reward function returns,
a data source, a tool, a turn number. A placeholder matches one or more characters without "/"; one written with a
trailing "..." (``{source...}``) may span "/". ``find`` gives the entry a logged key belongs to.

This module imports nothing from vlmrl, so that any layer (and a docs generator) may read it.
``tests/test_metrics_catalog.py`` checks it against the keys real runs write and the keys the code spells.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Metric:
    key: str
    """The key as logged, or a pattern with {placeholders}: "reward/{score}", "val/{source...}/{score}"."""
    meaning: str
    """What it measures, its unit, and how to read it."""
    when: str = ""
    """When it is logged, if not at every training step."""


_REWARDS = (
    Metric("reward/overall", "Mean of the reward function's overall score over the step's samples; the signal the "
           "policy is trained on, so it should rise. With external agents it is a mean over rollouts, not rows."),
    Metric("reward/{score}", "Mean of one sub-score the reward function returns beside overall (its own name, "
           "such as accuracy or format), over the samples it applies to."),
    Metric("reward/timeouts", "Samples whose reward function call passed worker.reward.timeout this step and "
           "scored 0 (worker.reward.on_timeout=zero); anything above 0 is worth a look in run.log."),
    Metric("reward_baseline/{score}", "ReMax: mean of each score of the greedy baseline responses (one per "
           "prompt) whose reward is subtracted from the samples'.", "algorithm.adv_estimator=remax"),
    Metric("reward_baseline/timeouts", "ReMax: greedy baseline responses whose reward call timed out and scored 0.",
           "algorithm.adv_estimator=remax"),
)

_ACTOR = (
    Metric("actor/pg_loss", "The policy-gradient loss of the update (mean over micro-batches), in the loss type's "
           "units; its sign and size depend on the advantages, so watch it for spikes rather than for a trend.",
           "after trainer.critic_warmup steps"),
    Metric("actor/pg_clipfrac_higher", "Share of response tokens with a positive advantage whose importance ratio "
           "exceeded 1 + clip_ratio_high, so they got no gradient. There is no single actor/pg_clipfrac: this and "
           "pg_clipfrac_lower are its two halves. Near 0 on-policy; a few percent is normal with several updates "
           "per batch; a large share means the policy moves too far per step.",
           "worker.actor.loss_type default, gspo, gspo_token or cispo"),
    Metric("actor/pg_clipfrac_lower", "Share of response tokens with a negative advantage whose importance ratio "
           "fell below 1 - clip_ratio_low, so they got no gradient (CISPO: tokens whose weight was capped below).",
           "worker.actor.loss_type default, gspo, gspo_token or cispo"),
    Metric("actor/pg_clipfrac_dual", "Share of response tokens with a negative advantage held at the dual-clip cap "
           "(ratio above clip_ratio_dual); these tokens get no gradient.",
           "worker.actor.loss_type default, gspo or gspo_token"),
    Metric("actor/ppo_kl", "Mean of old minus current log-prob over the trained tokens, a k1 estimate of how far "
           "the update moved the policy from the one that made the batch; 0 on the first on-policy mini-batch."),
    Metric("actor/kl_loss", "The KL-to-reference loss term before it is weighted by algorithm.kl_coef "
           "(algorithm.kl_penalty estimator, in nats per token).", "algorithm.use_kl_loss=true"),
    Metric("actor/router_aux_loss", "The router's load-balancing loss of the update's forward, before it is "
           "weighted by worker.actor.router_aux_loss_coef: the number of experts x the sum over experts of the share "
           "of routed tokens x the mean router probability (top_k when perfectly balanced).",
           "worker.actor.router_aux_loss_coef > 0"),
    Metric("actor/reference_kl", "Mean per-token KL (k3 estimate) of the policy that made the batch from the "
           "reference model, in nats; it grows as training moves away from the start.", "with a reference model"),
    Metric("actor/reward_kl_penalty", "Mean per-token KL to the reference that was subtracted from the "
           "token-level rewards, before the coefficient.", "algorithm.use_kl_loss=false (KL in the reward)"),
    Metric("actor/reward_kl_penalty_coef", "The coefficient that KL penalty was weighted by this step: fixed, or "
           "steered towards algorithm.kl_target under kl_type=adaptive.", "algorithm.use_kl_loss=false"),
    Metric("actor/entropy", "Mean per-token entropy of the current policy over the trained tokens during the update, "
           "in nats; a collapse towards 0 means the policy has stopped exploring."),
    Metric("actor/entropy_old", "Mean per-token entropy, in nats, of the policy that made the batch, from the "
           "old-log-prob pass or the update's own forward."),
    Metric("actor/grad_norm", "Gradient norm before clipping to worker.actor.max_grad_norm, mean over the "
           "optimizer steps; sudden spikes precede instability."),
    Metric("actor/lr", "The actor's learning rate this step's updates ran at."),
    Metric("actor/skipped_steps", "Optimizer steps skipped because the gradient was not finite (NaN or inf); "
           "should be 0, and a run whose updates are all skipped fails."),
    Metric("actor/padding_share", "Share of the tokens the update computed that were padding (0 to 1); lower is "
           "less wasted compute (padding_free and token budgets lower it)."),
    Metric("actor/padding_share_logprob", "Share of padding among the tokens the log-prob passes (old, "
           "reference) computed, 0 to 1.", "when a log-prob pass ran"),
    Metric("actor/micro_batches", "Micro-batches the update ran on each worker, over all of its epochs and "
           "mini-batches."),
    Metric("actor/behav_weight_mean", "Decoupled loss: mean of the weight old / behaviour policy applied to each "
           "token, after the cap or mask; near 1 when the sampler and the trainer agree.",
           "worker.actor.use_decoupled_loss"),
    Metric("actor/behav_weight_max", "Decoupled loss: the largest raw weight old / behaviour before the cap, the "
           "tail the cap guards against.", "worker.actor.use_decoupled_loss"),
    Metric("actor/behav_weight_capped_frac", "Decoupled loss: share of tokens whose raw weight exceeded "
           "behaviour_weight_cap (truncated or masked; 0 in mode none).", "worker.actor.use_decoupled_loss"),
    Metric("actor/behav_prox_kl", "Decoupled loss: k3 estimate of KL(behaviour || proximal) per token, in nats; "
           "how far the sampler's policy is from the one the update is anchored at.",
           "worker.actor.use_decoupled_loss"),
)

_CRITIC = (
    Metric("critic/score/mean", "Mean of the samples' summed token-level scores (the reward function's overall, "
           "before any KL penalty)."),
    Metric("critic/score/max", "Largest summed token-level score of a sample this step."),
    Metric("critic/score/min", "Smallest summed token-level score of a sample this step."),
    Metric("critic/rewards/mean", "Mean of the samples' summed token-level rewards: the scores less the KL "
           "penalty when KL is in the reward, else equal to critic/score/mean."),
    Metric("critic/rewards/max", "Largest summed token-level reward of a sample this step."),
    Metric("critic/rewards/min", "Smallest summed token-level reward of a sample this step."),
    Metric("critic/advantages/mean", "Mean advantage over the trained tokens; near 0 for group-normalised "
           "estimators such as GRPO."),
    Metric("critic/advantages/max", "Largest advantage of a trained token this step."),
    Metric("critic/advantages/min", "Smallest advantage of a trained token this step."),
    Metric("critic/returns/mean", "Mean return over the trained tokens (the critic's regression target under GAE; "
           "equal to the advantages for estimators without a value function)."),
    Metric("critic/returns/max", "Largest return of a trained token this step."),
    Metric("critic/returns/min", "Smallest return of a trained token this step."),
    Metric("critic/zero_advantage_groups", "Prompt groups whose advantage is 0 on every token (every sample "
           "scored alike under GRPO), which teach nothing; many of them mean the prompts are too easy or too hard."),
    Metric("critic/values/mean", "Mean of the critic's value predictions over the trained tokens.",
           "algorithm.adv_estimator=gae"),
    Metric("critic/values/max", "Largest value prediction of a trained token.", "algorithm.adv_estimator=gae"),
    Metric("critic/values/min", "Smallest value prediction of a trained token.", "algorithm.adv_estimator=gae"),
    Metric("critic/vf_explained_var", "Explained variance of the returns by the critic's values: 1 predicts them, "
           "0 is no better than their mean, below 0 worse; it should rise towards 1.",
           "algorithm.adv_estimator=gae"),
    Metric("critic/vf_loss", "The clipped value loss of the critic update (half the squared error).",
           "algorithm.adv_estimator=gae"),
    Metric("critic/vf_clipfrac", "Share of tokens where the clipped value term was the larger, so the prediction "
           "got no gradient to move further than cliprange_value.", "algorithm.adv_estimator=gae"),
    Metric("critic/vpred_mean", "Mean of the critic's predictions during its update.", "algorithm.adv_estimator=gae"),
    Metric("critic/grad_norm", "The critic's gradient norm before clipping, mean over its optimizer steps.",
           "algorithm.adv_estimator=gae"),
    Metric("critic/lr", "The critic's learning rate this step's updates ran at.", "algorithm.adv_estimator=gae"),
    Metric("critic/skipped_steps", "Critic optimizer steps skipped because the gradient was not finite; should be "
           "0.", "algorithm.adv_estimator=gae"),
)

_ROLLOUT = (
    Metric("response_length/mean", "Mean response length in tokens (trained tokens of the response, tool output "
           "excluded for multi-turn rows)."),
    Metric("response_length/max", "Longest response this step, in tokens."),
    Metric("response_length/min", "Shortest response this step, in tokens."),
    Metric("response_length/clip_ratio", "Share of responses whose trained tokens fill data.max_response_length "
           "(cut at the budget); a high share means the budget is too small for the task."),
    Metric("rollout/log_prob_diff_mean", "Mean absolute difference between vLLM's and the actor's log-probs of the "
           "sampled tokens; about 1e-7 in fp32, larger in bf16, and a jump means a stale or broken weight resync.",
           "worker.rollout.calculate_log_probs"),
    Metric("rollout/log_prob_diff_max", "Largest absolute vLLM-vs-actor log-prob difference of a sampled token.",
           "worker.rollout.calculate_log_probs"),
    Metric("rollout/current_version_samples", "Samples generated entirely by the weights that train them, on "
           "which the rollout/log_prob_diff_current_* metrics are taken.",
           "async training with worker.rollout.calculate_log_probs"),
    Metric("rollout/log_prob_diff_current_mean", "Mean vLLM-vs-actor log-prob difference on the samples the "
           "current weights generated; numerics alone, so it checks that each weight push is exact.",
           "async training with worker.rollout.calculate_log_probs, when such samples exist"),
    Metric("rollout/log_prob_diff_current_max", "Largest vLLM-vs-actor log-prob difference on the samples the "
           "current weights generated.", "async training with worker.rollout.calculate_log_probs, when such "
           "samples exist"),
)

_LOOP = "worker.rollout.multi_turn, or a workflow class"
_LOOP_TOOLS = "worker.rollout.multi_turn, or a workflow class, when a tool was called (ctx.call_tool)"
_TURNS = "multi-turn rollouts and external agents' rows"

_RC = "algorithm.rollout_correction.mode set, or worker.rollout.calculate_log_probs=true without the decoupled loss"
_MEASURED = "with the engine's log-probs (worker.rollout.calculate_log_probs), when the step trained the actor"
_KL = {"kl_k1": "k1 (log behaviour - log anchor; unbiased, can be negative)",
       "kl_k3": "k3 (r - 1 - log r with r = anchor / behaviour; unbiased, never negative)"}
_SPLITS = {
    "turn_{turn}": ("on the model tokens of turn {turn} (from 0) of multi-turn rows; it should not grow with the "
                    "turn", f"{_MEASURED}, for multi-turn rollouts and external agents' rows"),
    "images_0": ("on the sequences that show no image", f"{_MEASURED}, when the step has such sequences"),
    "images_1": ("on the sequences that show one image", f"{_MEASURED}, when the step has such sequences"),
    "images_2plus": ("on the sequences that show two images or more; long multi-image contexts are where the "
                     "mismatch grows", f"{_MEASURED}, when the step has such sequences"),
    "length_q{quarter}": ("on the sequences whose trained tokens fall in quarter {quarter} (1 to 4) of "
                          "data.max_response_length, ((q-1)/4, q/4]", f"{_MEASURED}, for the quarters that occur"),
}  # fmt: skip

_MISMATCH = (
    Metric("mismatch/ratio_mean", "Mean of the ratio anchor / behaviour, the actor's probability of a sampled token "
           "(old, or the decoupled loss's proximal) over the engine's, per token at level token and per sequence at "
           "the sequence levels of algorithm.rollout_correction.level; 1 when they agree.", _MEASURED),
    Metric("mismatch/ratio_max", "Largest ratio anchor / behaviour (token, or sequence at the sequence levels): "
           "the tail that truncate and mask guard against.", _MEASURED),
    Metric("mismatch/ratio_min", "Smallest ratio anchor / behaviour: tokens the engine found far likelier than the "
           "actor does, which the veto guards against.", _MEASURED),
    *(Metric(f"mismatch/{k}", f"KL(behaviour || anchor) per trained token, the {what} estimate, in nats: how far "
             "the engine that sampled is from the policy the loss assumes.", _MEASURED) for k, what in _KL.items()),
    *(Metric(f"mismatch/{k}/{split}", f"mismatch/{k} {where}.", when)
      for k in _KL for split, (where, when) in _SPLITS.items()),
    Metric("rollout_corr/weight_mean", "Mean of the correction's weight over the tokens it kept (after truncation); "
           "near 1 when the engine and the actor agree.", _RC),
    Metric("rollout_corr/truncated_token_frac", "Share of trained tokens whose weight the truncation lowered "
           "(ratio above algorithm.rollout_correction.threshold); 0 outside mode truncate.", _RC),
    Metric("rollout_corr/truncated_seq_frac", "Share of sequences with a truncated token.", _RC),
    Metric("rollout_corr/masked_token_frac", "Share of trained tokens that mask or icepop dropped from the loss "
           "(vetoed ones not counted); 0 in modes none and truncate.", _RC),
    Metric("rollout_corr/masked_seq_frac", "Share of sequences with a token that mask or icepop dropped.", _RC),
    Metric("rollout_corr/vetoed_token_frac", "Share of trained tokens in sequences the veto dropped (a token ratio "
           "below algorithm.rollout_correction.veto_threshold); 0 without a veto.", _RC),
    Metric("rollout_corr/vetoed_seq_frac", "Share of sequences the veto dropped whole.", _RC),
)

_DISTILL = "algorithm.distillation.teacher_path set"

_DISTILLATION = (
    Metric("distill/reverse_kl", "Mean over the trained tokens of log pi_student - log pi_teacher on the sampled "
           "token (the student's old log-probs): a k1 estimate of KL(student || teacher) in nats per token. It "
           "should fall as the student learns from the teacher; 0 when they agree.", _DISTILL),
    Metric("distill/signal_mean", "Mean over the trained tokens of what the teacher added to the advantages, "
           "algorithm.distillation.coef x the signal (reverse_kl: log pi_teacher - log pi_student); it rises "
           "towards 0 from below as the student's samples become ones the teacher also likes.", _DISTILL),
)

_MULTI_TURN = (
    Metric("agent/turns/mean", "Mean model turns per trajectory (an external agent's row: its calls).", _TURNS),
    Metric("agent/turns/max", "Most model turns of a trajectory this step.", _TURNS),
    Metric("agent/turns/min", "Fewest model turns of a trajectory this step.", _TURNS),
    Metric("agent/images/mean", "Images added after the prompt per trajectory (by tools or the environment; an "
           "external agent's row: every image of its calls).", _TURNS),
    Metric("agent/observation_tokens/mean", "Tokens after the prompt that the model did not write (tool or "
           "environment output, untrained), per trajectory.", _TURNS),
    Metric("action/ratio", "Share of the tokens after the prompt that the model wrote (trained); the rest are "
           "observations.", _TURNS),
    Metric("agent/log_prob_diff/turn_{turn}", "Mean absolute vLLM-vs-actor log-prob difference on the tokens of "
           "model turn {turn} (from 0); it should not grow with the turn.",
           f"{_TURNS}, with worker.rollout.calculate_log_probs"),
    Metric("agent/tool_calls/mean", "Tool calls per trajectory, over all tools.", _LOOP),
    Metric("agent/tool_calls/{tool}", "Calls of one configured tool per trajectory (a name the model made up "
           "counts in agent/tool/unknown_tool_rate instead).", f"{_LOOP}, for each tool called"),
    Metric("agent/tool/success_rate", "Share of tool calls that ran and returned.", _LOOP_TOOLS),
    Metric("agent/tool/parse_error_rate", "Share of tool calls whose call text did not parse.", _LOOP_TOOLS),
    Metric("agent/tool/timeout_rate", "Share of tool calls that passed worker.rollout.multi_turn.tool_timeout.",
           _LOOP_TOOLS),
    Metric("agent/tool/unknown_tool_rate", "Share of tool calls naming a tool that is not configured.", _LOOP_TOOLS),
    Metric("agent/tool/latency_p50_s", "Median seconds a tool call took.", _LOOP_TOOLS),
    Metric("agent/tool/latency_p95_s", "95th percentile of the seconds a tool call took.", _LOOP_TOOLS),
    Metric("agent/stop/done", "Share of trajectories that ended because the model answered without a tool call "
           "(or the environment said done).", _LOOP),
    Metric("agent/stop/max_turns", "Share of trajectories cut at worker.rollout.multi_turn.max_turns.", _LOOP),
    Metric("agent/stop/length", "Share of trajectories that ran out of the data.max_response_length budget.", _LOOP),
    Metric("agent/stop/error", "Share of trajectories ended by an error: a failed environment reset or step, or "
           "an observation that could not be rendered.", _LOOP),
    Metric("agent/render_mismatch_rate", "Share of checked trajectories (the first of each group) whose tokens "
           "differ from the chat template's rendering of the same conversation; should be 0.",
           f"{_LOOP}, when a trajectory was checked"),
)

_EXTERNAL_AGENTS = (
    Metric("agent/rollouts/ok", "Agent rollouts this step that finished and are trained.", "worker.rollout.agent"),
    Metric("agent/rollouts/raised", "Agent rollouts whose agent raised; left out of training.",
           "worker.rollout.agent"),
    Metric("agent/rollouts/timeout", "Agent rollouts that passed agent_options.timeout; left out.",
           "worker.rollout.agent"),
    Metric("agent/rollouts/died", "Agent rollouts whose process crashed mid-rollout; left out.",
           "worker.rollout.agent"),
    Metric("agent/rollouts/no_call", "Agent rollouts that returned without calling the model; left out.",
           "worker.rollout.agent"),
    Metric("agent/calls", "Model calls made by the rollouts that finished.", "worker.rollout.agent"),
    Metric("agent/hook_errors", "Calls of worker.rollout.agent_hooks that raised (logged, never fatal).",
           "worker.rollout.agent"),
    Metric("trace/rows", "Training rows made from the finished rollouts' calls (algorithm.trace_aggregation).",
           "worker.rollout.agent"),
    Metric("trace/mismatches", "Calls that did not continue their row (their prompt does not start with the row "
           "so far) and so started a new row; see run.log for both views.", "worker.rollout.agent"),
    Metric("trace/empty_rollouts", "Finished rollouts that made no model call and so no row.",
           "worker.rollout.agent"),
    Metric("trace/untrained_rows", "Rows dropped because no call in them returned a token to train.",
           "worker.rollout.agent"),
    Metric("trace/too_long_rows", "Rows left out because they do not fit data.max_prompt_length + "
           "data.max_response_length.", "worker.rollout.agent"),
    Metric("trace/trimmed_rows", "Rows dropped to make the step's rows whole mini-batches (rows of groups with "
           "zero advantage first).", "worker.rollout.agent"),
    Metric("trace/rows_trained", "Rows the step trains on after the trim.", "worker.rollout.agent"),
)

_WORKFLOWS = (
    Metric("workflow/dropped", "Samples whose workflow returned None (dropped, as the workflow chose).",
           "worker.rollout.workflow=path:Class"),
    Metric("workflow/errors", "Samples whose workflow raised or returned something else than episodes; dropped "
           "(data.on_bad_sample=skip).", "worker.rollout.workflow=path:Class"),
    Metric("workflow/timeouts", "Samples whose workflow ran past worker.rollout.workflow_timeout; dropped "
           "(data.on_bad_sample=skip).", "worker.rollout.workflow=path:Class"),
)

_ASYNC = (
    Metric("async/lag/mean", "Mean of the trained groups' lag: policy versions between the weights that train "
           "a group and the oldest that generated it.", "async training"),
    Metric("async/lag/max", "Largest lag of a trained group, in versions; never above max_head_offpolicyness "
           "unless stale_policy=accept.", "async training"),
    Metric("async/token_lag/mean", "Mean over the trained tokens of the versions between the trainer and the "
           "weights that sampled the token.", "async training"),
    Metric("async/lag/in_flight_max", "Largest age in versions of a group carried over while still generating.",
           "async training"),
    Metric("async/lag/in_queue_max", "Largest age in versions of a group carried over, generated and waiting.",
           "async training"),
    Metric("async/stale_dropped", "Groups found too old at consumption this step and dropped.", "async training"),
    Metric("async/stale_requeued", "Groups found too old this step and put back for a fresh generation.",
           "async training"),
    Metric("async/stale_accepted", "Groups found too old this step and trained anyway (stale_policy=accept): "
           "bound violations.", "async training"),
    Metric("async/partial_rollout_share", "Share of the trained responses whose tokens come from more than one "
           "policy version (they straddled a weight push).", "async training"),
    Metric("async/carried_over", "Groups admitted and not trained by this step, carried into the next.",
           "async training"),
    Metric("async/carried_over_age", "Largest age in versions of a carried-over group.", "async training"),
    Metric("async/trainer_idle_share", "Share of the step the trainer waited for a batch or for rewards, doing "
           "nothing (0 to 1); lower means the rollouts keep up.", "async training"),
    Metric("async/rollout_idle_share", "Share of the step the engines did not generate (0 to 1); colocated they "
           "idle whenever the workers train, disaggregated it is the servers' own count.", "async training"),
    Metric("async/enqueued", "The staleness manager's counter: groups waiting for admission.", "async training"),
    Metric("async/running", "Groups admitted and not yet finished (generating or being scored).", "async training"),
    Metric("async/accepted", "Groups finished and kept since version 0: consumed, or waiting for the trainer.",
           "async training"),
    Metric("async/rejected", "Groups finished or abandoned without being kept (filtered, failed, cancelled).",
           "async training"),
    Metric("async/consumed", "Groups handed to the trainer since the start.", "async training"),
    Metric("async/dropped", "Groups dropped as stale since the start.", "async training"),
    Metric("async/requeued", "Groups requeued as stale since the start.", "async training"),
    Metric("async/accepted_stale", "Groups trained though stale since the start (stale_policy=accept).",
           "async training"),
    Metric("async/queued", "Groups finished and kept, waiting for the trainer (accepted minus consumed).",
           "async training"),
    Metric("async/capacity", "How many more groups may be admitted now under the concurrency and staleness "
           "bounds.", "async training"),
    Metric("async/version", "The policy version the engines generate with.", "async training"),
    Metric("timing_s/async/generate", "Seconds the step spent generating (colocated).", "async training"),
    Metric("timing_s/async/batch_wait", "Seconds the trainer waited for the step's groups to finish generating.",
           "async training"),
    Metric("timing_s/async/reward_wait", "Seconds the trainer waited for the step's rewards.", "async training"),
)

_REWARD_MODELS = (
    Metric("reward_model/seconds", "The reward model's wall time in the step, in seconds.",
           "worker.reward.reward_model"),
    Metric("reward_model/requests", "Requests sent to the reward model this step (asks are merged into batches).",
           "worker.reward.reward_model"),
    Metric("reward_model/items", "Conversations or samples the reward model scored this step.",
           "worker.reward.reward_model"),
    Metric("reward_model/tokens_per_s", "The judge's generated tokens per second.",
           "worker.reward.reward_model with a judge"),
    Metric("reward_model/invalid", "Verdicts that did not parse, or scores that were not finite, scored 0 "
           "(on_invalid=zero).", "worker.reward.reward_model"),
    Metric("reward_model/timeouts", "Requests that passed reward_model.timeout and scored 0 (on_timeout=zero).",
           "worker.reward.reward_model"),
    Metric("reward_model/score_mean", "Mean score the reward model gave this step.", "worker.reward.reward_model"),
    Metric("reward_model/score_max", "Largest score the reward model gave this step.", "worker.reward.reward_model"),
    Metric("reward_model/score_min", "Smallest score the reward model gave this step.", "worker.reward.reward_model"),
    Metric("reward_baseline/reward_model/{counter}", "ReMax: the reward model's reward_model/* counters for the "
           "greedy baseline responses.", "algorithm.adv_estimator=remax with worker.reward.reward_model"),
)

_TIMING = (
    Metric("timing_s/step", "Seconds of the whole training step."),
    Metric("timing_s/gen", "Seconds of the rollout (generation; with online filtering, every round)."),
    Metric("timing_s/old", "Seconds of the old-log-prob pass.", "when that pass runs (not when the update's "
           "forward gives the old log-probs)"),
    Metric("timing_s/ref", "Seconds of the reference log-prob pass.", "with a reference model"),
    Metric("timing_s/teacher", "Seconds of the distillation teacher's log-prob pass.", _DISTILL),
    Metric("timing_s/values", "Seconds of the critic's value pass.", "algorithm.adv_estimator=gae"),
    Metric("timing_s/reward", "Seconds waited for the rewards after the log-prob passes (the scoring they did not "
           "hide)."),
    Metric("timing_s/adv", "Seconds of the advantage computation."),
    Metric("timing_s/update_critic", "Seconds of the critic update.", "algorithm.adv_estimator=gae"),
    Metric("timing_s/update_actor", "Seconds of the policy update.", "after trainer.critic_warmup steps"),
    Metric("timing_s/update_weights", "Seconds of the weight resync into the rollout engines.",
           "after trainer.critic_warmup steps"),
    Metric("timing_s/testing", "Seconds of validation.", "at each validation"),
    Metric("timing_s/save_checkpoint", "Seconds of the checkpoint save.", "when a checkpoint is saved"),
    Metric("timing_s/gen/requests", "Seconds of the rollout spent building the engine requests.",
           "single-turn rollouts"),
    Metric("timing_s/gen/engine", "Seconds of the rollout the engine stepped (multi-turn: its turns' "
           "generation; a workflow: its samples' requests).", "every rollout kind but external agents"),
    Metric("timing_s/gen/outputs", "Seconds of the rollout spent ordering the engine's outputs.",
           "single-turn rollouts in the workers' engines"),
    Metric("timing_s/gen/trajectories", "Seconds of the rollout spent making the workers' records of the samples.",
           "single-turn rollouts"),
    Metric("timing_s/gen/tools", "Seconds of the rollout spent running tools or stepping the environment.",
           "multi-turn rollouts"),
    Metric("timing_s/gen/render", "Seconds of the rollout spent rendering observations into tokens.",
           "multi-turn rollouts"),
    Metric("timing_s/gen/agents", "Seconds of the rollout the external agents ran.", "worker.rollout.agent"),
    Metric("timing_s/gen/rows", "Seconds of the rollout spent turning the agents' calls into rows.",
           "worker.rollout.agent"),
    Metric("timing_s/gen/workflow", "Seconds of the rollout spent in the workflow's own code and waits (the engine's "
           "steps not counted).", "worker.rollout.workflow=path:Class"),
    Metric("timing_s/gen/driver_call", "Seconds of the whole rollout call as the driver waited for it.",
           "when the training workers generate (not on disaggregated rollout servers)"),
    Metric("timing_s/gen/server_call", "Seconds from submitting rollouts to the rollout servers to collecting "
           "them (overlaps training, so latency rather than cost).", "async training, disaggregated"),
    Metric("timing_s/resync_worker", "Seconds of the slowest worker's weight resync.",
           "after trainer.critic_warmup steps"),
    Metric("timing_s/resync_put", "Seconds putting the weights into Ray's object store for the rollout servers.",
           "async training, disaggregated, weight_transfer=object_store"),
    Metric("timing_s/resync_broadcast", "Seconds broadcasting the weights to the rollout servers.",
           "async training, disaggregated, weight_transfer=collective"),
    Metric("timing_s/resync_load", "Seconds from the weights sent until every rollout server had loaded them.",
           "async training, disaggregated"),
)

_PERFORMANCE = (
    Metric("perf/time_per_step", "Seconds of the step (as timing_s/step)."),
    Metric("perf/total_num_tokens", "Tokens of the step's batch, prompts and responses."),
    Metric("perf/throughput", "Tokens per second per worker device over the whole step (EasyR1's name; the same "
           "number as perf/tokens_per_second_per_device)."),
    Metric("perf/tokens_per_second_per_device", "Tokens per second per worker device over the whole step."),
    Metric("perf/mfu", "Estimated model FLOPs utilisation of the step: the passes' FLOPs (about 2 x parameters per "
           "token forward, 6 x per training pass) over the devices' peak, 0 to 1.",
           "when the parameter count and the device's peak are known"),
    Metric("perf/mfu/actor", "Estimated FLOPs utilisation of the policy update alone.",
           "when the update ran and the peak is known"),
    Metric("perf/mfu/critic", "Estimated FLOPs utilisation of the critic update alone.",
           "algorithm.adv_estimator=gae, when the peak is known"),
    Metric("perf/cpu_memory_peak_gb", "The largest worker's peak resident memory since it started, in GiB "
           "(rollouts included).", "after trainer.critic_warmup steps"),
    Metric("perf/max_memory_allocated_gb", "The largest worker's peak GPU memory allocated by torch so far, in "
           "GiB.", "on GPU"),
    Metric("perf/rollout/max_memory_allocated_gb", "The largest worker's peak GPU memory during the rollouts "
           "since the last update (vLLM's weights and KV cache included), in GiB.", "on GPU"),
    Metric("perf/resync_bucket_peak_mb", "The largest all-gather bucket a worker held while streaming weights "
           "into its engine, in MiB (bounded by worker.rollout.resync_bucket_mb).",
           "after trainer.critic_warmup steps, colocated engines"),
    Metric("perf/resync_mb", "MiB of weights pushed to the rollout servers.", "async training, disaggregated"),
    Metric("perf/resync_buckets", "Buckets the pushed weights were sent in.", "async training, disaggregated"),
    Metric("perf/resync_skipped", "1 on an update whose weights were not pushed to the rollout servers "
           "(weight_sync_interval above 1).", "async training, disaggregated"),
)

_VALIDATION = (
    Metric("val/reward/overall", "Mean overall score over the validation set (greedy, one response per prompt "
           "unless val_override_config says otherwise); the number to compare runs by.", "at each validation"),
    Metric("val/reward/{score}", "Mean of one sub-score of the reward function over the validation set.",
           "at each validation"),
    Metric("val/reward/timeouts", "Validation samples whose reward call timed out and scored 0.",
           "at each validation"),
    Metric("val/{source...}/{score}", "Mean of one score (overall or a sub-score) over the validation prompts of "
           "one data source (the data's data_source column, unknown where it has none).", "at each validation"),
    Metric("val/{source...}/{score}/mean@{n}", "verl's mean@N: the mean of one score over the N responses to a "
           "prompt, averaged over the source's prompts (equals val/{source}/{score} when every prompt has N).",
           "at each validation, worker.rollout.val_override_config.n above 1"),
    Metric("val/{source...}/{score}/best@{n}", "verl's best@N: the highest score among the N responses to a prompt, "
           "averaged over the source's prompts; the model's ceiling with N tries (pass@N for a 0/1 score). Exact on "
           "the N responses drawn, not bootstrapped.",
           "at each validation, worker.rollout.val_override_config.n above 1"),
    Metric("val/{source...}/{score}/maj@{n}", "verl's maj@N: the score of the answer most of a prompt's N responses "
           "give (a pred sub-score when the reward function returns one, else the response text; a tie goes to the "
           "answer given first), averaged over the source's prompts.",
           "at each validation, worker.rollout.val_override_config.n above 1"),
)

_DATA = (
    Metric("global_seqlen/min", "Fewest tokens a worker would get if the batch were split in contiguous shares.",
           "after trainer.critic_warmup steps"),
    Metric("global_seqlen/max", "Most tokens a worker would get with contiguous shares.",
           "after trainer.critic_warmup steps"),
    Metric("global_seqlen/mean", "Mean tokens per worker.", "after trainer.critic_warmup steps"),
    Metric("global_seqlen/minmax_diff", "Most minus fewest tokens per worker with contiguous shares: the imbalance "
           "that balancing removes.", "after trainer.critic_warmup steps"),
    Metric("global_seqlen/balanced_min", "Fewest tokens a worker gets after balancing.",
           "after trainer.critic_warmup steps"),
    Metric("global_seqlen/balanced_max", "Most tokens a worker gets after balancing; close to balanced_min when "
           "the balance works.", "after trainer.critic_warmup steps"),
    Metric("filter/tries", "Generation rounds online filtering needed to fill the step's batch (1: none extra; "
           "under async, the groups looked at in steps' worth).",
           "algorithm.online_filtering=true"),
    Metric("filter/kept_group_ratio", "Share of the prompt groups generated (under async: looked at by the step) "
           "that online filtering kept; low means "
           "most prompts are too easy or too hard.", "algorithm.online_filtering=true"),
)

SECTIONS: tuple[tuple[str, str, tuple[Metric, ...]], ...] = (
    ("Rewards", "What the reward function returned, as means over the step's samples.", _REWARDS),
    ("Actor", "The policy update (in the steps after trainer.critic_warmup): its loss, clipping, KL, entropy and "
     "optimizer; and the KL of the batch to the reference.", _ACTOR),
    ("Critic", "Scores, rewards, advantages and returns of the batch (under EasyR1's critic/ names, for every "
     "estimator), and the critic's values and update under GAE.", _CRITIC),
    ("Rollout", "The responses' lengths, and how far vLLM's log-probs are from the actor's.", _ROLLOUT),
    ("Rollout correction", "The rollout-training mismatch (the engine's log-probs against the actor's old or "
     "proximal ones) and what algorithm.rollout_correction did about it; computed on the driver over the whole "
     "batch.", _MISMATCH),
    ("Distillation", "On-policy distillation: how far the student is from the teacher on the student's own "
     "samples, and what the teacher's signal added to the advantages (algorithm.distillation).", _DISTILLATION),
    ("Multi-turn agents", "Multi-turn rollouts with tools or an environment (worker.rollout.multi_turn); the turn, "
     "image and token counts also for the rows of external agents.", _MULTI_TURN),
    ("External agents", "Agents that call the model through vlmrl's OpenAI-compatible endpoint, and how their "
     "calls became training rows.", _EXTERNAL_AGENTS),
    ("Workflows", "A workflow class's samples that made no row (worker.rollout.workflow); its episodes are counted "
     "as multi-turn trajectories above.", _WORKFLOWS),
    ("Asynchronous training", "Bounded staleness: how old the trained groups are, the staleness manager's counters "
     "and who waited for whom.", _ASYNC),
    ("Reward models", "The reward model's (a judge's or a score model's) counters for the step.", _REWARD_MODELS),
    ("Timing", "Seconds of the step's phases and of the rollout's pieces.", _TIMING),
    ("Performance", "Throughput, FLOPs utilisation, peak memory and the weight resync's size.", _PERFORMANCE),
    ("Validation", "Scores over the validation set.", _VALIDATION),
    ("Data and batching", "How the batch was split over the workers, and online filtering.", _DATA),
)
"""(section title, one-line introduction, its metrics), in the order the reference shows them."""

METRICS: tuple[Metric, ...] = tuple(m for _, _, metrics in SECTIONS for m in metrics)
"""Every entry, in section order."""

_PLACEHOLDER = re.compile(r"\{(\w+)(\.\.\.)?\}")


def pattern(key: str) -> re.Pattern[str]:
    """The regular expression a key or pattern stands for: ``{name}`` is one or more characters without "/",
    ``{name...}`` one or more of any.

    >>> bool(pattern("val/{source...}/{score}").fullmatch("val/a/b@test/accuracy"))
    True
    >>> bool(pattern("reward/{score}").fullmatch("reward/a/b"))
    False
    """
    parts, last = [], 0
    for m in _PLACEHOLDER.finditer(key):
        parts += [re.escape(key[last : m.start()]), ".+" if m.group(2) else "[^/]+"]
        last = m.end()
    parts.append(re.escape(key[last:]))
    return re.compile("".join(parts))


def _literal_length(key: str) -> int:
    return len(_PLACEHOLDER.sub("", key))


_EXACT = {m.key: m for m in METRICS if not _PLACEHOLDER.search(m.key)}
# The most specific pattern first: "val/reward/{score}" before "val/{source...}/{score}".
_PATTERNS = sorted(
    ((m, pattern(m.key)) for m in METRICS if _PLACEHOLDER.search(m.key)), key=lambda p: -_literal_length(p[0].key)
)


def find(key: str) -> Metric | None:
    """The entry ``key`` is logged under: its own, else the most specific pattern it matches; None if undeclared.

    >>> find("actor/pg_clipfrac_higher").when
    'worker.actor.loss_type default, gspo, gspo_token or cispo'
    >>> find("reward/accuracy").key
    'reward/{score}'
    >>> find("val/reward/accuracy").key, find("val/geo3k@test/accuracy").key
    ('val/reward/{score}', 'val/{source...}/{score}')
    >>> find("actor/made_up") is None
    True
    """
    if key in _EXACT:
        return _EXACT[key]
    for metric, regex in _PATTERNS:
        if regex.fullmatch(key):
            return metric
    return None
