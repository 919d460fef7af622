"""Async at eta = 0 against the synchronous run it should repeat: the check the multi-turn, agent and workflow e2e
modules share (tests/test_async_e2e.py has single-turn's, weights included)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


def eta0_overrides(rows: Path) -> list[str]:
    """A synchronous run's command made async at eta = 0, colocated, writing the rows each step trained to ``rows``;
    without validation, which does not change what trains."""
    return [
        "worker.rollout.async_rl.enable=true", "worker.rollout.async_rl.max_head_offpolicyness=0",
        f"trainer.rollout_data_dir={rows}", "data.val_files=", "trainer.val_before_train=false",
    ]  # fmt: skip


def assert_trains_what_sync_trains(sync: list[dict], got: list[dict], rows: Path, compared: list[str],
                                   rows_per_step: int | None = None) -> None:  # fmt: skip
    """``got``, the eta = 0 run's trained steps, are ``sync``'s: nothing carried over, the ``compared`` metrics
    step by step, and every generated token of every row it wrote to ``rows`` (``trainer.rollout_data_dir``)
    sampled by the step's own weights (version step - 1). ``rows_per_step``: the rows each step trained, where
    the step does not log it (``trace/rows_trained``)."""
    assert [m["step"] for m in got] == [m["step"] for m in sync] == list(range(1, len(sync) + 1))
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
