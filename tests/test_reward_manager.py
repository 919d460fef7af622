"""Unit tests of vlmrl.reward: loading user reward functions and the managers that run them.

Reward functions are user code: every way it can be wrong (missing file or
function, bad REWARD_TYPE, kwargs that do not fit, a malformed or non-finite
score) must fail with a message that names the function, and kwargs must be
checked when the manager starts, not at the first step. The managers here run
the function in their reward processes, as they do inside the Ray actors;
tests/test_reward_robustness.py covers exceptions, crashes and timeouts.
"""

import itertools
import textwrap
from pathlib import Path

import pytest

from vlmrl.config import RewardManagerType
from vlmrl.reward.function import RewardFunctionError, load_reward_function
from vlmrl.reward.manager import (
    REWARD_MANAGERS,
    BatchFunctionRewardManager,
    RewardResult,
    SequentialFunctionRewardManager,
    manager_class,
)

REPO = Path(__file__).resolve().parents[1]
_counter = itertools.count()


def write_module(directory: Path, source: str, name: str | None = None) -> Path:
    path = directory / f"{name or 'reward_fn'}.py"
    path.write_text(textwrap.dedent(source))
    return path


@pytest.fixture
def package(tmp_path, monkeypatch):
    """A uniquely named package ``<pkg>`` on sys.path; returns a writer of ``<pkg>.<module>``."""
    name = f"vlmrl_test_rewards_{next(_counter)}"
    (tmp_path / name).mkdir()
    (tmp_path / name / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))

    def write(module: str, source: str) -> str:
        write_module(tmp_path / name, source, module)
        return f"{name}.{module}"

    return write


def inputs(*responses: str) -> list[dict]:
    return [
        {
            "response": r,
            "response_length": len(r),
            "ground_truth": "yes",
            "prompt": "p",
            "data_source": "d",
            "sample_id": i,
        }
        for i, r in enumerate(responses)
    ]


SEQUENTIAL = """
    def score(reward_input, bonus=0.0):
        hit = float(reward_input["response"] == reward_input["ground_truth"])
        out = {"overall": hit + bonus, "accuracy": hit}
        if reward_input["sample_id"] % 2 == 0:
            out["length"] = reward_input["response_length"]  # only on even samples
        return out
"""

BATCH = """
    REWARD_TYPE = "batch"

    def score(reward_inputs, scale=1.0):
        out = []
        for x in reward_inputs:
            hit = float(x["response"] == x["ground_truth"])
            row = {"overall": scale * hit}
            if hit:
                row["hit_only"] = 1.0  # absent for misses
            out.append(row)
        return out
"""


# --------------------------------------------------------------------------- loading


def test_load_from_a_file_path(tmp_path):
    path = write_module(tmp_path, SEQUENTIAL)
    fn, declared = load_reward_function(f"{path}:score")
    assert fn({"response": "yes", "ground_truth": "yes", "sample_id": 1, "response_length": 3}) == {
        "overall": 1.0,
        "accuracy": 1.0,
    }
    assert declared is None


def test_load_from_a_package_module(package):
    module = package("scores", BATCH)
    fn, declared = load_reward_function(f"{module}:score")
    assert fn(inputs("yes"), scale=2.0) == [{"overall": 2.0, "hit_only": 1.0}]
    assert declared is RewardManagerType.batch


def test_load_from_the_reward_functions_namespace_folder(monkeypatch):
    # reward_functions/ has no __init__.py: it imports as a namespace package from the repo root.
    monkeypatch.syspath_prepend(str(REPO))
    fn, declared = load_reward_function("reward_functions.synthetic_colour:compute_score")
    assert fn.__name__ == "compute_score"
    assert declared is RewardManagerType.sequential


def test_the_shipped_reward_function_loads_by_file_path(monkeypatch):
    monkeypatch.chdir(REPO)
    fn, declared = load_reward_function("reward_functions/synthetic_colour.py:compute_score")
    assert fn({"response": "<answer>red</answer>", "response_length": 4, "ground_truth": "red"})["overall"] == 1.0
    assert declared is RewardManagerType.sequential


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("no_colon_here.py", r"expected path/to/file\.py:function or package\.module:function"),
        ("/nonexistent/dir/rewards.py:score", r"file /nonexistent/dir/rewards\.py does not exist"),
        ("vlmrl_no_such_package_xyz.mod:score", r"cannot import module vlmrl_no_such_package_xyz\.mod"),
    ],
)
def test_bad_specs_fail_with_the_location(spec, match):
    with pytest.raises(RewardFunctionError, match=match):
        load_reward_function(spec)


def test_missing_function_is_named(tmp_path, package):
    path = write_module(tmp_path, SEQUENTIAL)
    with pytest.raises(RewardFunctionError, match=r"has no function 'scor'"):
        load_reward_function(f"{path}:scor")
    module = package("m", "NOT_A_FUNCTION = 3\n")
    with pytest.raises(RewardFunctionError, match=rf"{module} has no function 'NOT_A_FUNCTION'"):
        load_reward_function(f"{module}:NOT_A_FUNCTION")


@pytest.mark.parametrize(
    "source",
    [
        'REWARD_TYPE = "parallel"\ndef score(x):\n    return {"overall": 0}\n',
        'def score(x):\n    return {"overall": 0}\nscore.REWARD_TYPE = "parallel"\n',
    ],
    ids=["module", "function"],
)
def test_bad_reward_type_is_rejected_with_the_valid_values(tmp_path, source):
    path = write_module(tmp_path, source)
    with pytest.raises(RewardFunctionError, match=r"REWARD_TYPE='parallel' is not 'sequential' or 'batch'"):
        load_reward_function(f"{path}:score")
    with pytest.raises(RewardFunctionError, match="parallel"):
        manager_class(f"{path}:score", None)


# --------------------------------------------------------------------------- choosing the manager


@pytest.mark.parametrize(
    ("source", "configured", "expected"),
    [
        ('def f(x):\n    return {"overall": 0}\n', None, SequentialFunctionRewardManager),
        ('REWARD_TYPE = "batch"\ndef f(x):\n    return [{"overall": 0}]\n', None, BatchFunctionRewardManager),
        ('REWARD_TYPE = "sequential"\ndef f(x):\n    return {"overall": 0}\n', None, SequentialFunctionRewardManager),
        # The function's own REWARD_TYPE beats its module's.
        (
            'REWARD_TYPE = "sequential"\ndef f(x):\n    return []\nf.REWARD_TYPE = "batch"\n',
            None,
            BatchFunctionRewardManager,
        ),
        # The config beats both.
        (
            'REWARD_TYPE = "batch"\ndef f(x):\n    return []\n',
            RewardManagerType.sequential,
            SequentialFunctionRewardManager,
        ),
        (
            'def f(x):\n    return []\nf.REWARD_TYPE = "sequential"\n',
            RewardManagerType.batch,
            BatchFunctionRewardManager,
        ),
    ],
    ids=[
        "default",
        "module-batch",
        "module-sequential",
        "function-over-module",
        "config-over-module",
        "config-over-function",
    ],
)
def test_manager_class_follows_config_then_function_then_module(tmp_path, source, configured, expected):
    path = write_module(tmp_path, source)
    assert manager_class(f"{path}:f", configured) is expected


def test_each_manager_type_has_its_class():
    assert set(REWARD_MANAGERS) == set(RewardManagerType)
    for kind, cls in REWARD_MANAGERS.items():
        assert cls.reward_type is kind


# --------------------------------------------------------------------------- kwargs checked at start-up


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"bonsu": 1.0}, "bonsu"),  # misspelt keyword
        ({"bonus": 1.0, "extra": 2}, "extra"),
    ],
)
def test_kwargs_that_do_not_fit_fail_when_the_manager_starts(tmp_path, manager, kwargs, match):
    path = write_module(tmp_path, SEQUENTIAL)
    with pytest.raises(RewardFunctionError) as info:
        manager(SequentialFunctionRewardManager, f"{path}:score", kwargs).start()
    message = str(info.value)
    assert "worker.reward.reward_function_kwargs" in message and match in message
    assert "(reward_input, bonus=0.0)" in message  # shows the signature to fit


def test_a_required_keyword_not_given_fails_when_the_manager_starts(tmp_path, manager):
    path = write_module(tmp_path, "def score(reward_inputs, threshold):\n    return []\n")
    with pytest.raises(RewardFunctionError, match="threshold"):
        manager(BatchFunctionRewardManager, f"{path}:score", {}).start()
    manager(BatchFunctionRewardManager, f"{path}:score", {"threshold": 0.5}).start()  # fits


def test_a_function_without_a_positional_input_fails_when_the_manager_starts(tmp_path, manager):
    path = write_module(tmp_path, "def score():\n    return {}\n")
    with pytest.raises(RewardFunctionError, match="do not fit"):
        manager(SequentialFunctionRewardManager, f"{path}:score", {}).start()


def test_var_keyword_functions_accept_any_kwargs(tmp_path, manager):
    path = write_module(tmp_path, 'def score(x, **kw):\n    return {"overall": kw["w"]}\n')
    m = manager(SequentialFunctionRewardManager, f"{path}:score", {"w": 0.25})
    assert m.compute(inputs("a")) == RewardResult([0.25], {}, [])


def test_a_package_module_loads_in_the_reward_processes(package, manager):
    # The processes get the manager's sys.path, so a package importable here is importable there.
    module = package("scores", BATCH)
    assert manager(BatchFunctionRewardManager, f"{module}:score").compute(inputs("yes")).overall == [1.0]


# --------------------------------------------------------------------------- scores


def test_sequential_manager_returns_overall_and_subscores_with_missing_filled_as_zero(tmp_path, manager):
    path = write_module(tmp_path, SEQUENTIAL)
    m = manager(SequentialFunctionRewardManager, f"{path}:score", {"bonus": 0.5})
    result = m.compute(inputs("yes", "no", "no"))
    assert result.overall == [1.5, 0.5, 0.5]  # hit + bonus
    assert result.sub_scores == {
        "accuracy": [1.0, 0.0, 0.0],
        "length": [3.0, 0.0, 2.0],  # sample 1 did not report it: 0
    }
    assert result.timeouts == []
    assert all(isinstance(v, float) for v in result.overall + result.sub_scores["length"])


def test_batch_manager_calls_once_and_fills_missing_subscores(package, manager):
    module = package("scores", BATCH)
    result = manager(BatchFunctionRewardManager, f"{module}:score", {"scale": 3.0}).compute(inputs("no", "yes", "no"))
    assert result.overall == [0.0, 3.0, 0.0]
    assert result.sub_scores == {"hit_only": [0.0, 1.0, 0.0]}


def test_batch_manager_passes_all_inputs_in_one_call(tmp_path, manager):
    log = tmp_path / "calls.txt"
    path = write_module(
        tmp_path,
        """
        def score(reward_inputs, log):
            with open(log, "a") as f:
                f.write(f"{len(reward_inputs)}\\n")
            return [{"overall": x["sample_id"]} for x in reward_inputs]
        """,
    )
    m = manager(BatchFunctionRewardManager, f"{path}:score", {"log": str(log)}, num_cpus=4)
    assert m.compute(inputs("a", "b", "c", "d")).overall == [0.0, 1.0, 2.0, 3.0]
    assert log.read_text().split() == ["4"]
    assert m.sandbox.processes == 1  # one call per step needs one process, whatever num_cpus says


def test_managers_are_reusable_across_steps(tmp_path, manager):
    path = write_module(tmp_path, SEQUENTIAL)
    m = manager(SequentialFunctionRewardManager, f"{path}:score")
    for step in range(3):
        assert m.compute(inputs("yes", "no")[: step % 2 + 1]).overall == [1.0, 0.0][: step % 2 + 1]
    assert m.compute([]).overall == []


@pytest.mark.parametrize(
    ("returned", "match"),
    [
        ('{"accuracy": 1.0}', "must return a dict with an 'overall' key"),
        ("0.5", "must return a dict with an 'overall' key"),
        ('{"overall": float("nan")}', "'overall'=nan is not finite"),
        ('{"overall": 1.0, "format": float("inf")}', "'format'=inf is not finite"),
        ('{"overall": "high"}', "'overall'='high' is not a number"),
        ('{"overall": 1.0, 3: 1.0}', "score key 3 is not a string"),
    ],
)
def test_malformed_scores_fail_naming_the_function_and_sample(tmp_path, manager, returned, match):
    path = write_module(
        tmp_path, f"def score(x):\n    return {returned} if x['sample_id'] == 1 else {{'overall': 0}}\n"
    )
    with pytest.raises(RewardFunctionError) as info:
        manager(SequentialFunctionRewardManager, f"{path}:score").compute(inputs("a", "b"))
    message = str(info.value)
    assert match in message
    assert f"{path}:score" in message and "sample 1 (data source 'd')" in message


@pytest.mark.parametrize("returned", ["[{'overall': 0.0}]", "{'overall': 0.0}", "None"])
def test_batch_function_returning_the_wrong_length_or_type_fails(tmp_path, manager, returned):
    path = write_module(tmp_path, f"def score(xs):\n    return {returned}\n")
    with pytest.raises(RewardFunctionError) as info:
        manager(BatchFunctionRewardManager, f"{path}:score").compute(inputs("a", "b", "c"))
    message = str(info.value)
    assert f"{path}:score" in message and "for 3 inputs" in message and "one dict per input" in message


def test_batch_function_malformed_item_names_its_sample(tmp_path, manager):
    path = write_module(tmp_path, "def score(xs):\n    return [{'overall': 1.0}, {'score': 1.0}]\n")
    with pytest.raises(RewardFunctionError, match="sample 1"):
        manager(BatchFunctionRewardManager, f"{path}:score").compute(inputs("a", "b"))


def test_numpy_scores_are_taken_as_floats(tmp_path, manager):
    path = write_module(
        tmp_path, "import numpy as np\ndef score(x):\n    return {'overall': np.float32(0.5), 'hit': np.bool_(True)}\n"
    )
    result = manager(SequentialFunctionRewardManager, f"{path}:score").compute(inputs("a"))
    assert result == RewardResult([0.5], {"hit": [1.0]}, [])
