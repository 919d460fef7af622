"""Faults around the checkpoint directory itself: replacing a step that is already saved, and a
checkpoint that ``save_limit`` cannot delete (a busy NFS file, a permission).

Before, replacing deleted the old copy before renaming the new one in (a moment with no
checkpoint of that step), and an ``rmtree`` error crashed a run right after a good save.
"""

from __future__ import annotations

import shutil

import pytest

import vlmrl.driver.checkpoint as checkpoint_module
from vlmrl.driver.checkpoint import CheckpointManager, is_complete


def _save(manager: CheckpointManager, step: int, content: str):
    tmp = manager.begin(step)
    (tmp / "actor").mkdir()
    (tmp / "actor" / "shard").write_text(content)
    return manager.commit(tmp, step)


def test_replacing_a_step_never_leaves_it_without_a_complete_copy(tmp_path, monkeypatch):
    manager = CheckpointManager(str(tmp_path))
    final = _save(manager, 5, "old")
    seen = []

    def watched(fn):
        def call(*args, **kwargs):
            result = fn(*args, **kwargs)
            # After every rename and delete, global_step_5 must be whole.
            seen.append(is_complete(final) and (final / "actor" / "shard").is_file())
            return result

        return call

    monkeypatch.setattr(checkpoint_module.os, "rename", watched(checkpoint_module.os.rename))
    monkeypatch.setattr(checkpoint_module.shutil, "rmtree", watched(checkpoint_module.shutil.rmtree))
    _save(manager, 5, "new")
    assert seen and all(seen), seen
    assert (final / "actor" / "shard").read_text() == "new"
    assert [p.name for p in tmp_path.iterdir()] == ["global_step_5"]


def test_without_an_atomic_exchange_the_old_copy_moves_aside_only_after_the_new_one_is_whole(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint_module, "_exchange", lambda a, b: False)
    manager = CheckpointManager(str(tmp_path))
    _save(manager, 5, "old")
    final = _save(manager, 5, "new")
    assert (final / "actor" / "shard").read_text() == "new" and is_complete(final)
    assert [p.name for p in tmp_path.iterdir()] == ["global_step_5"]


def test_a_checkpoint_save_limit_cannot_delete_is_reported_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    manager = CheckpointManager(str(tmp_path), save_limit=1)
    _save(manager, 1, "a")
    real_rmtree = shutil.rmtree

    def busy(path, *args, **kwargs):
        if str(path).endswith("global_step_1"):
            raise OSError(16, "Device or resource busy", str(path))
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(checkpoint_module.shutil, "rmtree", busy)
    final = _save(manager, 2, "b")  # must not raise
    assert is_complete(final)
    assert "could not remove" in capsys.readouterr().out
    # The undeleted one is unmarked first, so it is never resumed from; it is reported as debris.
    assert manager.complete() == [final]
    assert tmp_path / "global_step_1" in manager.incomplete()
