"""A run with no learning signal is said on the console, naming the cause, and fails when asked to.

The run this guards against: a multi-turn run whose model writes tool calls
the parser cannot read. No tool runs, every reward is 0, every advantage is 0,
``pg_loss`` is 0, and the run would go to its end and exit 0 without a word.
The metrics here are the keys ``vlmrl.driver.metrics`` logs, written by hand.
"""

from __future__ import annotations

import logging

import pytest

from vlmrl.driver.signal_check import NoLearningSignal, SignalCheck


def _step(scores=(0.0, 1.0), advantages=(-0.7, 0.7), **agent):
    """One step's metrics: the per-sample score and per-token advantage ranges, and any agent/* keys."""
    metrics = {
        "critic/score/max": max(scores), "critic/score/min": min(scores),
        "critic/advantages/max": max(advantages), "critic/advantages/min": min(advantages),
    }  # fmt: skip
    metrics.update({k.replace("__", "/"): v for k, v in agent.items()})
    return metrics


# The run: every call fails to parse, so no tool runs, every reward is 0, every advantage 0.
UNPARSED = _step(
    scores=(0.0, 0.0), advantages=(0.0, 0.0),
    agent__tool_calls__mean=1.0, agent__tool__parse_error_rate=1.0, agent__tool__success_rate=0.0,
)  # fmt: skip


def test_the_unparsed_tool_calls_run_warns_once_after_three_steps_naming_every_cause(caplog):
    check = SignalCheck(has_tools=True)
    with caplog.at_level(logging.WARNING, logger="vlmrl"):
        for step in (1, 2):
            assert check.observe(step, UNPARSED) == ["unparsed_calls", "no_tool_ran", "same_reward", "zero_advantage"]
        assert not caplog.records  # two steps are not yet a pattern
        check.observe(3, UNPARSED)
        check.observe(4, UNPARSED)  # said once, not at every step
    text = [r.getMessage() for r in caplog.records]
    # Two warnings, not four: calls that do not parse do not run, and one reward gives no advantage anywhere.
    assert len(text) == 2, text
    assert text[0].startswith("no learning signal at steps 1-3 (3 in a row): every tool call failed to parse")
    assert "multi_turn.format" in text[0] and "trainer.fail_without_signal_steps" in text[0]
    assert "every reward was the same" in text[1]


def test_a_cause_is_warned_about_once_what_explained_it_stops(caplog):
    check = SignalCheck(has_tools=True)
    # Rewards differ (a sub-score pays for the answer), but no call parses and so no tool runs.
    unparsed = _step(agent__tool_calls__mean=1.0, agent__tool__parse_error_rate=1.0, agent__tool__success_rate=0.0)
    # The calls now parse, yet every one fails in the tool: no tool ran, said on its own.
    failing = _step(agent__tool_calls__mean=1.0, agent__tool__parse_error_rate=0.0, agent__tool__success_rate=0.0)
    with caplog.at_level(logging.WARNING, logger="vlmrl"):
        for step, metrics in enumerate((unparsed, unparsed, unparsed, failing), 1):
            check.observe(step, metrics)
    text = [r.getMessage() for r in caplog.records]
    assert len(text) == 2, text
    assert "steps 1-3 (3 in a row): every tool call failed to parse" in text[0]
    assert "steps 1-4 (4 in a row): no tool ran" in text[1]


def test_fail_without_signal_steps_fails_the_run_naming_the_steps_and_the_key():
    check = SignalCheck(fail_after=2, has_tools=True)
    check.observe(1, UNPARSED)
    with pytest.raises(NoLearningSignal, match=r"steps 1-2 \(2 in a row\): every tool call failed to parse.*"
                       r"trainer.fail_without_signal_steps=2"):  # fmt: skip
        check.observe(2, UNPARSED)


def test_a_step_with_signal_ends_the_count():
    check = SignalCheck(fail_after=3)
    same = _step(scores=(0.0, 0.0), advantages=(0.0, 0.0))
    check.observe(1, same)
    check.observe(2, same)
    assert check.observe(3, _step()) == []  # rewards differed: the count starts again
    check.observe(4, same)
    check.observe(5, same)
    with pytest.raises(NoLearningSignal, match="steps 4-6"):
        check.observe(6, same)


def test_each_cause_is_counted_on_its_own():
    # Rewards differ across prompts but each prompt's samples scored alike: no advantage, yet not one reward.
    check = SignalCheck(fail_after=2)
    alike = _step(scores=(0.0, 1.0), advantages=(0.0, 0.0))
    assert check.observe(1, alike) == ["zero_advantage"]
    with pytest.raises(NoLearningSignal, match="no group had a non-zero advantage"):
        check.observe(2, alike)


def test_no_call_at_all_is_no_tool_ran_only_when_the_run_has_tools():
    no_calls = _step(agent__tool_calls__mean=0.0)  # an environment run has no tools to call
    assert SignalCheck().causes(no_calls) == []
    assert SignalCheck(has_tools=True).causes(no_calls) == ["no_tool_ran"]
    ran = _step(agent__tool_calls__mean=0.9, agent__tool__parse_error_rate=0.1, agent__tool__success_rate=0.9)
    assert SignalCheck(has_tools=True).causes(ran) == []


def test_a_solved_task_is_not_a_run_without_signal(caplog):
    # The quickstarts end with every sample right: rewards all at the best the run has seen, after varied ones.
    check = SignalCheck(fail_after=2)
    check.observe(1, _step(scores=(0.0, 1.0)))
    solved = _step(scores=(1.0, 1.0), advantages=(0.0, 0.0))
    with caplog.at_level(logging.WARNING, logger="vlmrl"):
        for step in range(2, 8):
            assert check.observe(step, solved) == []
    assert not caplog.records
    # A collapse to a lower constant reward after learning is no signal again.
    with pytest.raises(NoLearningSignal, match="every reward was the same"):
        check.observe(8, _step(scores=(0.0, 0.0), advantages=(0.0, 0.0)))
        check.observe(9, _step(scores=(0.0, 0.0), advantages=(0.0, 0.0)))


def test_a_run_whose_rewards_never_differed_warns_even_at_its_best():
    check = SignalCheck(fail_after=2)
    check.observe(1, _step(scores=(1.0, 1.0), advantages=(0.0, 0.0)))
    with pytest.raises(NoLearningSignal, match="every reward was the same"):
        check.observe(2, _step(scores=(1.0, 1.0), advantages=(0.0, 0.0)))


def test_zero_never_fails():
    check = SignalCheck(fail_after=0, has_tools=True)
    for step in range(1, 30):
        check.observe(step, UNPARSED)


def test_a_negative_fail_without_signal_steps_is_refused():
    from vlmrl.config import ConfigError
    from vlmrl.validate import load_config

    with pytest.raises(ConfigError, match=r"trainer.fail_without_signal_steps=-1: must be 0 \(never fail"):
        load_config(["config=examples/quickstart.yaml", "trainer.fail_without_signal_steps=-1"])
