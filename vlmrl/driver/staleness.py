"""Bounded staleness for asynchronous RL: which prompt groups may start, and which may train.

The unit is the GRPO prompt group: it is admitted, generated, scored and
trained as a whole. Two checks bound how stale a trained token may be, in
policy versions, by ``eta = max_head_offpolicyness``:

* **Admission** (AReaL's ``StalenessManager``). With ``v`` the current
  version, ``B`` groups per step and ``C`` ``max_concurrent_rollouts``::

      capacity = max(0, min(C - running, (eta + v + 1) B - (accepted + running)))

  Each step consumes ``B`` groups, so about ``v B`` have been consumed by
  version ``v``, and the rule keeps at most ``(eta + 1) B`` groups in flight or
  waiting. That bounds the *count* of outstanding groups, not their age: a
  slow group admitted at ``v`` can still be generating long after ``v + eta``
  while faster ones fill the batches (AReaL issue #602).
* **Consumption** (``check``): the oldest generated token of a group must be
  at most ``eta`` versions behind the version that trains it. A group that is
  not is dropped, requeued (its prompt waits for a new admission), or accepted
  and counted as a violation (``StalePolicy``). Dropped and requeued groups
  give their admission slot back; otherwise they would use up the budget and
  admission would starve.

Counters (``StalenessCounters``): ``accepted`` counts the groups finished and
kept since version 0, consumed or still waiting for the trainer; ``consumed``
those handed to the trainer, so ``accepted - consumed`` is the queue.

Resume (AReaL issue #1388): a checkpoint holds the version and the cumulative
counters, never in-flight work. After ``load_state_dict`` ``running`` and
``enqueued`` are 0 and ``accepted`` equals ``consumed``, because the groups
that were queued but not consumed are not in the checkpoint and will be
generated again. Restoring ``accepted`` as it was would count them twice and
starve admission; restoring the version with ``accepted = 0`` would admit a
burst of ``(eta + v + 1) B`` groups. With ``consumed = v B`` the capacity right
after resume is ``min(C, (eta + 1) B)``, as in an uninterrupted run.

Pure Python, single-threaded: the caller serialises calls (no locks, no Ray).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass

from vlmrl.algos.common import ConfigEnum
from vlmrl.config import StalePolicy  # an option of the config: defined there, used here


class StaleAction(ConfigEnum):
    """``check``'s decision for one group."""

    train = "train"
    drop = "drop"
    requeue = "requeue"


@dataclass(frozen=True)
class Consumption:
    """The outcome of ``StalenessManager.check`` for one group."""

    action: StaleAction
    lag: int
    """Versions between the group's oldest generated token and the version that trains it."""
    stale: bool
    """``lag > eta``; with ``StalePolicy.accept`` a stale group still has ``action == train``."""


@dataclass
class StalenessCounters:
    """The manager's counters, in prompt groups."""

    enqueued: int = 0
    """Waiting for admission."""
    running: int = 0
    """Admitted and not yet finished (generating or being scored)."""
    accepted: int = 0
    """Finished and kept since version 0: consumed, or waiting for the trainer."""
    rejected: int = 0
    """Finished or abandoned without being kept (filtered, failed, cancelled)."""
    consumed: int = 0
    """Handed to the trainer (fresh, or stale under ``StalePolicy.accept``)."""
    dropped: int = 0
    """Stale at consumption and discarded (``StalePolicy.drop``)."""
    requeued: int = 0
    """Stale at consumption and put back to wait (``StalePolicy.requeue``)."""
    accepted_stale: int = 0
    """Stale at consumption and trained anyway (``StalePolicy.accept``): bound violations."""


# The counters a checkpoint keeps; enqueued, running and accepted are derived on load.
_SAVED_COUNTERS = ("consumed", "rejected", "dropped", "requeued", "accepted_stale")


def oldest_token_lag(token_versions: Iterable[int], current_version: int) -> int:
    """Versions between the oldest generated token and ``current_version``; 0 if nothing was generated.

    Args:
        token_versions: the policy version of each token of a group (every
            sample's), -1 (any negative) on context tokens, which are ignored.
        current_version: the version of the weights that will train them.

    Raises:
        ValueError: a token is newer than ``current_version`` (versions are out of step).
    """
    generated = [int(v) for v in token_versions if int(v) >= 0]
    if not generated:
        return 0
    if max(generated) > current_version:
        raise ValueError(
            f"a token carries version {max(generated)}, newer than the training version {current_version}: "
            "the sampler's and the trainer's versions are out of step"
        )
    return current_version - min(generated)


class StalenessManager:
    """Admission and consumption of prompt groups under ``max_head_offpolicyness``; see the module docstring.

    Call order for one group: ``enqueue`` -> ``start`` (when ``capacity() > 0``)
    -> ``finish`` or ``reject`` -> ``check`` when the trainer takes it. After
    each weight update, ``set_version``.

    Args:
        groups_per_step: ``B``, prompt groups one training step consumes.
        max_concurrent_rollouts: ``C``, groups running at once.
        max_head_offpolicyness: ``eta`` >= 0; 0 is the synchronous schedule.
        stale_policy: what ``check`` does with a stale group.
        version: the starting policy version.
    """

    def __init__(
        self,
        groups_per_step: int,
        max_concurrent_rollouts: int,
        max_head_offpolicyness: int,
        stale_policy: StalePolicy | str = StalePolicy.drop,
        version: int = 0,
    ):
        problems = [
            f"{name} must be {bound}; got {value}"
            for name, value, ok, bound in (
                ("groups_per_step", groups_per_step, groups_per_step >= 1, ">= 1"),
                ("max_concurrent_rollouts", max_concurrent_rollouts, max_concurrent_rollouts >= 1, ">= 1"),
                ("max_head_offpolicyness", max_head_offpolicyness, max_head_offpolicyness >= 0, ">= 0"),
                ("version", version, version >= 0, ">= 0"),
            )
            if not ok
        ]
        if problems:
            raise ValueError("StalenessManager: " + "; ".join(problems))
        self.groups_per_step = groups_per_step
        self.max_concurrent_rollouts = max_concurrent_rollouts
        self.max_head_offpolicyness = max_head_offpolicyness
        self.stale_policy = StalePolicy(stale_policy)
        self.version = version
        self.counters = StalenessCounters()

    # ----------------------------------------------------------------------- admission

    @property
    def queued(self) -> int:
        """Groups finished and kept, waiting for the trainer."""
        return self.counters.accepted - self.counters.consumed

    def capacity(self) -> int:
        """How many more groups may start now: ``max(0, min(C - running, (eta + v + 1) B - (accepted + running)))``."""
        c = self.counters
        concurrency = self.max_concurrent_rollouts - c.running
        staleness = (self.max_head_offpolicyness + self.version + 1) * self.groups_per_step - (c.accepted + c.running)
        return max(0, min(concurrency, staleness))

    def enqueue(self, n: int = 1) -> None:
        """``n`` groups are waiting for admission."""
        if n < 0:
            raise ValueError(f"enqueue: n must be >= 0; got {n}")
        self.counters.enqueued += n

    def start(self) -> None:
        """Admit one waiting group (the caller checked ``capacity()``; admitting past it is a bug)."""
        if self.counters.enqueued < 1:
            raise RuntimeError("start: no group is enqueued")
        if self.capacity() < 1:
            raise RuntimeError(f"start: no capacity ({self._describe()})")
        self.counters.enqueued -= 1
        self.counters.running += 1

    def finish(self) -> None:
        """A running group is done and kept: it waits for the trainer."""
        self._leave_running("finish")
        self.counters.accepted += 1

    def reject(self) -> None:
        """A running group is done but not kept (filtered out, failed, or abandoned): its slot is free again."""
        self._leave_running("reject")
        self.counters.rejected += 1

    def _leave_running(self, what: str) -> None:
        if self.counters.running < 1:
            raise RuntimeError(f"{what}: no group is running")
        self.counters.running -= 1

    def set_version(self, version: int) -> None:
        """The weights of ``version`` are in place (after an update); versions never go back."""
        if version < self.version:
            raise ValueError(f"set_version: versions only grow; {version} < current {self.version}")
        self.version = version

    # ----------------------------------------------------------------------- consumption

    def would_train(self, token_versions: Iterable[int], current_version: int) -> bool:
        """Whether ``check`` would train this group (fresh, or stale under ``StalePolicy.accept``); records nothing."""
        stale = oldest_token_lag(token_versions, current_version) > self.max_head_offpolicyness
        return not stale or self.stale_policy is StalePolicy.accept

    def filter_out(self) -> None:
        """A finished group waiting for the trainer is not trained (online filtering): its slot is free again, so
        admission can start another in its place."""
        if self.queued < 1:
            raise RuntimeError(f"filter_out: no finished group is waiting ({self._describe()})")
        self.counters.accepted -= 1
        self.counters.rejected += 1

    def check(self, token_versions: Iterable[int], current_version: int) -> Consumption:
        """Decide whether one finished group may train at ``current_version``, and record the decision.

        Fresh (``lag <= eta``) groups train. A stale one follows the policy:
        ``drop`` and ``requeue`` take it out of ``accepted`` (freeing its slot;
        ``requeue`` also adds it to ``enqueued``), ``accept`` trains it and
        counts ``accepted_stale``. A trained group is ``consumed``.

        Args:
            token_versions: the versions of every token of the group's samples, -1 on context.
            current_version: the version of the weights that will train it (normally ``self.version``).

        Returns:
            The action, the lag of the oldest token, and whether it was stale.
        """
        if self.queued < 1:
            raise RuntimeError(f"check: no finished group is waiting ({self._describe()})")
        lag = oldest_token_lag(token_versions, current_version)
        stale = lag > self.max_head_offpolicyness
        c = self.counters
        if not stale or self.stale_policy is StalePolicy.accept:
            c.consumed += 1
            c.accepted_stale += int(stale)
            return Consumption(StaleAction.train, lag, stale)
        c.accepted -= 1
        if self.stale_policy is StalePolicy.drop:
            c.dropped += 1
            return Consumption(StaleAction.drop, lag, stale)
        c.requeued += 1
        c.enqueued += 1
        return Consumption(StaleAction.requeue, lag, stale)

    # ----------------------------------------------------------------------- metrics and checkpoints

    def stats(self) -> dict[str, int]:
        """The counters, the queue, the capacity and the version, for logging."""
        return {**asdict(self.counters), "queued": self.queued, "capacity": self.capacity(), "version": self.version}

    def state_dict(self) -> dict[str, int]:
        """The version and the cumulative counters; in-flight and queued groups are not saved."""
        return {"version": self.version, **{k: getattr(self.counters, k) for k in _SAVED_COUNTERS}}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore a checkpoint: nothing running or waiting, ``accepted = consumed`` (see the module docstring)."""
        missing = [k for k in ("version", *_SAVED_COUNTERS) if k not in state]
        if missing:
            raise KeyError(f"staleness state is missing {missing}; it has {sorted(state)}")
        counters = StalenessCounters(**{k: int(state[k]) for k in _SAVED_COUNTERS})
        counters.accepted = counters.consumed
        self.counters = counters
        self.version = int(state["version"])

    def _describe(self) -> str:
        c = self.counters
        return (
            f"version={self.version}, running={c.running}, accepted={c.accepted}, consumed={c.consumed}, "
            f"B={self.groups_per_step}, C={self.max_concurrent_rollouts}, eta={self.max_head_offpolicyness}"
        )
