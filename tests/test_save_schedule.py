"""When a step saves: the step count, the time since the last save, the last step."""

from __future__ import annotations

from vlmrl.config import Config
from vlmrl.driver.save_schedule import SaveSchedule


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_default_config_saves_on_a_timer_and_bounds_a_step():
    # A run whose YAML sets neither loses at most the timer's worth of training to a kill, and a wedged
    # engine fails the run instead of hanging it.
    trainer = Config().trainer
    assert trainer.save_freq == -1
    assert trainer.save_every_minutes is not None and 0 < trainer.save_every_minutes <= 60
    assert trainer.step_timeout_s is not None and trainer.step_timeout_s >= 1800


def test_steps_save_every_save_freq_and_at_the_last_step():
    schedule = SaveSchedule(total_steps=7, save_freq=3, save_every_minutes=None, clock=Clock())
    assert [s for s in range(1, 8) if schedule.due(s)] == [3, 6, 7]


def test_a_step_saves_once_the_interval_has_passed_since_the_last_save():
    clock = Clock()
    schedule = SaveSchedule(total_steps=100, save_freq=-1, save_every_minutes=10, clock=clock)
    clock.now = 599.0  # 9 min 59 s: not yet
    assert not schedule.due(1)
    clock.now = 600.0  # 10 min since training started
    assert schedule.due(2)
    schedule.saved()
    clock.now = 1199.0  # 9 min 59 s since that save
    assert not schedule.due(3)
    clock.now = 1200.0
    assert schedule.due(4)


def test_a_step_count_save_restarts_the_timer():
    clock = Clock()
    schedule = SaveSchedule(total_steps=100, save_freq=5, save_every_minutes=10, clock=clock)
    clock.now = 590.0
    assert schedule.due(5)  # by the step count
    schedule.saved()
    clock.now = 1000.0  # 10 min after the start, but under 7 min after the save
    assert not schedule.due(6)


def test_no_timer_saves_only_by_count_and_at_the_end():
    clock = Clock()
    schedule = SaveSchedule(total_steps=4, save_freq=-1, save_every_minutes=None, clock=clock)
    clock.now = 1e9
    assert [s for s in range(1, 5) if schedule.due(s)] == [4]


def test_a_save_interval_that_is_not_positive_is_refused_with_the_fix():
    from helpers.configs import CPU, QUICKSTART, problems_of

    from vlmrl.validate import load_config

    for value in ("0", "-5", ".nan"):
        problems = problems_of(QUICKSTART, f"trainer.save_every_minutes={value}")
        assert any("trainer.save_every_minutes" in p and "positive number of minutes" in p for p in problems), problems
    assert load_config([QUICKSTART, "trainer.save_every_minutes=null"], CPU).trainer.save_every_minutes is None


def test_the_plan_says_when_the_run_saves_and_how_long_a_call_may_take():
    from helpers.configs import CPU, QUICKSTART

    from vlmrl.plan import describe, resolve
    from vlmrl.validate import load_config

    def plan_lines(*overrides):
        config = load_config([QUICKSTART, *overrides], CPU)
        return describe(resolve(config, CPU), config).splitlines()

    lines = plan_lines()
    assert "checkpoints: every 30 min of training, at the end and on SIGTERM/SIGINT; keeping all" in lines
    assert "step timeout: a worker call past 3600 s fails the run" in lines
    lines = plan_lines(
        "trainer.save_freq=5", "trainer.save_every_minutes=null", "trainer.save_limit=2", "trainer.step_timeout_s=null"
    )
    assert "checkpoints: every 5 steps, at the end and on SIGTERM/SIGINT; keeping the newest 2" in lines
    assert "step timeout: none (a hung call waits forever)" in lines
