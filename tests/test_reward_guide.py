"""The reward-function guide's example (docs/guides/rewards.md) is complete: it loads, passes its
own doctest, runs in the manager its REWARD_TYPE names, and its command line is a valid config."""

from __future__ import annotations

import doctest
import importlib.util
import re
import shlex
from pathlib import Path

import pytest

from vlmrl.validate import load_config
from vlmrl.reward.function import load_reward_function
from vlmrl.reward.manager import REWARD_MANAGERS

REPO = Path(__file__).resolve().parents[1]


def section() -> str:
    """The guide's opening, before its first sub-heading: the example and its command line."""
    text = (REPO / "docs" / "guides" / "rewards.md").read_text()
    return text.split("\n## ", 1)[0]


@pytest.fixture
def example(tmp_path) -> Path:
    (code,) = re.findall(r"```python\n(.*?)```", section(), re.DOTALL)
    path = tmp_path / "my_reward.py"
    path.write_text(code)
    return path


def test_the_example_passes_its_doctest(example):
    spec = importlib.util.spec_from_file_location("readme_reward", example)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    result = doctest.testmod(module)
    assert result.attempted >= 1 and result.failed == 0


def test_the_example_runs_in_its_manager(example):
    _, declared = load_reward_function(f"{example}:compute_score")
    manager = REWARD_MANAGERS[declared](f"{example}:compute_score", {"format_weight": 0.2})
    try:
        result = manager.compute(
            [
                {"response": "<answer> Blue </answer>", "response_length": 5, "ground_truth": "blue", "sample_id": 0},
                {"response": "green", "response_length": 1, "ground_truth": "blue", "sample_id": 1},
            ]
        )
    finally:
        manager.close()
    assert result.overall == [1.0, 0.0]
    assert result.sub_scores == {"accuracy": [1.0, 0.0], "format": [1.0, 0.0]}


def test_the_example_command_line_is_a_valid_config(example, tiny_assets, monkeypatch):
    monkeypatch.chdir(REPO)  # the quickstart names its format prompt relative to the repo root
    (command,) = re.findall(r"```bash\n(.*?)```", section(), re.DOTALL)
    args = shlex.split(command.replace("\\\n", " "))
    assert args[:3] == [".venv/bin/python", "-m", "vlmrl.main"]
    config = load_config([a.replace("=my_reward.py:", f"={example}:") for a in args[3:]])
    assert config.worker.reward.reward_function == f"{example}:compute_score"
    assert config.worker.reward.reward_function_kwargs == {"format_weight": 0.2}
