"""Learning-rate schedules (vlmrl.train.lr_schedule): EasyR1's warm-up, constant and cosine rates, checked
against hand-derived numbers, the rule that picks the warm-up length, and the config rules around them.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers.configs import CPU, QUICKSTART, problems_of

from vlmrl.config import LRSchedulerType, OptimConfig
from vlmrl.plan import resolve
from vlmrl.train.actor import UpdateSettings
from vlmrl.train.critic import CriticSettings
from vlmrl.train.lr_schedule import LRSchedule, ScheduleState, set_lr
from vlmrl.validate import load_config

CONSTANT, COSINE = LRSchedulerType.constant, LRSchedulerType.cosine


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch, quickstart_assets):
    from helpers.runs import REPO

    monkeypatch.chdir(REPO)


def test_warmup_climbs_linearly_from_zero_and_reaches_the_peak_at_its_boundary():
    # w = 4 warm-up steps, constant after: factor(k) = k / 4 for k < 4, then 1.
    #   k = 0 -> 0 (the first update runs at lr 0, as in EasyR1), k = 3 -> 3/4 = 0.75, k = 4 -> 1.
    s = LRSchedule(peak_lr=2e-6, kind=CONSTANT, warmup_steps=4, training_steps=10)
    assert [s.factor(k) for k in range(6)] == [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]
    assert s.lr(3) == pytest.approx(1.5e-6)
    assert s.lr(4) == 2e-6


def test_cosine_starts_at_the_peak_after_warmup_and_ends_at_min_lr_ratio():
    # w = 2, T = 10, m = 0.1: after warm-up p = (k - 2) / 8 and
    # factor = 0.1 + 0.9 x (1 + cos(pi p)) / 2.
    #   k = 1 (warm-up): 1/2 = 0.5
    #   k = 2: p = 0, cos 0 = 1 -> 0.1 + 0.9 = 1.0 (the boundary: the peak)
    #   k = 6: p = 1/2, cos(pi/2) = 0 -> 0.1 + 0.45 = 0.55 (half way between peak and floor)
    #   k = 9 (the last step a 10-step run takes): p = 7/8, cos(7 pi / 8) = -0.92388 ->
    #         0.1 + 0.9 x 0.07612 / 2 = 0.134254
    #   k = 10: p = 1, cos pi = -1 -> 0.1 (the cosine's end: min_lr_ratio x lr)
    s = LRSchedule(peak_lr=1.0, kind=COSINE, warmup_steps=2, training_steps=10, min_lr_ratio=0.1)
    assert s.factor(1) == 0.5
    assert s.factor(2) == pytest.approx(1.0)
    assert s.factor(6) == pytest.approx(0.55)
    assert s.factor(9) == pytest.approx(0.1 + 0.9 * (1 - math.cos(math.pi / 8)) / 2)
    assert s.factor(9) == pytest.approx(0.134254, abs=1e-6)
    assert s.factor(10) == pytest.approx(0.1)


def test_the_cosine_over_a_whole_run_gives_every_update_easyr1s_and_verls_rate():
    # EasyR1 and verl build a LambdaLR from the same function and step it after each update, so update k
    # (k = 0 .. T-1) runs at factor(k): the cosine reaches its floor m at k = T, one past the last update.
    # The run: T = 2, no warm-up, m = 0.1, lr 1e-3. p = k / 2:
    #   k = 0: p = 0,   cos 0 = 1        -> 0.1 + 0.9 x 2 / 2 = 1.0   -> 1e-3
    #   k = 1: p = 1/2, cos(pi/2) = 0    -> 0.1 + 0.9 x 1 / 2 = 0.55  -> 5.5e-4 (the last update: not the floor)
    #   k = 2: p = 1,   cos pi = -1      -> 0.1                       -> 1e-4 (the floor, after the run)
    two = LRSchedule(peak_lr=1e-3, kind=COSINE, warmup_steps=0, training_steps=2, min_lr_ratio=0.1)
    assert [two.lr(k) for k in range(2)] == pytest.approx([1e-3, 5.5e-4], rel=1e-12)
    assert two.lr(2) == pytest.approx(1e-4, rel=1e-12)
    # T = 6, w = 2, m = 0.2: warm-up k / 2 for k < 2, then p = (k - 2) / 4 and
    # factor = 0.2 + 0.8 x (1 + cos(pi p)) / 2 = 0.6 + 0.4 cos(pi p):
    #   k = 0: 0/2 = 0 (the first update runs at 0)     k = 1: 1/2 = 0.5
    #   k = 2: p = 0,   cos 0 = 1            -> 1.0
    #   k = 3: p = 1/4, cos(pi/4) = 0.707107 -> 0.6 + 0.282843 = 0.882843
    #   k = 4: p = 1/2, cos(pi/2) = 0        -> 0.6
    #   k = 5: p = 3/4, cos(3pi/4) = -0.707107 -> 0.6 - 0.282843 = 0.317157 (the last update)
    #   k = 6: p = 1,   cos pi = -1          -> 0.2 (the floor, one past the last update)
    six = LRSchedule(peak_lr=1.0, kind=COSINE, warmup_steps=2, training_steps=6, min_lr_ratio=0.2)
    expected = [0.0, 0.5, 1.0, 0.882843, 0.6, 0.317157]
    assert [six.factor(k) for k in range(6)] == pytest.approx(expected, abs=1e-6)
    assert six.factor(6) == pytest.approx(0.2)
    # Constant, T = 4, w = 1: 0, then 1 for every later update.
    constant = LRSchedule(peak_lr=1.0, kind=CONSTANT, warmup_steps=1, training_steps=4)
    assert [constant.factor(k) for k in range(4)] == [0.0, 1.0, 1.0, 1.0]


def test_cosine_without_min_lr_ratio_decays_to_zero():
    # EasyR1 reads min_lr_ratio=null as 0: no warm-up, T = 4: factor(k) = (1 + cos(pi k / 4)) / 2,
    #   k = 2 -> 0.5, k = 4 -> 0.
    s = LRSchedule.from_optim(OptimConfig(lr=1.0, lr_scheduler_type=COSINE), training_steps=4)
    assert (s.warmup_steps, s.min_lr_ratio) == (0, 0.0)
    assert s.factor(0) == 1.0
    assert s.factor(2) == pytest.approx(0.5)
    assert s.factor(4) == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize(
    ("ratio", "steps", "training_steps", "warmup"),
    [
        (0.1, None, 25, 2),  # int(0.1 x 25) = int(2.5) = 2, EasyR1's truncation
        (0.5, None, 7, 3),  # int(3.5) = 3
        (0.1, 5, 25, 5),  # lr_warmup_steps wins over the ratio
        (0.9, 0, 25, 0),  # ... even when it is 0
        (0.0, None, 100, 0),
    ],
)
def test_warmup_steps_win_over_the_ratio_of_the_training_steps(ratio, steps, training_steps, warmup):
    optim = OptimConfig(lr_warmup_ratio=ratio, lr_warmup_steps=steps)
    assert LRSchedule.from_optim(optim, training_steps).warmup_steps == warmup


def test_set_lr_sets_every_parameter_group():
    params = [torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))]
    optimizer = torch.optim.AdamW([{"params": params[:1]}, {"params": params[1:]}], lr=1.0)
    set_lr(optimizer, 0.25)
    assert [g["lr"] for g in optimizer.param_groups] == [0.25, 0.25]


def test_schedule_state_round_trips_and_an_old_checkpoint_has_none(tmp_path):
    assert ScheduleState.load(tmp_path) is None
    ScheduleState(steps=7).save(tmp_path)
    assert ScheduleState.load(tmp_path) == ScheduleState(steps=7)


def test_the_driver_settings_carry_each_models_schedule_over_the_runs_training_steps():
    config = load_config(
        [
            QUICKSTART, "algorithm.adv_estimator=gae", "worker.critic.global_batch_size=16",
            "worker.actor.optim.lr_scheduler_type=cosine", "worker.actor.optim.lr_warmup_ratio=0.25",
            "worker.actor.optim.min_lr_ratio=0.2", "worker.critic.optim.lr=3e-6",
            "worker.critic.optim.lr_warmup_steps=1",
        ],
        CPU,
    )  # fmt: skip
    plan = resolve(config, CPU)
    actor = UpdateSettings.from_config(config, plan, training_steps=20).lr_schedule
    critic = CriticSettings.from_config(config, plan, training_steps=20).lr_schedule
    assert actor == LRSchedule(config.worker.actor.optim.lr, COSINE, warmup_steps=5, training_steps=20, min_lr_ratio=0.2)
    assert critic == LRSchedule(3e-6, CONSTANT, warmup_steps=1, training_steps=20)
    # Without the run's length (tests and benchmarks that build settings by hand) the optimizer's lr stays.
    assert UpdateSettings.from_config(config, plan).lr_schedule is None


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("worker.actor.optim.lr_warmup_ratio=1.5", "worker.actor.optim.lr_warmup_ratio=1.5: must be in [0, 1]"),
        ("worker.actor.optim.lr_warmup_steps=-1", "worker.actor.optim.lr_warmup_steps=-1: must be 0 or more"),
        ("worker.actor.optim.min_lr_ratio=2", "worker.actor.optim.min_lr_ratio=2: must be in [0, 1]"),
    ],
)
def test_schedule_keys_out_of_range_are_reported_with_their_value(override, expected):
    problems = problems_of(QUICKSTART, override)
    assert [p for p in problems if expected in p], problems


def test_the_critics_schedule_keys_are_checked_only_when_a_critic_trains():
    assert problems_of(
        QUICKSTART, "algorithm.adv_estimator=gae", "worker.critic.global_batch_size=16",
        "worker.critic.optim.lr_warmup_ratio=-0.1",
    ) == ["worker.critic.optim.lr_warmup_ratio=-0.1: must be in [0, 1] (the share of the training steps spent "
          "warming up)"]  # fmt: skip
    load_config([QUICKSTART, "worker.critic.optim.lr_warmup_ratio=-0.1"], CPU)  # GRPO: no critic, not read


def test_every_schedule_setting_validates_and_min_lr_ratio_without_cosine_is_a_note():
    config = load_config(
        [
            QUICKSTART, "worker.actor.optim.lr_scheduler_type=cosine", "worker.actor.optim.lr_warmup_ratio=0.1",
            "worker.actor.optim.lr_warmup_steps=3", "worker.actor.optim.min_lr_ratio=0.1",
        ],
        CPU,
    )  # fmt: skip
    assert not [n for n in resolve(config, CPU).notes if "min_lr_ratio" in n]
    constant = load_config([QUICKSTART, "worker.actor.optim.min_lr_ratio=0.1"], CPU)
    assert (
        "worker.actor.optim.min_lr_ratio=0.1: only the cosine schedule reads it "
        "(worker.actor.optim.lr_scheduler_type=constant)"
    ) in resolve(constant, CPU).notes
