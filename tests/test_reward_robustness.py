"""A reward function is user code: it may raise, crash its process, hang or return garbage.

Each case must fail the step with an error that names the sample and what
happened, or (timeouts with on_timeout=zero) score 0 and be counted; none may
hang the step, and the manager must still work for the next step. Batch and
sequential managers must agree on the same inputs.
"""

from __future__ import annotations

import os
import textwrap
import time

import pytest

from vlmrl.reward.function import RewardFunctionError, RewardTimeout
from vlmrl.reward.manager import BatchFunctionRewardManager, RewardResult, SequentialFunctionRewardManager

# One module for every misbehaviour, chosen by the response text.
MISBEHAVING = """
    import os, sys, time

    def act(x):
        r = x["response"]
        if r == "raise":
            return {}["no such key"]
        if r == "exit":
            os._exit(7)
        if r == "sys.exit":
            sys.exit("user code called sys.exit")
        if r.startswith("sleep"):
            time.sleep(float(r.split()[1]))
        if r == "unpicklable":
            return {"overall": 1.0, "how": lambda: None}
        return {"overall": float(r == x["ground_truth"]), "pid": os.getpid()}

    def score(x):
        return act(x)

    def score_batch(xs):
        out = [act(x) for x in xs]
        return out
"""


def inputs(*responses: str, source: str = "geo") -> list[dict]:
    return [
        {"response": r, "response_length": len(r), "ground_truth": "yes", "data_source": source, "sample_id": i}
        for i, r in enumerate(responses)
    ]


@pytest.fixture
def spec(tmp_path):
    path = tmp_path / "misbehaving.py"
    path.write_text(textwrap.dedent(MISBEHAVING))
    return f"{path}:score"


def sub_scores_without_pid(result: RewardResult) -> RewardResult:
    return RewardResult(result.overall, {k: v for k, v in result.sub_scores.items() if k != "pid"}, result.timeouts)


# --------------------------------------------------------------------------- exceptions


def test_an_exception_names_the_sample_the_data_source_and_the_exception(spec, manager):
    m = manager(SequentialFunctionRewardManager, spec)
    with pytest.raises(RewardFunctionError) as info:
        m.compute(inputs("yes", "no", "raise", "yes", source="chartqa"))
    message = str(info.value)
    assert f"reward function {spec} raised on sample 2 (data source 'chartqa')" in message
    assert "KeyError: 'no such key'" in message
    assert "misbehaving.py" in message and "in act" in message  # the user's traceback
    assert m.compute(inputs("yes")).overall == [1.0]  # the next step works


def test_an_exception_in_a_batch_function_names_the_batch_and_its_sources(spec, manager):
    m = manager(BatchFunctionRewardManager, spec.replace(":score", ":score_batch"))
    batch = inputs("yes", "raise", source="geo") + inputs("no", source="chart")
    with pytest.raises(RewardFunctionError) as info:
        m.compute(batch)
    message = str(info.value)
    assert "raised on a batch of 3 samples (data sources: chart, geo)" in message
    assert "KeyError: 'no such key'" in message


def test_sys_exit_in_user_code_is_a_failed_call_not_an_exit(spec, manager):
    m = manager(SequentialFunctionRewardManager, spec)
    with pytest.raises(RewardFunctionError, match=r"sample 1 .*SystemExit: user code called sys.exit"):
        m.compute(inputs("yes", "sys.exit"))


def test_an_unpicklable_return_value_is_a_clear_error(spec, manager):
    with pytest.raises(RewardFunctionError, match=r"sample 0 .*cannot be sent back"):
        manager(SequentialFunctionRewardManager, spec).compute(inputs("unpicklable"))


# --------------------------------------------------------------------------- crashes


@pytest.mark.parametrize("cls", [SequentialFunctionRewardManager, BatchFunctionRewardManager])
def test_os_exit_in_user_code_is_reported_and_the_manager_recovers(spec, manager, cls):
    m = manager(cls, spec if cls is SequentialFunctionRewardManager else spec.replace(":score", ":score_batch"))
    with pytest.raises(RewardFunctionError) as info:
        m.compute(inputs("yes", "exit", "yes"))
    message = str(info.value)
    assert "crashed on" in message and "exited with code 7" in message
    if cls is SequentialFunctionRewardManager:
        assert "sample 1 (data source 'geo')" in message
    assert m.compute(inputs("yes", "no")).overall == [1.0, 0.0]  # a fresh process took its place


# --------------------------------------------------------------------------- timeouts


def test_a_call_past_the_timeout_fails_the_step_by_default(spec, manager):
    m = manager(SequentialFunctionRewardManager, spec, timeout=1.0)
    start = time.monotonic()
    with pytest.raises(RewardTimeout) as info:
        m.compute(inputs("yes", "sleep 60", "yes"))
    assert time.monotonic() - start < 15  # killed at the deadline, not after the 60 s sleep
    message = str(info.value)
    assert "ran past worker.reward.timeout=1.0s on sample 1 (data source 'geo')" in message
    assert "worker.reward.on_timeout=zero" in message  # the fix
    assert m.compute(inputs("yes")).overall == [1.0]


def test_with_on_timeout_zero_a_slow_call_scores_zero_and_is_counted(spec, manager):
    m = manager(SequentialFunctionRewardManager, spec, timeout=1.0, on_timeout="zero")
    start = time.monotonic()
    result = m.compute(inputs("yes", "sleep 60", "no", "sleep 60", "yes"))
    assert time.monotonic() - start < 20
    assert result.overall == [1.0, 0.0, 0.0, 0.0, 1.0]
    assert result.timeouts == [1, 3]
    assert result.sub_scores["pid"][1] == result.sub_scores["pid"][3] == 0.0  # every score of a timed-out sample is 0
    # The calls after a timeout ran in the fresh process that replaced the killed one.
    assert result.sub_scores["pid"][2] != result.sub_scores["pid"][0]


def test_a_call_that_finishes_within_the_timeout_is_kept(spec, manager):
    # The limit is per call, not per step: three 0.4 s calls pass a 1 s limit though they take 1.2 s together.
    m = manager(SequentialFunctionRewardManager, spec, timeout=1.0)
    result = m.compute(inputs("sleep 0.4", "sleep 0.4", "sleep 0.4"))
    assert result.overall == [0.0, 0.0, 0.0] and result.timeouts == []


def test_a_batch_call_past_the_timeout(spec, manager):
    batch_spec = spec.replace(":score", ":score_batch")
    with pytest.raises(RewardTimeout, match="on a batch of 2 samples"):
        manager(BatchFunctionRewardManager, batch_spec, timeout=1.0).compute(inputs("yes", "sleep 60"))
    zero = manager(BatchFunctionRewardManager, batch_spec, timeout=1.0, on_timeout="zero")
    assert zero.compute(inputs("yes", "sleep 60")) == RewardResult([0.0, 0.0], {}, [0, 1])
    assert zero.compute(inputs("yes")).overall == [1.0]


# --------------------------------------------------------------------------- parallel and parity


def test_sequential_calls_spread_over_num_cpus_processes_in_order(spec, manager):
    m = manager(SequentialFunctionRewardManager, spec, num_cpus=2)
    batch = inputs(*["yes", "no"] * 4, "sleep 0.3", "sleep 0.3")
    result = m.compute(batch)
    assert result.overall == [1.0, 0.0] * 4 + [0.0, 0.0]  # in sample order
    pids = set(result.sub_scores["pid"])
    assert len(pids) == 2 and os.getpid() not in pids  # two reward processes, neither of them this one


def test_batch_and_sequential_managers_agree(spec, manager):
    batch = inputs("yes", "no", "YES", "", "yes", source="a") + inputs("no", "yes", source="b")
    sequential = manager(SequentialFunctionRewardManager, spec, num_cpus=2).compute(batch)
    batched = manager(BatchFunctionRewardManager, spec.replace(":score", ":score_batch")).compute(batch)
    assert sub_scores_without_pid(sequential) == sub_scores_without_pid(batched)
    assert sequential.overall == [1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 1.0]
