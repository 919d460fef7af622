"""Fault: the reward function, a tool, the agent or a template was edited between a save and the resume.

The fingerprint holds the config's values, so a resume with the same paths but
other file contents went on without a word. Each checkpoint now stores the
SHA-256 of every user file the config names (the keys the schema marks with
``USER_CODE`` or ``USER_TEMPLATE``), hashed as the run loaded them; a resume
warns for each file that changed, naming the key and the file, and goes on
(refusing would block the fix of a bug in a reward function).
"""

from __future__ import annotations

import json
from pathlib import Path

from vlmrl.config import Config, to_dict
from vlmrl.driver.checkpoint import write_manifest
from vlmrl.driver.resume import check_resume, fingerprint
from vlmrl.driver.user_files import user_file_keys, user_files


def _user_code(root: Path) -> Config:
    """A config naming a reward function, two tools, an agent, its hook and two templates, all files under root."""
    for name in ("reward.py", "tools.py", "more_tools.py", "agent.py", "hooks.py"):
        (root / name).write_text(f"# {name}\ndef fn(*args):\n    return 1.0\n")
    (root / "format.jinja").write_text("{{ content }}\n")
    (root / "judge.jinja").write_text("Is {{ response }} right?\n")
    config = Config()
    config.worker.reward.reward_function = f"{root / 'reward.py'}:fn"
    config.worker.rollout.multi_turn.tools = [f"{root / 'tools.py'}:fn", f"{root / 'more_tools.py'}:fn"]
    config.worker.rollout.agent = f"{root / 'agent.py'}:fn"
    config.worker.rollout.agent_hooks.on_failed = f"{root / 'hooks.py'}:fn"
    config.data.format_prompt = str(root / "format.jinja")
    config.worker.reward.reward_model.prompt_template = str(root / "judge.jinja")
    return config


def _checkpoint(root: Path, config: Config) -> Path:
    """A checkpoint as TrainingLoop saves one: config, fingerprint and user files in config.json."""
    path = root / "checkpoints" / "global_step_2"
    path.mkdir(parents=True)
    saved = {"config": to_dict(config), "plan": {}, "fingerprint": fingerprint(config)}
    saved["user_files"] = user_files(config)
    (path / "config.json").write_text(json.dumps(saved))
    write_manifest(path)
    (path / "COMPLETE").write_text("2\n")
    return path


def test_the_schema_marks_every_key_that_names_user_code():
    assert set(user_file_keys()) == {
        "data.format_prompt", "worker.reward.reward_function", "worker.reward.reward_model.prompt_template",
        "worker.rollout.multi_turn.tools", "worker.rollout.multi_turn.env", "worker.rollout.multi_turn.format",
        "worker.rollout.agent", "worker.rollout.agent_hooks.on_enqueue", "worker.rollout.agent_hooks.on_succeeded",
        "worker.rollout.agent_hooks.on_failed", "worker.rollout.workflow",
    }  # fmt: skip


def test_each_user_file_is_hashed_into_the_checkpoint(tmp_path):
    files = user_files(_user_code(tmp_path))
    assert set(files) == {
        "worker.reward.reward_function", "worker.rollout.multi_turn.tools[0]", "worker.rollout.multi_turn.tools[1]",
        "worker.rollout.agent", "worker.rollout.agent_hooks.on_failed", "data.format_prompt",
        "worker.reward.reward_model.prompt_template",
    }  # fmt: skip
    assert files["worker.rollout.multi_turn.tools[1]"]["file"] == str((tmp_path / "more_tools.py").resolve())
    assert all(len(entry["sha256"]) == 64 for entry in files.values())


def test_a_resume_warns_naming_each_changed_file_and_goes_on(tmp_path, capsys):
    config = _user_code(tmp_path)
    checkpoint = _checkpoint(tmp_path, config)
    check_resume(checkpoint, config, explicit=False)
    assert "WARNING" not in capsys.readouterr().out  # nothing changed, nothing said
    (tmp_path / "reward.py").write_text("def fn(*args):\n    return 0.0  # fixed\n")
    (tmp_path / "more_tools.py").write_text("def fn(*args):\n    return 2.0\n")
    (tmp_path / "judge.jinja").write_text("Is {{ response }} correct?\n")
    for explicit in (False, True):  # the automatic resume and a named checkpoint alike: a warning, not a refusal
        check_resume(checkpoint, config, explicit=explicit)
        out = capsys.readouterr().out
        assert "was trained with other contents of these files" in out
        assert f"worker.reward.reward_function: {(tmp_path / 'reward.py').resolve()}" in out
        assert f"worker.rollout.multi_turn.tools[1]: {(tmp_path / 'more_tools.py').resolve()}" in out
        assert f"worker.reward.reward_model.prompt_template: {(tmp_path / 'judge.jinja').resolve()}" in out
        assert "tools[0]" not in out and "agent" not in out and "format.jinja" not in out  # unchanged ones


def test_builtin_names_and_template_text_name_no_file(tmp_path):
    config = Config()
    config.worker.rollout.multi_turn.format = "qwen"  # a built-in parser
    config.worker.reward.reward_model.prompt_template = "Is {{ response }} right?"  # the template itself
    config.worker.reward.reward_function = "json:loads"  # an installed module: its package versions it
    assert user_files(config) == {}


def test_a_module_path_is_found_without_importing_it(tmp_path, monkeypatch):
    package = tmp_path / "my_rewards"
    package.mkdir()
    (package / "__init__.py").write_text("raise RuntimeError('imported')\n")
    (package / "scores.py").write_text("raise RuntimeError('imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    config = Config()
    config.worker.reward.reward_function = "my_rewards.scores:fn"
    files = user_files(config)
    assert files["worker.reward.reward_function"]["file"] == str((package / "scores.py").resolve())
