"""Checkpoint directories: atomic commit, finding the last complete one, save_limit, model checks."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from vlmrl.driver.checkpoint import (
    MANIFEST,
    MARKER,
    CheckpointError,
    CheckpointManager,
    check_manifest,
    check_model_matches,
    is_complete,
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


def test_saving_a_step_again_replaces_an_unmarked_leftover(tmp_path, capsys):
    # What a kill between an older save's rename and its marker leaves: the resumed run trains that step again
    # and must be able to save it, on this start and every later one.
    manager = CheckpointManager(str(tmp_path))
    leftover = tmp_path / "global_step_4"
    (leftover / "actor").mkdir(parents=True)
    (leftover / "actor" / "shard").write_text("half")
    final = _save(manager, 4, "whole")
    assert final == leftover and is_complete(final) and check_manifest(final) is None
    assert (final / "actor" / "shard").read_text() == "whole"
    assert [p.name for p in tmp_path.iterdir()] == ["global_step_4"]
    assert f"replacing {leftover}, an unmarked leftover" in capsys.readouterr().out


def test_a_new_step_is_marked_before_it_gets_its_final_name(tmp_path, monkeypatch):
    # A kill right after the rename must not leave global_step_<k> unmarked: the marker is already inside.
    manager = CheckpointManager(str(tmp_path))
    tmp = manager.begin(6)
    (tmp / "shard").write_text("x")
    seen = []
    real_rename = os.rename

    def rename(src, dst):
        seen.append((Path(dst).name, (Path(src) / MARKER).is_file(), (Path(src) / MANIFEST).is_file()))
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    manager.commit(tmp, 6)
    assert seen == [("global_step_6", True, True)]


def _checkpoint_with_state(manager: CheckpointManager, step: int) -> Path:
    tmp = manager.begin(step)
    (tmp / "actor").mkdir()
    (tmp / "actor" / "shard.distcp").write_bytes(b"w" * 64)
    save_trainer_state(tmp, {"global_step": step})
    return manager.commit(tmp, step)


def test_the_manifest_lists_every_file_with_its_size_and_the_small_ones_hash(tmp_path):
    final = _checkpoint_with_state(CheckpointManager(str(tmp_path)), 1)
    files = json.loads((final / MANIFEST).read_text())["files"]
    assert sorted(files) == ["actor/shard.distcp", "trainer_state.pt"]
    assert files["actor/shard.distcp"]["size"] == 64 and len(files["actor/shard.distcp"]["sha256"]) == 64
    assert MARKER not in files and MANIFEST not in files


@pytest.mark.parametrize(
    "damage, problem",
    [
        (lambda d: (d / "actor" / "shard.distcp").unlink(), "actor/shard.distcp is missing"),
        (lambda d: (d / "actor" / "shard.distcp").write_bytes(b"w" * 10), "actor/shard.distcp has 10 bytes, not 64"),
        (lambda d: (d / "actor" / "shard.distcp").write_bytes(b"v" * 64), "actor/shard.distcp has changed"),
        (lambda d: (d / MANIFEST).unlink(), f"it has no {MANIFEST}"),
    ],
    ids=["missing", "cut short", "changed", "no manifest"],
)
def test_a_resume_skips_a_marked_checkpoint_whose_files_do_not_match_its_manifest(tmp_path, capsys, damage, problem):
    manager = CheckpointManager(str(tmp_path))
    good = _checkpoint_with_state(manager, 1)
    bad = _checkpoint_with_state(manager, 2)
    damage(bad)
    assert is_complete(bad)
    assert manager.find_last() == good  # the previous good step
    printed = capsys.readouterr().out
    assert f"WARNING: skipping {bad}: " in printed and problem in printed
    assert f"trainer.load_checkpoint_path={bad}" in printed


def test_a_bare_marked_directory_is_not_a_checkpoint_to_resume(tmp_path):
    # The case: an interrupted copy holding COMPLETE and trainer_state.pt only.
    manager = CheckpointManager(str(tmp_path))
    bare = tmp_path / "global_step_7"
    bare.mkdir()
    save_trainer_state(bare, {"global_step": 7})
    (bare / MARKER).write_text("7\n")
    assert manager.find_last() is None


def test_the_temporaries_of_killed_saves_are_removed_at_start(tmp_path, capsys):
    manager = CheckpointManager(str(tmp_path))
    _save(manager, 2)
    killed = manager.begin(3)  # a save killed while writing: unmarked
    (killed / "shard").write_text("partial")
    duplicate = tmp_path / ".global_step_2.old-0123abcd"  # a marked second copy of a complete step
    shutil.copytree(tmp_path / "global_step_2", duplicate)
    only_copy = tmp_path / ".global_step_5.tmp-89abcdef"  # marked, and no global_step_5: kept
    only_copy.mkdir()
    (only_copy / MARKER).write_text("5\n")
    unmarked_step = tmp_path / "global_step_4"  # not a temporary: reported by find_last, left alone
    unmarked_step.mkdir()
    assert sorted(manager.remove_stale_temporaries()) == sorted([killed, duplicate])
    assert not killed.exists() and not duplicate.exists()
    assert only_copy.exists() and unmarked_step.exists() and is_complete(tmp_path / "global_step_2")
    assert f"removing {killed}, left by a save that was killed" in capsys.readouterr().out


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


def test_a_full_disk_while_writing_the_manifest_removes_the_temporary_directory(tmp_path, monkeypatch):
    import errno

    import vlmrl.driver.checkpoint as checkpoint

    manager = CheckpointManager(str(tmp_path))
    tmp = manager.begin(2)
    (tmp / "shard").write_text("x")

    def full(directory):
        raise OSError(errno.ENOSPC, "No space left on device (injected)")

    monkeypatch.setattr(checkpoint, "write_manifest", full)
    with pytest.raises(OSError, match="injected"):
        manager.commit(tmp, 2)
    assert list(tmp_path.iterdir()) == []
