"""Validation: generate on the validation set, score, report per source and sub-score, and log samples.

Sampling follows ``worker.rollout.val_override_config`` over a greedy single
sample per prompt. Metrics come as ``val/reward/<score>`` over the whole set
and ``val/<data source>/<score>`` per source, for ``overall`` and every
sub-score the reward function returns. The first ``trainer.val_generations_to_log``
samples (the same rows at every validation, so answers can be followed over
the run) go to <experiment dir>/generations/step_<k>.jsonl with their token
ids and vLLM log-probs, and to the tracker's loggers with their images.

With ``val_override_config.n`` = N > 1, each source and score also gets verl's
N-sample views (``at_n_metrics``): ``mean@N``, ``best@N`` and ``maj@N``, per
prompt and then averaged over the source's prompts. Unlike verl, which
bootstraps them (resampling N of the N with replacement, 1000 times), they are
the statistics of the N responses drawn: exact and deterministic, and best@N is
not biased down by repeated draws. Majority voting needs an answer per response:
a ``pred`` sub-score when the reward function returns one (numbers only, as
every score), else the response text with surrounding whitespace stripped.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from pathlib import Path

from vlmrl.records import Batch
from vlmrl.driver.generations import write_generations
from vlmrl.driver.metrics import reduce_reward_metrics
from vlmrl.driver.rollout_scores import RolloutScoring
from vlmrl.driver.scoring import Scorer
from vlmrl.loggers.tracking import Tracker, ValidationSample
from vlmrl.rollout.engine import Sampling
from vlmrl.workers.group import WorkerGroup


class Validator:
    def __init__(
        self,
        workers: WorkerGroup,
        scorer: Scorer,
        loader,
        sampling: Sampling,
        experiment_dir: str,
        generations_to_log: int,
        tracker: Tracker | None = None,
    ):
        self.workers, self.scorer, self.loader, self.sampling = workers, scorer, loader, sampling
        self.experiment_dir = Path(experiment_dir)
        self.generations_to_log = generations_to_log
        self.tracker = tracker

    def run(self, step: int) -> dict[str, float]:
        parts, timeouts, first_id = [], 0, 0
        for prompts in self.loader:
            # Group ids tell the n responses of one prompt apart from another's (mean@N, best@N, maj@N).
            batch = self.workers.generate(prompts, list(range(first_id, first_id + len(prompts))), self.sampling)
            first_id += len(prompts)
            rewards = self.scorer.collect(self.scorer.launch(batch), batch)
            rewards.assign_to(batch)
            timeouts += rewards.metrics["reward/timeouts"]
            parts.append(batch)
        batch = Batch.concat(parts)
        # An external agent's rollout may span rows, which share its scores: it counts once, by its last row.
        counted = batch.select(RolloutScoring.of(batch.trajectories).last_rows) if batch.trajectories[0].rollout_id else batch
        metrics = {**reduce_reward_metrics(counted.reward_metrics, prefix="val/reward"), "val/reward/timeouts": timeouts}
        for source in sorted(set(counted.data_sources)):
            rows = [i for i, s in enumerate(counted.data_sources) if s == source]
            per_source = {k: [v[i] for i in rows] for k, v in counted.reward_metrics.items()}
            metrics.update(reduce_reward_metrics(per_source, prefix=f"val/{source}"))
        votes = counted.reward_metrics.get("pred") or [text.strip() for text in counted.response_texts]
        metrics.update(
            at_n_metrics(counted.data_sources, counted.group_ids.tolist(), counted.reward_metrics, votes)
        )
        self._write_generations(batch, step)
        if self.tracker is not None and self.generations_to_log > 0:
            self.tracker.log_samples(samples(batch, step, self.generations_to_log), step)
        return metrics

    def _write_generations(self, batch: Batch, step: int) -> None:
        """The first generations_to_log samples, with token ids and vLLM's log-probs, as JSON lines."""
        if self.generations_to_log > 0:
            path = self.experiment_dir / "generations" / f"step_{step}.jsonl"
            write_generations(path, batch, step, self.generations_to_log)

def at_n_metrics(
    sources: Sequence[str],
    prompt_ids: Sequence[int],
    scores: dict[str, Sequence[float]],
    votes: Sequence[Hashable],
) -> dict[str, float]:
    """verl's N-sample validation views of every score, per data source, for prompts with N > 1 responses.

    For a prompt whose N responses score ``x_1..x_N`` (NaN, a score that does not apply, is left out) and
    answer ``v_1..v_N``::

        mean@N = mean_j x_j
        best@N = max_j x_j
        maj@N  = mean of x_j over the responses j that give the most frequent answer
                 (a tie goes to the answer given first, as verl's)

    Each is averaged over the source's prompts and logged as ``val/<source>/<score>/mean@N`` (and ``best@N``,
    ``maj@N``); N is the prompt's response count. Prompts with one response add nothing.

    Args:
        sources: each row's data source.
        prompt_ids: each row's prompt; rows with the same id are the responses to one prompt.
        scores: score name -> each row's value.
        votes: each row's answer for the majority vote.

    Returns:
        The metrics, ``{}`` when no prompt has more than one response.
    """
    rows_of: dict[tuple[str, int], list[int]] = {}
    for i, key in enumerate(zip(sources, prompt_ids)):
        rows_of.setdefault(key, []).append(i)
    per_prompt: dict[str, list[float]] = {}
    for (source, _), rows in rows_of.items():
        if len(rows) < 2:
            continue
        n = len(rows)
        counts: dict[Hashable, int] = {}
        for i in rows:  # insertion order: the first answer given wins a tie
            counts[votes[i]] = counts.get(votes[i], 0) + 1
        majority = max(counts, key=counts.__getitem__)
        for name, values in scores.items():
            xs = [values[i] for i in rows if not math.isnan(values[i])]
            if not xs:
                continue
            voted = [values[i] for i in rows if votes[i] == majority and not math.isnan(values[i])]
            for view, value in (
                ("mean", sum(xs) / len(xs)),
                ("best", max(xs)),
                ("maj", sum(voted) / len(voted) if voted else math.nan),
            ):
                if not math.isnan(value):
                    per_prompt.setdefault(f"val/{source}/{name}/{view}@{n}", []).append(value)
    return {key: sum(values) / len(values) for key, values in sorted(per_prompt.items())}


def samples(batch: Batch, step: int, count: int) -> list[ValidationSample]:
    """The first ``count`` samples of a scored validation batch, images included."""
    return [
        ValidationSample(
            step=step,
            data_source=batch.data_sources[i],
            prompt=batch.prompt_texts[i],
            images=batch.images[i] if batch.images else [],
            response=conversation_text(batch.trajectories[i]),
            ground_truth=batch.ground_truths[i],
            scores={k: v[i] for k, v in batch.reward_metrics.items()},
        )
        for i in range(min(count, len(batch)))
    ]


def conversation_text(t) -> str:
    """A trajectory's response as a reader wants it: the response, or for a conversation every turn in order
    (``[image]`` where a tool or the environment showed one; the images themselves go with the sample)."""
    if not t.turn_ends:
        return t.response_text
    lines = []
    for m in t.messages:
        content = m.get("content")
        if isinstance(content, list):
            content = "".join("[image]" if c.get("type") == "image" else str(c.get("text", "")) for c in content)
        lines.append(f"[{m.get('role')}] {content}")
    return "\n".join(lines)
