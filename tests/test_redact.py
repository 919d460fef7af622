"""Secrets stay out of what a run writes or prints: values from ``${oc.env:...}`` and keys that name a secret.

Every writer of the config goes through ``vlmrl.config.to_dict`` (``vlmrl.config.redact``): the
``--dry-run`` output, the loggers' parameters and ``config.yaml``, ``config.json`` beside the outputs and
in each checkpoint (those two are checked on the shared end-to-end run, tests/test_e2e.py), the resume
fingerprint, and the messages of ``ConfigError`` and of kwargs that do not fit a reward function.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vlmrl.config import Config, ConfigError, LoggerName, parse, to_dict
from vlmrl.config.redact import MASK, redact, secret_name

SECRET = "sk-test-0123456789abcdef"
YAML = """\
worker:
  reward:
    reward_function_kwargs:
      api_key: ${oc.env:VLMRL_TEST_API_KEY}
      base_url: "https://llm.internal/v1?user=${oc.env:VLMRL_TEST_USER}"
      hf_token: written-in-the-yaml
      max_tokens: 12
      judge: {nested: {clientSecret: also-in-the-yaml, model: small}}
"""


@pytest.fixture
def secret_config(tmp_path, monkeypatch) -> tuple[Config, list[str]]:
    monkeypatch.setenv("VLMRL_TEST_API_KEY", SECRET)
    monkeypatch.setenv("VLMRL_TEST_USER", "alice-the-user")
    (tmp_path / "secrets.yaml").write_text(YAML)
    args = [f"config={tmp_path / 'secrets.yaml'}", "data.prompt_key=${oc.env:VLMRL_TEST_USER}"]
    config, problems = parse(args)
    assert problems == []
    return config, args


@pytest.mark.parametrize(
    "name", ["api_key", "API_KEY", "key", "hf_token", "access-token", "clientSecret", "db_password", "passwd", "openaiApiKey", "Authorization"]
)
def test_names_that_say_secret(name):
    assert secret_name(name)


@pytest.mark.parametrize("name", ["max_tokens", "tokenizer", "keyword", "monkey", "model", "base_url", "prompt"])
def test_names_that_do_not(name):
    assert not secret_name(name)


def test_to_dict_masks_values_from_the_environment_and_keys_that_name_a_secret(secret_config):
    config, _ = secret_config
    kwargs = to_dict(config)["worker"]["reward"]["reward_function_kwargs"]
    assert kwargs == {
        "api_key": MASK,
        "base_url": MASK,  # built with an oc.env interpolation
        "hf_token": MASK,  # its name says secret
        "max_tokens": 12,
        "judge": {"nested": {"clientSecret": MASK, "model": "small"}},
    }
    assert to_dict(config)["data"]["prompt_key"] == MASK  # from the environment, though a schema field
    assert to_dict(Config())["data"]["prompt_key"] == "prompt"  # a schema field is not judged by its name
    # What the run itself uses keeps the real values.
    assert config.worker.reward.reward_function_kwargs["api_key"] == SECRET
    assert config.data.prompt_key == "alice-the-user"


def test_a_copy_of_a_secret_under_an_innocent_key_is_masked_too():
    from vlmrl.config.redact import Secrets

    copied = "copied-secret-9f8e7d"  # a value no other test remembers
    assert redact({"note": f"use {copied}"}) == {"note": f"use {copied}"}
    assert redact({"note": f"use {copied}"}, secrets=Secrets(values=frozenset({copied}))) == {"note": MASK}


def test_the_dry_run_prints_no_secret(tmp_path, monkeypatch, capsys, tiny_assets):
    from vlmrl.main import main

    monkeypatch.setenv("VLMRL_TEST_API_KEY", SECRET)
    monkeypatch.setenv("VLMRL_TEST_OUTPUTS", str(tmp_path / "scratch-of-alice"))
    (tmp_path / "reward.py").write_text("def compute_score(reward_input, **kwargs):\n    return {'overall': 0.0}\n")
    args = [
        "config=examples/quickstart.yaml",
        f"worker.reward.reward_function={tmp_path / 'reward.py'}:compute_score",
        "worker.reward.reward_function_kwargs.api_key=${oc.env:VLMRL_TEST_API_KEY}",
        "worker.reward.reward_function_kwargs.hf_token=written-on-the-command-line",
        "trainer.output_dir=${oc.env:VLMRL_TEST_OUTPUTS}",
    ]
    assert main([*args, "--dry-run"]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "# resolved config" in out and "# plan" in out
    for secret in (SECRET, "written-on-the-command-line", "scratch-of-alice"):
        assert secret not in out
    assert f"api_key: '{MASK}'" in out and f"hf_token: '{MASK}'" in out and "format_weight: 0.0" in out


def test_a_config_sent_to_another_process_masks_its_secrets_there(secret_config):
    import subprocess
    import sys
    import pickle

    config, _ = secret_config
    code = (
        "import pickle, sys\n"
        "from vlmrl.config import to_dict\n"
        "from vlmrl.config.redact import mask_text\n"
        "config = pickle.loads(sys.stdin.buffer.read())\n"
        "print(to_dict(config)['worker']['reward']['reward_function_kwargs']['api_key'])\n"
        f"print(mask_text('the key is {SECRET}'))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], input=pickle.dumps(config), capture_output=True, check=True, env={"PATH": "/usr/bin"}
    ).stdout.decode()
    assert out.splitlines() == [MASK, f"the key is {MASK}"]


def test_a_configuration_error_that_quotes_a_secret_masks_it(monkeypatch, capsys):
    from vlmrl.main import main

    monkeypatch.setenv("VLMRL_TEST_API_KEY", SECRET)
    assert main(["config=examples/quickstart.yaml", "trainer.max_steps=${oc.env:VLMRL_TEST_API_KEY}"]) == 2
    err = capsys.readouterr().err
    assert "trainer.max_steps=" in err and SECRET not in err and MASK in err
    with pytest.raises(ConfigError) as raised:
        raise ConfigError([f"something={SECRET!r} is wrong"])
    assert SECRET not in str(raised.value) and SECRET not in raised.value.problems[0]


def test_the_loggers_params_and_config_yaml_hold_no_secret(secret_config, tmp_path, monkeypatch):
    from vlmrl.loggers.tracking import RunInfo, Tracker

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    config, _ = secret_config
    run = RunInfo("proj", "exp", str(tmp_path / "exp"), to_dict(config), {"world_size": 1})
    tracker = Tracker([LoggerName.mlflow, LoggerName.file], run)
    tracker.log({"reward/overall": 0.5}, 1)
    tracker.close()
    assert run.params()["worker.reward.reward_function_kwargs.api_key"] == MASK
    _assert_nowhere(tmp_path / "exp", SECRET, "alice-the-user", "written-in-the-yaml", "also-in-the-yaml")
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'exp' / 'mlflow.db'}")
    (mlrun,) = client.search_runs([client.get_experiment_by_name("proj").experiment_id])
    assert mlrun.data.params["worker.reward.reward_function_kwargs.api_key"] == MASK


def _assert_nowhere(root: Path, *secrets: str) -> None:
    files = [p for p in root.rglob("*") if p.is_file()]
    assert files
    for file in files:
        data = file.read_bytes()
        for secret in secrets:
            assert secret.encode() not in data, f"{secret!r} is written in {file}"


def test_the_resume_fingerprint_neither_stores_nor_prints_a_secret(secret_config):
    from vlmrl.driver.resume import differences, fingerprint

    config, _ = secret_config
    saved = fingerprint(config)
    assert saved["worker.reward.reward_function_kwargs.api_key"] == MASK
    assert SECRET not in json.dumps(saved)
    # A checkpoint written before secrets were masked holds the key itself: the difference is not printed.
    older = {**saved, "worker.reward.reward_function_kwargs.api_key": SECRET}
    assert differences(older, saved) == []


def test_kwargs_that_do_not_fit_the_reward_function_are_reported_without_their_secrets(monkeypatch):
    from vlmrl.config.redact import remember
    from vlmrl.reward.function import RewardFunctionError, check_kwargs

    remember([SECRET])

    def compute_score(reward_input, log_path):
        return 0.0

    with pytest.raises(RewardFunctionError) as raised:
        check_kwargs(compute_score, "reward.py:compute_score", {"api_key": SECRET, "token": "tok-value-123"})
    assert SECRET not in str(raised.value) and "tok-value-123" not in str(raised.value)
    assert f"'api_key': '{MASK}'" in str(raised.value)


def test_the_runners_logger_params_hold_no_path_from_the_environment(tmp_path, monkeypatch):
    from mlflow import MlflowClient

    from vlmrl.driver.runner import _tracker
    from vlmrl.plan import Cluster, resolve

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("VLMRL_TEST_SCRATCH", str(tmp_path / "scratch-of-bob"))
    args = ["config=examples/quickstart.yaml", "trainer.output_dir=${oc.env:VLMRL_TEST_SCRATCH}", "trainer.logger=[mlflow]"]
    config, problems = parse(args)
    assert problems == []
    plan = resolve(config, Cluster(0, 2))
    assert "scratch-of-bob" in plan.experiment_dir
    _tracker(config, plan, None).close()
    client = MlflowClient(tracking_uri=f"sqlite:///{Path(plan.experiment_dir) / 'mlflow.db'}")
    (mlrun,) = client.search_runs([client.get_experiment_by_name(config.trainer.project_name).experiment_id])
    params = mlrun.data.params
    assert params["trainer.output_dir"] == MASK and params["plan.experiment_dir"] == MASK
    assert not [k for k, v in params.items() if "scratch-of-bob" in v]
