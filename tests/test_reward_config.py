"""The reward section of the config: a reward function that cannot load is a config error,
reported with the rest before Ray starts, and the reward options are checked."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from vlmrl.config import ConfigError, RewardConfig, RewardManagerType, TimeoutPolicy
from vlmrl.main import main
from vlmrl.validate import load_config

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = "config=examples/quickstart.yaml"


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch, tiny_assets):
    monkeypatch.chdir(REPO)


def problems_of(*args: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config([QUICKSTART, *args])
    return info.value.problems


def reward_file(tmp_path: Path, source: str) -> Path:
    path = tmp_path / "my_reward.py"
    path.write_text(source)
    return path


def test_defaults():
    reward = RewardConfig()
    assert reward.timeout == 300.0 and reward.on_timeout is TimeoutPolicy.error
    assert reward.num_cpus == 1 and reward.reward_type is None
    assert reward.num_workers is None  # resolved by plan.reward_workers


def test_options_parse_from_the_command_line():
    config = load_config(
        [
            QUICKSTART,
            "worker.reward.timeout=2.5",
            "worker.reward.on_timeout=zero",
            "worker.reward.reward_type=sequential",
        ]
    )
    assert config.worker.reward.timeout == 2.5 and config.worker.reward.on_timeout is TimeoutPolicy.zero
    assert config.worker.reward.reward_type is RewardManagerType.sequential
    assert load_config([QUICKSTART, "worker.reward.timeout=null"]).worker.reward.timeout is None
    assert load_config([QUICKSTART, "worker.reward.timeout=10"]).worker.reward.timeout == 10.0


@pytest.mark.parametrize(
    ("source", "function", "match"),
    [
        (None, "compute_score", r"file .*nope\.py does not exist"),
        ("def compute_score(x):\n    return {'overall': 0}\n", "compute_scor", r"has no function 'compute_scor'"),
        (
            "import no_such_package_for_vlmrl\n",
            "compute_score",
            r"failed to load: ModuleNotFoundError: No module named 'no_such_package_for_vlmrl'",
        ),
        ("def compute_score(x)\n    return 1\n", "compute_score", r"failed to load: SyntaxError"),
        (
            "raise RuntimeError('needs an API key')\n",
            "compute_score",
            r"failed to load: RuntimeError: needs an API key",
        ),
        ("import sys\nsys.exit(3)\n", "compute_score", r"failed to load: SystemExit: 3"),
        (
            "REWARD_TYPE = 'both'\ndef compute_score(x):\n    return {}\n",
            "compute_score",
            r"REWARD_TYPE='both' is not 'sequential' or 'batch'",
        ),
    ],
    ids=[
        "missing-file",
        "missing-function",
        "import-error",
        "syntax-error",
        "raises-at-import",
        "exits-at-import",
        "bad-reward-type",
    ],
)
def test_a_reward_function_that_cannot_load_is_a_config_error(tmp_path, source, function, match):
    path = tmp_path / "nope.py" if source is None else reward_file(tmp_path, source)
    problems = problems_of(f"worker.reward.reward_function={path}:{function}")
    assert len(problems) == 1, problems
    assert problems[0].startswith(("worker.reward.reward_function", str(path)))
    assert re.search(match, problems[0]), problems[0]


def test_a_missing_module_is_a_config_error():
    (problem,) = problems_of("worker.reward.reward_function=vlmrl_no_such_rewards.maths:compute_score")
    assert "cannot import module vlmrl_no_such_rewards.maths" in problem


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("worker.reward.timeout=0", "worker.reward.timeout=0.0: must be a positive number of seconds, or null"),
        ("worker.reward.timeout=-5", "worker.reward.timeout=-5.0: must be a positive number"),
        ("worker.reward.num_cpus=0", "worker.reward.num_cpus=0: must be at least 1"),
        ("worker.reward.num_workers=0", "worker.reward.num_workers=0: must be at least 1"),
        ("worker.reward.num_workers=-2", "worker.reward.num_workers=-2: must be at least 1"),
        (
            "worker.reward.on_timeout=skip",
            "worker.reward.on_timeout='skip': not a valid option; choose one of: error, zero",
        ),
        ("worker.reward.reward_type=parallel", "choose one of: sequential, batch"),
    ],
)
def test_bad_reward_options_are_named(override, expected):
    problems = problems_of(override)
    assert len(problems) == 1 and expected in problems[0], problems


def test_reward_problems_come_with_the_others_and_main_exits_2(tmp_path, capsys):
    args = [
        QUICKSTART,
        f"worker.reward.reward_function={tmp_path}/gone.py:f",
        "worker.reward.timeout=0",
        "data.shufle=true",
    ]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "3 problem(s)" in err and "gone.py does not exist" in err and "worker.reward.timeout" in err
