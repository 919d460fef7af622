"""Checkpoint directories: atomic commit, finding the last complete one, save_limit, model checks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from vlmrl.driver.checkpoint import (
    MARKER,
    CheckpointError,
    CheckpointManager,
    check_model_matches,
    load_trainer_state,
    save_trainer_state,
)


def _save(manager: CheckpointManager, step: int, payload: str = "x") -> Path:
    tmp = manager.begin(step)
    (tmp / "actor").mkdir()
    (tmp / "actor" / "shard").write_text(payload)
    return manager.commit(tmp, step)


def test_commit_renames_the_temporary_directory_and_writes_the_marker_last(tmp_path):
    manager = CheckpointManager(str(tmp_path))
    tmp = manager.begin(3)
    assert tmp.parent == tmp_path and tmp.name.startswith(".global_step_3.tmp-")
    # Before the commit nothing counts as a checkpoint, and the temporary directory is reported as debris.
    assert manager.complete() == [] and manager.incomplete() == [tmp]
    (tmp / "data").write_text("shard")
    final = manager.commit(tmp, 3)
    assert final == tmp_path / "global_step_3"
    assert (final / "data").read_text() == "shard"
    assert (final / MARKER).read_text().strip() == "3"
    assert not tmp.exists()
    assert manager.complete() == [final] and manager.incomplete() == []


def test_find_last_takes_the_newest_complete_checkpoint_and_leaves_debris_alone(tmp_path, capsys):
    manager = CheckpointManager(str(tmp_path))
    _save(manager, 2)
    _save(manager, 10)  # numeric, not lexical, order: 10 is newer than 2
    # What a crash leaves: a temporary directory of step 12, and a step directory without its marker.
    debris_tmp = manager.begin(12)
    unmarked = tmp_path / "global_step_11"
    unmarked.mkdir()
    assert manager.find_last() == tmp_path / "global_step_10"
    printed = capsys.readouterr().out
    assert str(debris_tmp) in printed and str(unmarked) in printed
    assert debris_tmp.exists() and unmarked.exists()


def test_find_last_without_checkpoints_is_none(tmp_path):
    assert CheckpointManager(str(tmp_path / "missing")).find_last() is None
    assert CheckpointManager(str(tmp_path)).find_last() is None


def test_save_limit_keeps_the_newest_complete_checkpoints(tmp_path):
    manager = CheckpointManager(str(tmp_path), save_limit=2)
    unmarked = tmp_path / "global_step_1"
    unmarked.mkdir()
    for step in (2, 4, 6):
        _save(manager, step)
    assert [p.name for p in manager.complete()] == ["global_step_4", "global_step_6"]
    assert not (tmp_path / "global_step_2").exists()
    assert unmarked.exists()  # incomplete directories are never deleted


def test_no_save_limit_keeps_everything(tmp_path):
    manager = CheckpointManager(str(tmp_path), save_limit=-1)
    for step in (1, 2, 3):
        _save(manager, step)
    assert len(manager.complete()) == 3


def test_saving_a_step_again_replaces_the_complete_copy(tmp_path):
    manager = CheckpointManager(str(tmp_path))
    _save(manager, 5, "old")
    final = _save(manager, 5, "new")
    assert (final / "actor" / "shard").read_text() == "new"
    assert [p.name for p in tmp_path.iterdir()] == ["global_step_5"]


def test_committing_over_an_incomplete_directory_refuses_and_names_it(tmp_path):
    manager = CheckpointManager(str(tmp_path))
    (tmp_path / "global_step_4").mkdir(parents=True)
    tmp = manager.begin(4)
    with pytest.raises(CheckpointError, match="global_step_4 exists without a COMPLETE marker"):
        manager.commit(tmp, 4)
    assert tmp.exists()  # the new save is kept, not lost


def test_trainer_state_round_trips_through_weights_only_load(tmp_path):
    from vlmrl.rng import rng_state

    state = {"global_step": 7, "next_group_id": 21, "dataloader": {"a": torch.arange(3)}, "rng": rng_state()}
    save_trainer_state(tmp_path, state)
    loaded = load_trainer_state(tmp_path)  # weights_only=True inside
    assert loaded["global_step"] == 7 and loaded["next_group_id"] == 21
    assert torch.equal(loaded["dataloader"]["a"], torch.arange(3))
    assert torch.equal(loaded["rng"]["torch"], state["rng"]["torch"])


def _model_dir(path: Path, **overrides) -> Path:
    path.mkdir(parents=True)
    config = {"architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
              "text_config": {"hidden_size": 128, "num_hidden_layers": 2, "vocab_size": 911}}  # fmt: skip
    config["text_config"].update(overrides)
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_a_checkpoint_of_another_model_fails_with_the_differences(tmp_path):
    checkpoint = tmp_path / "global_step_3"
    _model_dir(checkpoint / "actor" / "huggingface", hidden_size=256)
    model = _model_dir(tmp_path / "model")
    with pytest.raises(CheckpointError) as info:
        check_model_matches(checkpoint, str(model))
    message = str(info.value)
    assert "hidden_size" in message and "(256, 128)" in message and str(model) in message


def test_a_checkpoint_of_the_same_model_passes(tmp_path):
    checkpoint = tmp_path / "global_step_3"
    _model_dir(checkpoint / "actor" / "huggingface")
    check_model_matches(checkpoint, str(_model_dir(tmp_path / "model")))
