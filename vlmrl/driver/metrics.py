"""Per-step metrics computed on the driver from a finished batch."""

from __future__ import annotations

import math

import torch

from vlmrl.records import Batch, Trajectory
from vlmrl import algos


def reduce_reward_metrics(per_sample: dict[str, list[float]], prefix: str) -> dict[str, float]:
    """The mean of each reward score over the samples, as ``<prefix>/<name>``.

    NaN marks a sample a score does not apply to (a sub-score of the reward function, for a rollout its agent
    scored) and is left out of that score's mean; a score with no value anywhere is not reported.
    """
    means = {}
    for name, values in per_sample.items():
        present = [v for v in values if not math.isnan(v)]
        if present:
            means[f"{prefix}/{name}"] = sum(present) / len(present)
    return means


def _stats(name: str, values: torch.Tensor) -> dict[str, float]:
    """mean, max and min of a 1-D tensor as ``<name>/mean`` etc."""
    values = values.double()
    return {
        f"{name}/mean": values.mean().item(),
        f"{name}/max": values.max().item(),
        f"{name}/min": values.min().item(),
    }


def batch_metrics(batch: Batch, entropy: torch.Tensor, version: int | None = None) -> dict[str, float]:
    """Response lengths, scores and rewards per sequence, advantages/returns/values per token, and
    how many prompt groups carry no learning signal (advantage 0 on every token). ``version``: the policy
    version training the batch (asynchronous training), for the engine-vs-trainer gap on its own samples."""
    mask = batch.response_mask
    valid = mask.bool()
    lengths = mask.sum(dim=1).float()
    metrics = {
        **_stats("response_length", lengths),
        "response_length/clip_ratio": (lengths == mask.shape[1]).float().mean().item(),
        "actor/entropy_old": algos.masked_mean(entropy, mask).item(),
        **_stats("critic/score", algos.masked_sum(batch.token_level_scores, mask, dim=-1)),
        **_stats("critic/advantages", batch.advantages[valid]),
        "critic/zero_advantage_groups": float(
            algos.zero_advantage_groups(batch.advantages, mask, batch.group_ids)
        ),
    }
    if batch.token_level_rewards is not None:
        metrics.update(_stats("critic/rewards", algos.masked_sum(batch.token_level_rewards, mask, dim=-1)))
    if batch.returns is not None:
        metrics.update(_stats("critic/returns", batch.returns[valid]))
    if batch.values is not None:
        metrics.update(_stats("critic/values", batch.values[valid]))
        returns = batch.returns[valid].double()
        # Explained variance: 1 means the critic predicts the returns, 0 no better than their mean.
        residual_var = (returns - batch.values[valid].double()).var()
        metrics["critic/vf_explained_var"] = (1.0 - residual_var / returns.var().clamp_min(1e-8)).item()
    if batch.ref_log_probs is not None:
        kl = algos.kl_penalty(batch.old_log_probs, batch.ref_log_probs, algos.KLEstimator.low_var_kl)
        metrics["actor/reference_kl"] = algos.masked_mean(kl, mask).item()
    if batch.rollout_log_probs is not None:
        # How far vLLM's view of the policy is from the actor's: a stale resync or a
        # numerics mismatch between the engines shows up here first.
        diff = (batch.rollout_log_probs - batch.old_log_probs).abs()
        metrics["rollout/log_prob_diff_mean"] = algos.masked_mean(diff, mask).item()
        metrics["rollout/log_prob_diff_max"] = diff[valid].max().item()
        if version is not None:
            # The samples the trainer's weights generated start to finish: there the engine and the trainer hold
            # the same weights, so any gap is numerics or a broken weight sync. (Older tokens differ by design, and
            # so do a sample's tokens after a load that kept the old weights' KV cache.)
            own = ((batch.policy_versions == version) | ~valid).all(dim=1) & valid.any(dim=1)
            current = valid & own[:, None]
            metrics["rollout/current_version_samples"] = float(own.sum())
            if current.any():
                metrics["rollout/log_prob_diff_current_mean"] = diff[current].mean().item()
                metrics["rollout/log_prob_diff_current_max"] = diff[current].max().item()
    metrics.update(agent_metrics(batch))
    return metrics


def agent_metrics(batch: Batch) -> dict[str, float]:
    """Multi-turn rollouts (``agent/*``): turns, images, the share of the response the model wrote, observation
    tokens, and the rollout-vs-actor log-prob gap of each turn; for the in-process loop
    (``worker.rollout.multi_turn``) also tool calls by tool and by outcome, stop reasons, tool latency and
    template mismatches.

    Rows an external agent's calls made (``worker.rollout.agent``, rows with a ``rollout_id``) have none of the
    loop's: vlmrl neither runs their tools nor decides when they stop, and a row's stop reason is its last call's
    finish reason. What the endpoint knows of them (rollouts by outcome, calls, rows, template mismatches) is
    logged as ``agent/rollouts/*``, ``agent/calls`` and ``trace/*`` by the rollout worker."""
    trajectories = [t for t in batch.trajectories if t.turn_ends]
    if not trajectories:
        return {}
    n = len(trajectories)
    metrics = {
        **_stats("agent/turns", torch.tensor([t.num_turns for t in trajectories])),
        "agent/images/mean": sum(len(t.media) - t.prompt_media for t in trajectories) / n,
    }
    looped = [t for t in trajectories if not t.rollout_id]
    if looped:
        metrics.update(_loop_metrics(looped))
    model = sum(sum(t.loss_mask[t.prompt_length :]) for t in trajectories)
    after_prompt = sum(len(t.token_ids) - t.prompt_length for t in trajectories)
    metrics["action/ratio"] = model / max(after_prompt, 1)
    metrics["agent/observation_tokens/mean"] = (after_prompt - model) / n
    if batch.rollout_log_probs is not None and batch.old_log_probs is not None:
        diff = (batch.rollout_log_probs - batch.old_log_probs).abs()
        by_turn: dict[int, list[torch.Tensor]] = {}
        for row, t in enumerate(batch.trajectories):
            start = t.prompt_length
            for turn, end in enumerate(t.turn_ends):
                cols = [i - t.prompt_length for i in range(start, end + 1) if t.loss_mask[i] and i - t.prompt_length < diff.shape[1]]
                if cols:
                    by_turn.setdefault(turn, []).append(diff[row, cols])
                start = end + 1
        for turn, values in sorted(by_turn.items()):
            metrics[f"agent/log_prob_diff/turn_{turn}"] = torch.cat(values).mean().item()
    return metrics


def _loop_metrics(trajectories: list[Trajectory]) -> dict[str, float]:
    """What the in-process multi-turn loop decides and runs: tool calls, stop reasons, tool latency, the render
    mismatch rate."""
    n = len(trajectories)
    calls = [c for t in trajectories for c in t.tool_calls]
    metrics = {"agent/tool_calls/mean": len(calls) / n}
    checked = [t.render_mismatch for t in trajectories if t.render_mismatch is not None]
    if checked:
        metrics["agent/render_mismatch_rate"] = sum(checked) / len(checked)
    for reason in ("done", "max_turns", "length", "error"):
        metrics[f"agent/stop/{reason}"] = sum(t.stop_reason == reason for t in trajectories) / n
    # By tool: the configured tools only. A name the model made up is a call with status unknown_tool (its rate
    # below), not a metric key per spelling.
    named = [c["name"] for c in calls if c["name"] and c["status"] != "unknown_tool"]
    for name in sorted(set(named)):
        metrics[f"agent/tool_calls/{name}"] = named.count(name) / n
    if calls:
        for status, key in (("ok", "success_rate"), ("parse_error", "parse_error_rate"), ("timeout", "timeout_rate"),
                            ("unknown_tool", "unknown_tool_rate")):  # fmt: skip
            metrics[f"agent/tool/{key}"] = sum(c["status"] == status for c in calls) / len(calls)
        seconds = torch.tensor([c.get("seconds", 0.0) for c in calls], dtype=torch.float64)
        metrics["agent/tool/latency_p50_s"] = seconds.quantile(0.5).item()
        metrics["agent/tool/latency_p95_s"] = seconds.quantile(0.95).item()
    return metrics
