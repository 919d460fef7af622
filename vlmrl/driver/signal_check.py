"""Warning, or failing, when a run has no learning signal: steps in a row whose updates cannot change the policy.

A run can go to its end, exit 0 and train nothing: a multi-turn run whose
model writes tool calls the parser cannot read gets reward 0 on every sample,
so every advantage is 0, ``pg_loss`` is 0 and nothing moves. ``SignalCheck``
is fed each step's metrics (``observe``) and looks for four causes, each
counted in steps in a row of its own:

* ``unparsed_calls``: every tool call of the step failed to parse
  (``agent/tool/parse_error_rate`` 1);
* ``no_tool_ran``: tools are configured and none ran (no call, or none that
  succeeded: ``agent/tool_calls/mean`` or ``agent/tool/success_rate`` 0);
* ``same_reward``: every sample scored the same (``critic/score/max`` equals
  ``critic/score/min``);
* ``zero_advantage``: no group has a non-zero advantage
  (``critic/advantages/max`` and ``/min`` both 0).

After ``WARN_AFTER`` steps in a row of one cause it warns once on the console
(logger ``vlmrl``), naming the cause and what to look at, unless a cause that
explains it holds too (``IMPLIED_BY``: calls that do not parse do not run, and
one reward for all gives every group a zero advantage); after
``trainer.fail_without_signal_steps`` steps in a row (when above 0) it raises
``NoLearningSignal``. A step without the cause ends its count.

A solved task is not a broken run: once the rewards have differed within a step
earlier in the run, a step whose every reward equals the best the run has seen
counts for neither ``same_reward`` nor ``zero_advantage`` (the quickstarts
reach that).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

log = logging.getLogger(__name__)

WARN_AFTER = 3
"""Steps in a row of one cause before the console warning."""

EPS = 1e-9
"""Below this, two rewards are the same and an advantage is 0."""


IMPLIED_BY = {"no_tool_ran": "unparsed_calls", "zero_advantage": "same_reward"}
"""A cause that follows from another: while the other holds, only the other is warned about."""


class NoLearningSignal(RuntimeError):
    """Several steps in a row had no learning signal and ``trainer.fail_without_signal_steps`` is reached."""


@dataclass(frozen=True)
class Cause:
    key: str
    what: str
    """What happened, after "steps a-b: "."""
    fix: str
    """Where to look."""


CAUSES = {
    c.key: c
    for c in (
        Cause(
            "unparsed_calls",
            "every tool call failed to parse (agent/tool/parse_error_rate=1)",
            "the model does not write calls in the format worker.rollout.multi_turn.format reads; log a few "
            "generations (trainer.val_generations_to_log) and compare them with the format, or name a parser "
            "that reads them (multi_turn.format=my_parser.py:parse)",
        ),
        Cause(
            "no_tool_ran",
            "no tool ran (agent/tool_calls/mean or agent/tool/success_rate is 0)",
            "check that the system prompt shows the tools (worker.rollout.multi_turn.tools), that the model calls "
            "them in the format multi_turn.format reads, and the tool errors in the logged generations",
        ),
        Cause(
            "same_reward",
            "every reward was the same",
            "check the reward function on a few of the logged generations (trainer.val_generations_to_log) and "
            "its key worker.reward.reward_function",
        ),
        Cause(
            "zero_advantage",
            "no group had a non-zero advantage (every sample of each prompt scored alike)",
            "raise worker.rollout.n or worker.rollout.temperature so that a prompt's samples differ, or use a "
            "reward that tells them apart",
        ),
    )
}


class SignalCheck:
    """Counts the steps in a row of each cause of no learning signal; warns, then fails when asked to."""

    def __init__(self, fail_after: int = 0, has_tools: bool = False, warn_after: int = WARN_AFTER):
        """``fail_after``: steps in a row that fail the run (0: never); ``has_tools``: the run's multi-turn rollouts
        have tools to call, so a step where none ran counts."""
        self.fail_after, self.has_tools, self.warn_after = fail_after, has_tools, warn_after
        self.since: dict[str, int] = {}
        """Each cause that held at the last step: the first step of its run of steps."""
        self.warned: set[str] = set()
        self.rewards_differed = False
        self.best_reward: float | None = None

    def observe(self, step: int, metrics: dict[str, float]) -> list[str]:
        """Record one step's metrics; return the causes that held at it. Warns or raises as the counts say."""
        held = self.causes(metrics)
        for key in list(self.since):
            if key not in held:
                del self.since[key]
                self.warned.discard(key)
        for key in held:
            self.since.setdefault(key, step)
        for key in held:
            first = self.since[key]
            count = step - first + 1
            if self.fail_after > 0 and count >= self.fail_after:
                raise NoLearningSignal(
                    self._message(key, first, step)
                    + f" (trainer.fail_without_signal_steps={self.fail_after}; 0 only warns)"
                )
            if count >= self.warn_after and key not in self.warned and IMPLIED_BY.get(key) not in held:
                self.warned.add(key)
                then = (
                    f"the run fails after {self.fail_after} such steps" if self.fail_after > 0
                    else "trainer.fail_without_signal_steps=N fails a run after N such steps"
                )
                log.warning("%s; nothing is learnt while this lasts (%s)", self._message(key, first, step), then)
        return held

    def causes(self, metrics: dict[str, float]) -> list[str]:
        """The causes of no learning signal that hold in one step's metrics, the most specific first."""
        held = []
        if metrics.get("agent/tool/parse_error_rate", 0.0) >= 1.0:
            held.append("unparsed_calls")
        if self.has_tools and "agent/tool_calls/mean" in metrics:
            if metrics["agent/tool_calls/mean"] == 0 or metrics.get("agent/tool/success_rate", 1.0) == 0:
                held.append("no_tool_ran")
        high, low = metrics.get("critic/score/max"), metrics.get("critic/score/min")
        if high is not None and low is not None:
            same = high - low <= EPS
            # Every reward the best the run has seen, after rewards that differed: the task is solved.
            solved = same and self.rewards_differed and self.best_reward is not None and low >= self.best_reward - EPS
            self.rewards_differed |= not same
            self.best_reward = high if self.best_reward is None else max(self.best_reward, high)
            if same and not solved:
                held.append("same_reward")
            adv_high, adv_low = metrics.get("critic/advantages/max"), metrics.get("critic/advantages/min")
            if not solved and adv_high is not None and adv_low is not None and max(abs(adv_high), abs(adv_low)) <= EPS:
                held.append("zero_advantage")
        return held

    def _message(self, key: str, first: int, last: int) -> str:
        cause = CAUSES[key]
        steps = f"step {first}" if first == last else f"steps {first}-{last} ({last - first + 1} in a row)"
        return f"no learning signal at {steps}: {cause.what}. Fix: {cause.fix}"
