"""``worker.reward.env``: the variables a reward process gets on top of the allowlist; validated, and masked
wherever the config is written or printed (``vlmrl.config.to_dict``).

What the reward process then sees is tested with real processes in tests/faults/test_reward_sandbox_limits.py.
"""

from __future__ import annotations

import pytest

from vlmrl.config import ConfigError, parse, to_dict
from vlmrl.config.redact import MASK
from vlmrl.user_process import child_env
from vlmrl.validate import load_config

QUICKSTART = "config=examples/quickstart.yaml"


def test_values_are_masked_whatever_their_key(tmp_path):
    (tmp_path / "env.yaml").write_text(
        "worker:\n  reward:\n    env:\n      JUDGE_URL: https://judge.internal/v1\n      OPENAI_API_KEY: sk-in-the-yaml\n"
    )
    config, problems = parse([f"config={tmp_path / 'env.yaml'}", "worker.reward.env.PORT=8000"])
    assert problems == []
    assert config.worker.reward.env == {"JUDGE_URL": "https://judge.internal/v1", "OPENAI_API_KEY": "sk-in-the-yaml",
                                        "PORT": 8000}  # fmt: skip: a number reaches the process as text
    assert to_dict(config)["worker"]["reward"]["env"] == {"JUDGE_URL": MASK, "OPENAI_API_KEY": MASK, "PORT": MASK}


def test_the_default_is_empty():
    assert load_config([QUICKSTART]).worker.reward.env == {}


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("worker.reward.env={1BAD: x}", "worker.reward.env: '1BAD' is not an environment variable name"),
        ("worker.reward.env.VLMRL_SANDBOX=x", "worker.reward.env.VLMRL_SANDBOX: is set by vlmrl itself"),
    ],
)
def test_bad_entries_are_config_errors(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config([QUICKSTART, override])


def test_the_environment_is_the_allowlist_plus_what_the_user_passes():
    parent = {"PATH": "/bin", "HOME": "/home/u", "LC_ALL": "C", "HF_HOME": "/cache/hf", "WANDB_API_KEY": "w",
              "OPENAI_API_KEY": "o", "VLMRL_CACHE_DIR": "/c", "RAY_ADDRESS": "r", "MLFLOW_TRACKING_URI": "m"}  # fmt: skip
    env = child_env({"OPENAI_API_KEY": "passed", "HOME": "/scratch"}, parent)
    assert env == {"PATH": "/bin", "HOME": "/scratch", "LC_ALL": "C", "HF_HOME": "/cache/hf", "OPENAI_API_KEY": "passed"}
