"""Unit tests of vlmrl.driver.staleness: admission, the consumption check, and resume.

Hand-worked admission sequences, then a seeded pure-Python event simulation
of rollouts with heavy-tailed durations feeding a trainer, which checks the
bound the manager promises: no trained token older than ``eta`` versions.
Notation: ``B`` groups per step, ``C`` max concurrent, ``eta`` max head
off-policyness, ``v`` version.
"""

import heapq
import itertools
import random
from collections import Counter, deque
from dataclasses import dataclass, field

import pytest

from vlmrl.driver.staleness import (
    StaleAction,
    StalenessManager,
    StalePolicy,
    oldest_token_lag,
)


def start(manager, n):
    for _ in range(n):
        manager.start()


# --------------------------------------------------------------------------- admission, by hand


def test_eta_0_admits_b_groups_per_version():
    # B = 2, C = 3, eta = 0: capacity = min(C - running, (v + 1) B - (accepted + running)).
    m = StalenessManager(groups_per_step=2, max_concurrent_rollouts=3, max_head_offpolicyness=0)
    m.enqueue(10)
    assert m.capacity() == 2  # min(3 - 0, 1*2 - 0)
    start(m, 2)
    assert m.capacity() == 0  # min(1, 2 - 2)
    m.finish()
    m.finish()
    assert m.capacity() == 0  # min(3, 2 - 2): nothing more until the batch trains
    assert [m.check([-1, 0, 0], 0).action for _ in range(2)] == [StaleAction.train] * 2
    assert m.capacity() == 0  # consumed, but still version 0
    m.set_version(1)
    assert m.capacity() == 2  # min(3, 2*2 - 2)
    with pytest.raises(RuntimeError, match="no capacity"):
        start(m, 3)


def test_eta_1_hand_sequence():
    # B = 2, C = 3, eta = 1: the budget is (v + 2) * 2 groups, accepted + running.
    m = StalenessManager(groups_per_step=2, max_concurrent_rollouts=3, max_head_offpolicyness=1)
    m.enqueue(10)
    assert m.capacity() == 3  # min(3, 4 - 0): concurrency binds
    start(m, 3)
    assert m.capacity() == 0  # min(0, 4 - 3)
    m.finish()
    assert m.capacity() == 1  # min(3 - 2, 4 - (1 + 2))
    start(m, 1)
    assert m.capacity() == 0  # min(0, 4 - (1 + 3))
    m.finish()
    m.finish()
    assert m.capacity() == 0  # min(2, 4 - (3 + 1)): one step ahead is the limit
    m.check([0], 0)
    m.check([0], 0)
    m.set_version(1)
    assert m.capacity() == 2  # min(2, 6 - (3 + 1))
    m.reject()  # the last running group is filtered out: its slot comes back
    assert m.capacity() == 3  # min(3, 6 - (3 + 0))
    assert (m.counters.accepted, m.counters.running, m.counters.rejected) == (3, 0, 1)


def test_eta_2_hand_sequence():
    # B = 2, C = 3, eta = 2: budget (v + 3) * 2.
    m = StalenessManager(groups_per_step=2, max_concurrent_rollouts=3, max_head_offpolicyness=2)
    m.enqueue(10)
    assert m.capacity() == 3  # min(3, 6)
    start(m, 3)
    for _ in range(3):
        m.finish()
    assert m.capacity() == 3  # min(3, 6 - 3)
    start(m, 3)
    for _ in range(3):
        m.finish()
    assert m.capacity() == 0  # min(3, 6 - 6): two steps of work ahead of the trainer
    m.check([0], 0)
    m.check([0], 0)
    m.set_version(1)
    assert m.capacity() == 2  # min(3, 8 - 6)
    assert m.queued == 4


def test_call_order_is_enforced():
    m = StalenessManager(groups_per_step=1, max_concurrent_rollouts=1, max_head_offpolicyness=0)
    with pytest.raises(RuntimeError, match="no group is enqueued"):
        m.start()
    with pytest.raises(RuntimeError, match="no group is running"):
        m.finish()
    with pytest.raises(RuntimeError, match="no finished group is waiting"):
        m.check([0], 0)
    with pytest.raises(ValueError, match="versions only grow"):
        m.set_version(1) or m.set_version(0)
    with pytest.raises(ValueError, match="groups_per_step must be >= 1.*max_head_offpolicyness must be >= 0"):
        StalenessManager(groups_per_step=0, max_concurrent_rollouts=1, max_head_offpolicyness=-1)
    with pytest.raises(ValueError, match="'keep'.*choose one of"):
        StalenessManager(1, 1, 0, stale_policy="keep")


# --------------------------------------------------------------------------- the consumption check, by hand


def test_oldest_token_lag():
    assert oldest_token_lag([-1, -1, 4, 5], 5) == 1  # context ignored; oldest generated token is version 4
    assert oldest_token_lag([-1, -1], 7) == 0  # nothing generated
    with pytest.raises(ValueError, match="newer than the training version"):
        oldest_token_lag([6], 5)


@pytest.mark.parametrize(
    ("policy", "action", "counts"),
    [
        # counts: (accepted, consumed, enqueued, dropped, requeued, accepted_stale) after one fresh + one stale group
        (StalePolicy.drop, StaleAction.drop, (1, 1, 0, 1, 0, 0)),
        (StalePolicy.requeue, StaleAction.requeue, (1, 1, 1, 0, 1, 0)),
        (StalePolicy.accept, StaleAction.train, (2, 2, 0, 0, 0, 1)),
    ],
)
def test_check_applies_the_stale_policy(policy, action, counts):
    # eta = 1, trained at version 5: versions [4, 5] -> lag 1, fresh; [3, 4, 5] -> lag 2 > 1, stale.
    m = StalenessManager(groups_per_step=2, max_concurrent_rollouts=4, max_head_offpolicyness=1, stale_policy=policy)
    m.enqueue(2)
    start(m, 2)
    m.finish()
    m.finish()
    fresh = m.check([-1, 4, 5], 5)
    assert (fresh.action, fresh.lag, fresh.stale) == (StaleAction.train, 1, False)
    stale = m.check([-1, 3, 4, 5], 5)
    assert (stale.action, stale.lag, stale.stale) == (action, 2, True)
    c = m.counters
    assert (c.accepted, c.consumed, c.enqueued, c.dropped, c.requeued, c.accepted_stale) == counts
    # drop and requeue give the slot back: at version 0 the budget is (1 + 0 + 1) * 2 = 4 - accepted.
    assert m.capacity() == 4 - counts[0]


# --------------------------------------------------------------------------- event simulation


@dataclass
class SimResult:
    trained_lags: list[int] = field(default_factory=list)
    admitted_per_version: Counter = field(default_factory=Counter)
    max_outstanding: int = 0
    """Most groups running or waiting at once."""
    in_flight_at_end: int = 0


def simulate(manager: StalenessManager, steps: int, seed: int, train_time=1.0, scale=0.3, shape=1.1) -> SimResult:
    """Rollouts with Pareto(shape) * scale durations feed a trainer that consumes B groups per step.

    Partial rollouts: a group started at version a and finished at b carries tokens of
    every version a..b (its oldest token is version a). The trainer, when idle, takes
    finished groups first come first served through ``check`` until it has B, trains
    for ``train_time`` and then moves to the next version. The simulation stops right
    after the ``steps``-th update, with groups still in flight, as a checkpoint would.
    """
    rng = random.Random(seed)
    events: list[tuple[float, int, int]] = []  # (finish time, group id, start version)
    finished: deque[list[int]] = deque()
    order = itertools.count()
    b = manager.groups_per_step
    result = SimResult()
    now, done, batch, training_until = 0.0, 0, [], None

    def admit():
        while manager.capacity() > 0:
            if manager.counters.enqueued == 0:
                manager.enqueue(1)  # an endless dataset
            manager.start()
            result.admitted_per_version[manager.version] += 1
            heapq.heappush(events, (now + scale * rng.paretovariate(shape), next(order), manager.version))

    def take():
        while finished and len(batch) < b:
            out = manager.check(finished.popleft(), manager.version)
            if out.action is StaleAction.train:
                batch.append(out.lag)

    admit()
    while done < steps:
        take()
        if training_until is None and len(batch) == b:
            training_until = now + train_time
        next_finish = events[0][0] if events else float("inf")
        if training_until is not None and training_until <= next_finish:
            now, training_until = training_until, None
            result.trained_lags += batch
            batch.clear()
            done += 1
            manager.set_version(manager.version + 1)
        else:
            assert events, "nothing running and no batch: admission starved"
            now, _, started = heapq.heappop(events)
            manager.finish()
            finished.append(list(range(started, manager.version + 1)))
        admit()
        # The manager's books match the simulated world: a dropped group must not linger as "queued".
        assert (manager.counters.running, manager.queued) == (len(events), len(finished))
        result.max_outstanding = max(result.max_outstanding, manager.counters.running + manager.queued)
    result.in_flight_at_end = manager.counters.running + manager.queued
    return result


@pytest.mark.parametrize("eta", [1, 2])
@pytest.mark.parametrize("policy", [StalePolicy.drop, StalePolicy.requeue])
def test_no_trained_token_is_older_than_eta(eta, policy):
    m = StalenessManager(groups_per_step=4, max_concurrent_rollouts=16, max_head_offpolicyness=eta, stale_policy=policy)
    result = simulate(m, steps=60, seed=eta)
    assert len(result.trained_lags) == 60 * 4
    assert max(result.trained_lags) <= eta
    # Admission alone leaks (AReaL #602): the check had stale groups to catch.
    assert m.counters.dropped + m.counters.requeued > 0
    assert m.counters.accepted_stale == 0
    # Admission still bounds the work ahead of the trainer: at most (eta + 1) B groups.
    assert result.max_outstanding <= (eta + 1) * 4


@pytest.mark.parametrize("eta", [1, 2])
def test_accept_trains_stale_groups_and_counts_them(eta):
    m = StalenessManager(4, 16, eta, stale_policy=StalePolicy.accept)
    result = simulate(m, steps=60, seed=eta)
    violations = sum(lag > eta for lag in result.trained_lags)
    assert violations > 0
    assert m.counters.accepted_stale == violations
    assert m.counters.dropped == m.counters.requeued == 0


def test_eta_0_is_the_synchronous_schedule():
    # Heavy tails or not, eta = 0 admits exactly B groups per version, all trained at lag 0.
    m = StalenessManager(groups_per_step=4, max_concurrent_rollouts=16, max_head_offpolicyness=0)
    result = simulate(m, steps=20, seed=0)
    assert result.admitted_per_version == Counter({v: 4 for v in range(21)})  # version 20: the next step's
    assert set(result.trained_lags) == {0}
    assert (m.counters.dropped, m.counters.requeued, m.counters.accepted_stale) == (0, 0, 0)


# --------------------------------------------------------------------------- resume


@pytest.mark.parametrize("policy", [StalePolicy.drop, StalePolicy.requeue])
def test_resume_keeps_the_bound(policy):
    eta, b, c = 1, 4, 16
    before = StalenessManager(b, c, eta, stale_policy=policy)
    first = simulate(before, steps=25, seed=7)
    assert first.in_flight_at_end > 0  # the checkpoint is taken with work in flight
    state = before.state_dict()
    assert state["version"] == 25 and state["consumed"] == 25 * b

    after = StalenessManager(b, c, eta, stale_policy=policy)
    after.load_state_dict(state)
    assert after.state_dict() == state
    # In-flight work is not restored (AReaL #1388), and accepted = consumed (the queue is gone).
    assert (after.counters.running, after.counters.enqueued, after.queued) == (0, 0, 0)
    assert after.counters.accepted == after.counters.consumed == 25 * b
    # The first admission after resume is (eta + 1) B, as at the start of a run, not (eta + v + 1) B.
    assert after.capacity() == min(c, (eta + 1) * b)

    second = simulate(after, steps=25, seed=8)
    assert max(second.trained_lags) <= eta
    assert second.max_outstanding <= (eta + 1) * b
    assert after.version == 50


def test_load_state_dict_names_missing_keys():
    m = StalenessManager(1, 1, 0)
    with pytest.raises(KeyError, match="missing \\['consumed'"):
        m.load_state_dict({"version": 3})
