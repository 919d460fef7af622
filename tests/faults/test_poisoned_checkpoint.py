"""Fault: a poisoned checkpoint. Its ``.metadata``, or one of its byte items, pickles a shell command.

torch.distributed.checkpoint unpickles ``.metadata`` and reads byte items with
``torch.load(weights_only=False)`` by default, so loading such a directory ran
the command. vlmrl's loaders (vlmrl/train/safe_checkpoint.py) must refuse it
and run nothing, on the workers' resume path (``load_actor``), on the driver's
check before any worker starts, and in ``vlmrl.export``; a checkpoint other
users can write is refused too; a real checkpoint still round-trips.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

from vlmrl.export import ExportError, export
from vlmrl.export import main as export_main
from vlmrl.train.checkpoint import load_actor, save_actor
from vlmrl.train.safe_checkpoint import UnsafeCheckpoint, check_private


class _RunsACommand:
    """Unpickling this runs ``touch <marker>``: what an attacker's checkpoint would do."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(5, 4)).sum().backward()
    optimizer.step()  # so the optimizer has state (exp_avg, step) to save
    return model, optimizer


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    """A real actor checkpoint (DCP without a process group), private to its owner."""
    model, optimizer = _model()
    path = tmp_path / "checkpoints" / "global_step_1" / "actor"
    save_actor(path, model, optimizer, rank=0, model_only=False)
    return path


def _poison_metadata(actor_dir: Path, marker: Path) -> None:
    with open(actor_dir / ".metadata", "wb") as f:
        pickle.dump(_RunsACommand(marker), f)


def test_a_real_checkpoint_round_trips_through_the_safe_loaders(checkpoint):
    saved, saved_optim = _model()
    model, optimizer = _model()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    optimizer.param_groups[0]["lr"] = 0.5
    assert load_actor(checkpoint, model, optimizer, rank=0) is True
    for a, b in zip(model.parameters(), saved.parameters()):
        torch.testing.assert_close(a, b)
    assert optimizer.param_groups[0]["lr"] == 1e-3  # a byte item, read with weights_only=True
    exp_avg = [optimizer.state[p]["exp_avg"] for p in model.parameters()]
    expected = [saved_optim.state[p]["exp_avg"] for p in saved.parameters()]
    for a, b in zip(exp_avg, expected):
        torch.testing.assert_close(a, b)


def test_resume_refuses_a_metadata_file_that_pickles_a_command(checkpoint, tmp_path):
    marker = tmp_path / "pwned"
    _poison_metadata(checkpoint, marker)
    model, optimizer = _model()
    with pytest.raises(UnsafeCheckpoint, match=r"\.metadata: refusing to load posix\.system"):
        load_actor(checkpoint, model, optimizer, rank=0)
    assert not marker.exists(), "loading the checkpoint ran the command"


def test_resume_refuses_a_byte_item_that_pickles_a_command(tmp_path):
    marker = tmp_path / "pwned"
    model, optimizer = _model()
    model_state, optim_state = get_state_dict(model, optimizer)
    # The learning rate is a byte item of the optimizer state: make it an object that runs a command.
    for group in optim_state["param_groups"]:
        group["lr"] = _RunsACommand(marker)
    path = tmp_path / "actor"
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(path))
    assert not marker.exists()
    model, optimizer = _model()
    with pytest.raises(UnsafeCheckpoint, match=r"optim\.param_groups\..*lr.*weights_only"):
        load_actor(path, model, optimizer, rank=0)
    assert not marker.exists(), "loading the checkpoint ran the command"


def test_resume_refuses_a_checkpoint_other_users_can_write(checkpoint):
    shard = next(checkpoint.glob("*.distcp"))
    shard.chmod(0o646)
    model, optimizer = _model()
    with pytest.raises(UnsafeCheckpoint, match=rf"{shard.name} \(every user can write it\).*chmod -R go-w"):
        load_actor(checkpoint, model, optimizer, rank=0)
    shard.chmod(0o644)
    checkpoint.parent.chmod(0o777)  # the step directory: whoever can write there can swap the actor
    with pytest.raises(UnsafeCheckpoint, match="global_step_1 \\(every user can write it\\)"):
        check_private(checkpoint)
    checkpoint.parent.chmod(0o755)
    check_private(checkpoint)


def _exportable(checkpoint: Path, tiny_assets) -> Path:
    hf = checkpoint / "huggingface"
    hf.mkdir()
    shutil.copy(tiny_assets.model_dir / "config.json", hf / "config.json")
    return checkpoint


def test_export_refuses_a_metadata_file_that_pickles_a_command(checkpoint, tmp_path, tiny_assets, capsys):
    actor_dir = _exportable(checkpoint, tiny_assets)
    marker = tmp_path / "pwned"
    _poison_metadata(actor_dir, marker)
    with pytest.raises(ExportError, match="refusing to load posix.system"):
        export(actor_dir, tmp_path / "out")
    assert export_main([str(actor_dir), "--output", str(tmp_path / "out")]) == 2
    assert "refusing to load posix.system" in capsys.readouterr().err
    assert not marker.exists(), "exporting the checkpoint ran the command"
    assert not (tmp_path / "out").exists()


def test_export_refuses_a_checkpoint_other_users_can_write(checkpoint, tmp_path, tiny_assets):
    actor_dir = _exportable(checkpoint, tiny_assets)
    (actor_dir / ".metadata").chmod(0o666)
    with pytest.raises(ExportError, match=r"\.metadata \(every user can write it\)"):
        export(actor_dir, tmp_path / "out")


@pytest.mark.e2e
def test_a_run_that_finds_a_poisoned_checkpoint_fails_and_runs_nothing(tiny_assets, tmp_path):
    """The whole resume path: ``python -m vlmrl.main`` finds the checkpoint by itself (find_last_checkpoint)."""
    from helpers.runs import SMALL, experiment_dir, run_main, tail

    from vlmrl.driver.checkpoint import write_manifest

    checkpoint = experiment_dir(tmp_path) / "checkpoints" / "global_step_1"
    (checkpoint / "actor").mkdir(parents=True)
    marker = tmp_path / "pwned"
    _poison_metadata(checkpoint / "actor", marker)
    write_manifest(checkpoint)  # a manifest says the files are whole, not that they are safe
    (checkpoint / "COMPLETE").write_text("1\n")
    proc = run_main(tmp_path, *SMALL, "trainer.max_steps=1", timeout=300)
    assert proc.returncode != 0, tail(proc)
    assert "refusing to load posix.system" in proc.stdout + proc.stderr, tail(proc)
    assert not marker.exists(), "the run executed the checkpoint's command"
    assert "HybridWorker" not in proc.stdout + proc.stderr  # refused before any worker started


def test_export_refuses_a_checkpoint_that_asks_for_its_own_code_and_runs_none(
    checkpoint, tmp_path, tiny_assets, capsys, monkeypatch
):
    # An auto_map in huggingface/ makes transformers ask [y/N]; answered y, it ran the checkpoint's .py file.
    actor_dir = _exportable(checkpoint, tiny_assets)
    hf = actor_dir / "huggingface"
    marker = tmp_path / "pwned"
    config = json.loads((hf / "config.json").read_text())
    config.pop("model_type", None)
    config["auto_map"] = {"AutoConfig": "configuration_evil.EvilConfig"}
    (hf / "config.json").write_text(json.dumps(config))
    (hf / "configuration_evil.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n"
        "from transformers import PretrainedConfig\nclass EvilConfig(PretrainedConfig):\n    model_type = 'evil'\n"
    )
    monkeypatch.setattr("builtins.input", lambda *a, **k: "y")  # a user who answers the prompt
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "modules"))
    assert export_main([str(actor_dir), "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert "config.json: auto_map AutoConfig" in err and "runs none" in err
    assert not marker.exists(), "exporting the checkpoint ran its code"
    assert not (tmp_path / "out").exists()
