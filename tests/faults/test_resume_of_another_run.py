"""Fault: a rerun under the same experiment name with other settings finds the old run's checkpoint.

Before, an automatic resume took whatever checkpoint it found. Now the settings
that change what trains are fingerprinted into each checkpoint; an automatic
resume refuses a checkpoint whose fingerprint differs and lists the keys with
the fix, and an explicit ``trainer.load_checkpoint_path`` says what it overrides.
A poisoned checkpoint is refused by the same driver check, before any worker starts.
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest

from vlmrl.config import Config, to_dict
from vlmrl.driver.checkpoint import MANIFEST, CheckpointError, write_manifest
from vlmrl.driver.resume import check_resume, fingerprint
from vlmrl.train.safe_checkpoint import UnsafeCheckpoint
from vlmrl.validate import load_config


def _config(*overrides: str) -> Config:
    return load_config(["config=examples/quickstart.yaml", *overrides])


def _checkpoint(root: Path, config: Config, with_fingerprint: bool = True) -> Path:
    path = root / "checkpoints" / "global_step_2"
    path.mkdir(parents=True)
    saved = {"config": to_dict(config), "plan": {}}
    if with_fingerprint:
        saved["fingerprint"] = fingerprint(config)
    (path / "config.json").write_text(json.dumps(saved))
    write_manifest(path)
    (path / "COMPLETE").write_text("2\n")
    return path


def test_an_automatic_resume_of_another_runs_checkpoint_is_refused_with_the_keys(tmp_path):
    checkpoint = _checkpoint(tmp_path, _config())
    other = _config("data.seed=7", "worker.rollout.n=4", "worker.actor.optim.lr=3e-4")
    with pytest.raises(CheckpointError) as refused:
        check_resume(checkpoint, other, explicit=False)
    message = str(refused.value)
    assert "data.seed: 1 -> 7" in message
    assert "worker.rollout.n: 8 -> 4" in message
    assert "worker.actor.optim.lr:" in message and "0.0003" in message
    assert "trainer.experiment_name" in message and f"trainer.load_checkpoint_path={checkpoint}" in message


def test_the_same_run_with_other_speed_and_length_settings_resumes(tmp_path):
    checkpoint = _checkpoint(tmp_path, _config())
    # What users change when resuming: how long, how often to save or log, micro-batches, padding.
    again = _config(
        "trainer.max_steps=200", "trainer.save_freq=5", "trainer.logger=[console]",
        "worker.actor.micro_batch_size_per_device_for_update=1", "worker.actor.padding_free=true",
    )  # fmt: skip
    check_resume(checkpoint, again, explicit=False)


def test_an_explicit_checkpoint_says_what_this_run_overrides(tmp_path, capsys):
    checkpoint = _checkpoint(tmp_path, _config())
    check_resume(checkpoint, _config("data.seed=7"), explicit=True)
    out = capsys.readouterr().out
    assert "trainer.load_checkpoint_path" in out and "override the checkpoint's" in out and "data.seed: 1 -> 7" in out


def test_a_checkpoint_saved_before_fingerprints_is_compared_through_its_config(tmp_path):
    checkpoint = _checkpoint(tmp_path, _config(), with_fingerprint=False)
    with pytest.raises(CheckpointError, match="algorithm.adv_estimator: 'grpo' -> 'rloo'"):
        check_resume(checkpoint, _config("algorithm.adv_estimator=rloo"), explicit=False)


def test_a_reward_kwarg_only_one_run_has_is_a_difference(tmp_path):
    checkpoint = _checkpoint(tmp_path, _config())
    changed = _config()
    changed.worker.reward.reward_function_kwargs = {**changed.worker.reward.reward_function_kwargs, "extra": 3}
    with pytest.raises(CheckpointError, match="reward_function_kwargs.extra: '<unset>' -> 3"):
        check_resume(checkpoint, changed, explicit=False)


class _RunsACommand:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_the_driver_refuses_a_poisoned_checkpoint_before_any_worker_starts(tmp_path):
    config = _config()
    checkpoint = _checkpoint(tmp_path, config)
    (checkpoint / "actor").mkdir()
    marker = tmp_path / "pwned"
    (checkpoint / "actor" / ".metadata").write_bytes(pickle.dumps(_RunsACommand(marker)))
    with pytest.raises(UnsafeCheckpoint, match="refusing to load posix.system"):
        check_resume(checkpoint, config, explicit=False)
    assert not marker.exists()
    (checkpoint / "actor" / ".metadata").unlink()
    (checkpoint / "config.json").chmod(0o666)
    with pytest.raises(UnsafeCheckpoint, match=r"config.json \(every user can write it\)"):
        check_resume(checkpoint, config, explicit=False)


def test_a_checkpoint_whose_files_changed_since_its_save_is_refused_even_when_named(tmp_path):
    checkpoint = _checkpoint(tmp_path, _config())
    (checkpoint / "config.json").write_text("{}")
    for explicit in (False, True):
        with pytest.raises(CheckpointError, match="config.json has .*bytes|config.json has changed"):
            check_resume(checkpoint, _config(), explicit=explicit)


def test_a_checkpoint_without_a_manifest_loads_only_when_named_with_a_warning(tmp_path, capsys):
    # An older vlmrl wrote no manifest: the automatic resume cannot tell its checkpoint from an interrupted copy.
    checkpoint = _checkpoint(tmp_path, _config())
    (checkpoint / MANIFEST).unlink()
    with pytest.raises(CheckpointError, match=f"has no {MANIFEST}"):
        check_resume(checkpoint, _config(), explicit=False)
    check_resume(checkpoint, _config(), explicit=True)
    assert f"WARNING: {checkpoint}: it has no {MANIFEST}" in capsys.readouterr().out
