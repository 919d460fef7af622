"""Fault: training at ``worker.rollout.temperature=0``.

It used to pass validation ("0 is greedy"): every sample of a group is then the
same greedy response, every group advantage is 0, and the run trains nothing
and exits 0. It must be refused before Ray starts, with the fix; validation
runs (val_only) and greedy validation (val_override_config) stay allowed.
"""

from __future__ import annotations

import subprocess
import time

import pytest
from helpers.runs import REPO, SMALL, main_command

from vlmrl.config import ConfigError
from vlmrl.validate import load_config

QUICKSTART = "config=examples/quickstart.yaml"


def test_training_at_temperature_zero_is_refused_with_the_fix():
    with pytest.raises(ConfigError) as refused:
        load_config([QUICKSTART, "worker.rollout.temperature=0"])
    message = str(refused.value)
    assert "worker.rollout.temperature=0: training would sample greedily" in message
    assert "set a temperature > 0" in message and "val_override_config.temperature" in message


def test_validation_only_and_greedy_validation_are_allowed():
    load_config([QUICKSTART, "worker.rollout.temperature=0", "trainer.val_only=true"])
    load_config([QUICKSTART, "worker.rollout.val_override_config.temperature=0"])


def test_the_cli_refuses_it_before_ray_starts(tmp_path):
    start = time.monotonic()
    proc = subprocess.run(
        main_command(tmp_path, *SMALL, "worker.rollout.temperature=0"), cwd=REPO, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "worker.rollout.temperature=0: training would sample greedily" in proc.stderr
    assert time.monotonic() - start < 60
    assert not (tmp_path / "vlmrl").exists()  # nothing was started or written
