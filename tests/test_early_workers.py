"""The driver creates a fresh run's workers as soon as it has joined Ray (``vlmrl.launch._start_workers_early``),
so that their start-up (imports, models, engine: most of a short run's) runs beside the Runner's own start; a run
that resumes, or whose workers the cluster cannot place at once, leaves them to the Runner."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from vlmrl import launch
from vlmrl.launch import prepare


def _prepared(tmp_path, *overrides: str):
    args = ["config=examples/quickstart.yaml", f"trainer.output_dir={tmp_path}", "data.val_files=", *overrides]
    return prepare(args)


def _placement_groups(ray, since: dict | None = None) -> dict[str, str]:
    """Each placement group's state, leaving out those in ``since`` (an earlier call's answer)."""
    from ray.util import placement_group_table

    return {pg_id: g["state"] for pg_id, g in placement_group_table().items() if pg_id not in (since or {})}


def test_the_driver_creates_a_fresh_runs_workers_and_stops_them(module_local_ray, quickstart_assets, tmp_path):
    prepared = _prepared(tmp_path)
    before = _placement_groups(module_local_ray)
    started = launch._start_workers_early(prepared.config, prepared.plan)
    assert started is not None
    try:
        assert len(started.workers) == prepared.plan.world_size == 1
        assert started.servers == []
        # Created (by this process, the driver), not waited for: the constructor is still loading.
        name = f"hybrid_worker_0_{os.getpid()}_{id(started.pool)}"
        assert module_local_ray.get_actor(name) is not None
        assert list(_placement_groups(module_local_ray, before).values()) == ["CREATED"]
    finally:
        started.stop()
    # stop() leaves nothing behind: the worker is gone and its placement group removed.
    with pytest.raises(ValueError):
        module_local_ray.get_actor(name)
    assert list(_placement_groups(module_local_ray, before).values()) == ["REMOVED"]


@pytest.mark.parametrize("how", ["find_last_checkpoint", "load_checkpoint_path"])
def test_a_resumed_run_leaves_its_workers_to_the_runner(module_local_ray, quickstart_assets, tmp_path, how):
    # The Runner checks the checkpoint, and whether any training is left, before any worker starts.
    prepared = _prepared(tmp_path)
    before = _placement_groups(module_local_ray)
    if how == "find_last_checkpoint":  # a checkpoint of this run's own: find_last_checkpoint (the default) picks it
        (Path(prepared.plan.checkpoint_dir) / "global_step_2").mkdir(parents=True)
    else:  # another run's checkpoint, named
        other = tmp_path / "other" / "global_step_2"
        other.mkdir(parents=True)
        (other / "COMPLETE").write_text("2\n")  # what the config check asks of a named checkpoint
        prepared = _prepared(tmp_path, f"trainer.load_checkpoint_path={other}")
    assert launch._start_workers_early(prepared.config, prepared.plan) is None
    assert _placement_groups(module_local_ray, before) == {}


def test_workers_the_cluster_cannot_place_at_once_are_left_to_the_runner(
    module_local_ray, quickstart_assets, tmp_path, monkeypatch
):
    monkeypatch.setattr(launch, "EARLY_PLACEMENT_S", 1.0)
    # 4 workers on the fixture's 2 CPUs: the Runner waits for them (trainer.start_timeout_s) and says why it cannot.
    prepared = _prepared(tmp_path, "trainer.n_gpus_per_node=4", "worker.actor.global_batch_size=16")
    before = _placement_groups(module_local_ray)
    assert launch._start_workers_early(prepared.config, prepared.plan) is None
    assert list(_placement_groups(module_local_ray, before).values()) == ["REMOVED"]
