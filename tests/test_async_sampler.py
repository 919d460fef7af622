"""The asynchronous sampler's admission and consumption, as pure logic (``vlmrl.driver.async_sampler``).

The workers and the reward actor are stand-ins here (the end-to-end runs in tests/test_async_e2e.py use
the real ones): generation stamps every token with the engine's current version, and scoring gives each
row its group id as reward, so the tests can follow which groups trained when. Versions are made to jump
by syncing twice between steps, which colocated training never does, to make groups stale on purpose.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vlmrl.driver.async_sampler import AsyncRolloutSampler
from vlmrl.driver.scoring import Rewards, ScoringJob, place_scores
from vlmrl.records import PromptSample, Trajectory
from vlmrl.records.views import to_batch
from vlmrl.rollout.engine import Sampling

N = 2  # samples per group


class Engines:
    """Generates N one-token samples per prompt, stamped with the current version."""

    def __init__(self):
        self.version = 0
        self.calls: list[list[int]] = []
        self.samplings: list[Sampling] = []
        self.call_versions: list[int] = []
        self.version_of: dict[int, int] = {}

    def generate(self, prompts, group_ids, sampling, keep=False):
        self.calls.append(list(group_ids))
        self.samplings.append(sampling)
        self.call_versions.append(self.version)
        self.version_of.update({g: self.version for g in group_ids})
        rows = []
        for p, g in zip(prompts, group_ids):
            for i in range(sampling.n):
                rows.append(
                    Trajectory(
                        token_ids=[1, 2, 7], prompt_length=2, loss_mask=[0, 0, 1],
                        position_ids=torch.arange(3).expand(3, 3), group_id=g, sample_id=f"{g}:{i}",
                        temperature=1.0, versions=[-1, -1, self.version], row_index=p.index,
                    )
                )  # fmt: skip
        return to_batch(rows, max_prompt_length=2, max_response_length=1, pad_token_id=0)


class Scorer:
    """Each row's reward is its group id (``parity``: the id's parity, 0 or 1), and ``collect`` counts its calls."""

    def __init__(self, parity=False):
        self.parity, self.collected = parity, 0

    def launch(self, batch):
        return ScoringJob(ref=None)

    def collect(self, job, batch, prefix="reward"):
        self.collected += 1
        scores = [g % 2 if self.parity else g for g in batch.group_ids.float().tolist()]
        return Rewards(place_scores(scores, batch.response_mask), {"overall": scores}, {f"{prefix}/timeouts": 0})


def _prompt(row: int) -> PromptSample:
    return PromptSample(
        index=row, raw_prompt_ids=[1, 2], input_ids=[1, 2], images=[], mm_inputs={}, ground_truth="", data_source="x",
        prompt_text=f"row {row}",
    )  # fmt: skip


def _sampler(eta, policy="drop", groups=2, estimator="grpo", filtering=False, max_tries=20, scorer=None):
    config = SimpleNamespace(
        data=SimpleNamespace(rollout_batch_size=groups, mini_rollout_batch_size=None),
        # Online filtering keeps a group whose mean reward is strictly inside (0.5, 1.5): with the parity
        # scorer, the odd groups (reward 1) train and the even ones (reward 0) are filtered out.
        algorithm=SimpleNamespace(
            adv_estimator=estimator, online_filtering=filtering, filter_key="overall", filter_low=0.5, filter_high=1.5
        ),
        trainer=SimpleNamespace(max_try_make_batch=max_tries),
        worker=SimpleNamespace(
            rollout=SimpleNamespace(
                async_rl=SimpleNamespace(
                    max_head_offpolicyness=eta, max_concurrent_rollouts=None, stale_policy=policy,
                    consume_order="admitted",
                )
            )
        ),
    )
    engines = Engines()
    next_id = iter(range(1000))
    rows = iter(range(1000))
    sampler = AsyncRolloutSampler(
        config, engines, scorer or Scorer(), Sampling(n=N, temperature=1.0, max_tokens=1),
        lambda k: [next(next_id) for _ in range(k)], _prompt,
    )  # fmt: skip
    more = lambda: [_prompt(next(rows)) for _ in range(groups)]  # noqa: E731
    return sampler, engines, more


def _step(sampler, engines, more, syncs=1):
    rollout = sampler.sample(more(), more)
    for _ in range(syncs):
        engines.version += 1
        sampler.weights_synced()
    return rollout


def test_eta_0_trains_each_steps_own_groups_at_the_version_that_sampled_them():
    sampler, engines, more = _sampler(eta=0)
    trained = [_step(sampler, engines, more).batch.group_ids.unique().tolist() for _ in range(3)]
    assert trained == [[0, 1], [2, 3], [4, 5]]
    assert engines.calls == [[0, 1], [2, 3], [4, 5]]  # one call per step, as the synchronous sampler makes


def test_eta_1_admits_a_step_ahead_and_trains_in_data_order():
    sampler, engines, more = _sampler(eta=1)
    first = _step(sampler, engines, more)
    # Step 1 at version 0: capacity (1 + 0 + 1) x 2 = 4 groups, the step's two and the next two, generated
    # in calls of a step's prompts as the synchronous sampler makes them.
    assert engines.calls == [[0, 1], [2, 3]]
    assert first.batch.group_ids.unique().tolist() == [0, 1] and first.on_policy
    second = _step(sampler, engines, more)
    assert engines.calls[2:] == [[4, 5]]  # version 1: (1 + 1 + 1) x 2 - 4 accepted = 2 more
    assert second.batch.group_ids.unique().tolist() == [2, 3]
    assert second.metrics["async/lag/max"] == 1 and not second.on_policy
    assert second.metrics["async/carried_over"] == 2
    # The rewards come when the step collects them (after its passes), in the batch's row order.
    rewards = second.collect()
    assert rewards.per_sample["overall"] == second.batch.group_ids.float().tolist() == [2.0, 2.0, 3.0, 3.0]
    assert rewards.token_level_scores[:, 0].tolist() == [2.0, 2.0, 3.0, 3.0]


@pytest.mark.parametrize("policy", ["drop", "requeue"])
def test_a_group_older_than_eta_never_trains_under_drop_or_requeue(policy):
    sampler, engines, more = _sampler(eta=1, policy=policy)
    _step(sampler, engines, more, syncs=2)  # groups 2, 3 were sampled at version 0; now it is 2
    rollout = _step(sampler, engines, more)
    versions = rollout.batch.policy_versions[rollout.batch.policy_versions >= 0]
    assert int((2 - versions).max()) <= 1  # no trained token older than eta = 1
    assert 2 not in rollout.batch.group_ids.tolist() and 3 not in rollout.batch.group_ids.tolist()
    assert rollout.metrics[f"async/stale_{policy}{'ped' if policy == 'drop' else 'd'}"] == 2
    pending = [tuple(p) for p in sampler.state()["pending"]]
    if policy == "requeue":  # their prompts wait again (or were generated again, at version 2), under new ids
        again = {row: g for row, g in pending if row in (2, 3)}
        assert sorted(again) == [2, 3] and not {2, 3} & set(again.values())
        assert all(engines.version_of.get(g, 2) == 2 for g in again.values())
    else:
        assert not {2, 3} & {row for row, _ in pending}


def test_under_accept_a_stale_group_trains_and_is_counted():
    sampler, engines, more = _sampler(eta=1, policy="accept")
    _step(sampler, engines, more, syncs=2)
    rollout = _step(sampler, engines, more)
    assert rollout.batch.group_ids.unique().tolist() == [2, 3]
    assert rollout.metrics["async/lag/max"] == 2 and rollout.metrics["async/stale_accepted"] == 2
    assert rollout.metrics["async/accepted_stale"] == 2


def test_a_checkpoint_keeps_the_groups_drawn_but_not_trained():
    sampler, engines, more = _sampler(eta=1)
    _step(sampler, engines, more)
    state = sampler.state()
    assert state["pending"] == [(2, 2), (3, 3)]  # (row, group id): admitted at step 1, trained at step 2
    again, engines2, _ = _sampler(eta=1)
    again.load_state(state)
    assert [(g.prompt.index, g.group_id) for g in again.waiting] == [(2, 2), (3, 3)]
    # Saved after the step's sync: version 1, two groups consumed, none running or waiting to train.
    assert again.manager.counters.consumed == 2 and again.manager.version == 1
    assert again.manager.counters.running == 0 and again.manager.queued == 0


# --------------------------------------------------------------------------- DAPO and ReMax under the bound


@pytest.mark.parametrize("eta", [0, 1])
def test_online_filtering_trains_only_groups_inside_the_bounds_and_still_fills_the_step(eta):
    sampler, engines, more = _sampler(eta=eta, filtering=True, scorer=Scorer(parity=True))
    for step in range(3):
        rollout = _step(sampler, engines, more)
        groups = rollout.batch.group_ids.unique().tolist()
        # Every trained group has its mean inside the bounds (odd ids: reward 1), and the step has its 2 groups.
        assert len(groups) == 2 and all(g % 2 == 1 for g in groups), (step, groups)
        assert rollout.collect().per_sample["overall"] == [1.0] * (2 * N)
        assert rollout.metrics["filter/kept_group_ratio"] == pytest.approx(0.5)
        # No trained token is older than the bound, filtering's extra admissions included.
        versions = rollout.batch.policy_versions[rollout.batch.policy_versions >= 0]
        assert int((rollout.version - versions).max()) <= eta
    # Each filtered group gave its slot back: admission went on (else the third step would have starved).
    assert sampler.manager.counters.rejected >= 6 and sampler.manager.counters.consumed == 6


def test_online_filtering_under_the_bound_gives_up_after_max_try_make_batch_steps_of_groups():
    from vlmrl.driver.sampler import OnlineFilteringError

    sampler, engines, more = _sampler(eta=1, filtering=True, max_tries=2, scorer=Scorer(parity=True))
    sampler.algo.filter_low = 5.0  # no group's mean is inside (5, 1.5)
    with pytest.raises(OnlineFilteringError, match="after 2 generation rounds only 0 of the 2"):
        _step(sampler, engines, more)


@pytest.mark.parametrize("eta", [0, 1])
def test_remax_samples_each_groups_greedy_baseline_with_the_weights_that_sampled_the_group(eta):
    sampler, engines, more = _sampler(eta=eta, estimator="remax")
    for _ in range(3):
        rollout = _step(sampler, engines, more, syncs=1)
        rewards = rollout.collect()
        # Each row's baseline is its group's greedy reward (the stand-in scores a row by its group id).
        assert rewards.baselines.tolist() == rollout.batch.group_ids.float().tolist()
        assert rewards.metrics["reward_baseline/overall"] == pytest.approx(rollout.batch.group_ids.float().mean())
    # Every greedy call (n=1, temperature 0) follows its groups' call at once, at the same engine version.
    calls = engines.calls
    assert calls[1::2] == calls[0::2] and len(calls) >= 6
    assert all(s.n == 1 and s.temperature == 0.0 for s in engines.samplings[1::2])
    assert engines.call_versions[1::2] == engines.call_versions[0::2]
