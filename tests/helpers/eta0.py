"""Async at eta = 0 against the synchronous run it should repeat, and resumed from its step-1 checkpoint: the checks
the multi-turn, agent and workflow e2e modules share (tests/test_async_e2e.py has single-turn's, weights included)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.resume_point import resume_point
from helpers.runs import run_command, tail


def eta0_overrides(rows: Path) -> list[str]:
    """A synchronous run's command made async at eta = 0, colocated, writing the rows each step trained to ``rows``
    and saving every step; without validation, which does not change what trains."""
    return [
        "worker.rollout.async_rl.enable=true", "worker.rollout.async_rl.max_head_offpolicyness=0",
        f"trainer.rollout_data_dir={rows}", "data.val_files=", "trainer.val_before_train=false", "trainer.save_freq=1",
    ]  # fmt: skip


def assert_trains_what_sync_trains(sync: list[dict], got: list[dict], rows: Path, compared: list[str], steps: int,
                                   rows_per_step: int | None = None) -> None:  # fmt: skip
    """``got``, the eta = 0 run's trained steps, are ``sync``'s, both ``steps`` long: nothing carried over, the
    ``compared`` metrics step by step, and every generated token of every row it wrote to ``rows``
    (``trainer.rollout_data_dir``) sampled by the step's own weights (version step - 1). ``rows_per_step``: the
    rows each step trained, where the step does not log it (``trace/rows_trained``)."""
    assert [m["step"] for m in got] == [m["step"] for m in sync] == list(range(1, steps + 1))
    for s, g in zip(sync, got):
        assert g["async/lag/max"] == 0 and g["async/carried_over"] == 0, g["step"]
        for key in compared:
            assert g[key] == pytest.approx(s[key], rel=1e-5, abs=1e-6), (s["step"], key)
    for g in got:
        step = g["step"]
        written = [json.loads(line) for line in (rows / f"step_{step}.jsonl").read_text().splitlines()]
        assert len(written) == (rows_per_step or g["trace/rows_trained"])
        for row in written:
            generated = [v for v, mask in zip(row["versions"], row["loss_mask"]) if mask]
            assert generated and set(generated) == {step - 1}, (step, row["versions"])


def assert_a_resume_repeats_it(run_dir: Path, copy_dir: Path, command: list[str], compared: list[str]) -> None:
    """The eta = 0 run in ``run_dir``, as it stood after step 1 (copied to ``copy_dir``), started again with
    ``command`` (its own command, the output going to the copy): it resumes from step 1's checkpoint, which holds no
    group admitted ahead at eta = 0, and trains the later steps as the run did (the same prompts and samples give
    the same ``compared`` metrics)."""
    resume_point(run_dir, copy_dir, step=1)
    proc = run_command(command, timeout=1200)
    assert proc.returncode == 0, tail(proc)
    log = proc.stdout + proc.stderr
    assert "resumed from" in log and "global_step_1" in log
    expected, got = _trained_steps(run_dir), _trained_steps(copy_dir)
    assert len(expected) > 1, "the run trained no step after the resume point"
    assert [m["step"] for m in got] == [m["step"] for m in expected]
    for e, g in zip(expected[1:], got[1:]):
        assert g["async/lag/max"] == 0 and g["async/carried_over"] == 0, g["step"]
        for key in compared:
            assert g[key] == pytest.approx(e[key], rel=1e-5, abs=1e-6), (e["step"], key)


def _trained_steps(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [m for m in map(json.loads, lines) if "actor/pg_loss" in m]
