"""Asynchronous training, disaggregated, when things go wrong: stale groups, SIGTERM, a rollout server killed.

Both runs push the weights every 2 updates (``weight_sync_interval=2``) with eta = 1, which makes groups
stale on their own, as a lagging weight update does in AReaL (#602): admission counts the trainer's
version, but between pushes the server samples with older weights. Traced with B groups per step:

  step 1 (v=0): admit 2B groups, the server at 0; train B (lag 0); update -> v=1, no push (1 % 2)
  step 2 (v=1): admit B more, still sampled by the server at 0; train the B of step 1 (lag 1); update ->
                v=2, push: the server is at 2
  step 3 (v=2): the B admitted at step 2 hold tokens of version 0: lag 2 > eta. The consumption check
                catches them; admission alone would have let them train.

* ``stale_policy=drop``: no trained token is older than eta; step 3 drops B groups. Then the rollout server
  is killed (SIGKILL, as an OOM kill would) while the run goes on: the run fails with the server named,
  and does not hang.
* ``stale_policy=accept``: step 3 trains its B stale groups and counts them (lag 2). Then SIGTERM: the
  step under way finishes, the checkpoint is saved with the groups admitted but not trained (generating
  on the server at the stop, abandoned), and the run exits 0.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers.processes import process_of
from helpers.runs import REPO, SMALL, experiment_dir, joined, main_command, read_metrics

B = 2  # SMALL's groups per step
ARGS = [
    *SMALL,
    "worker.rollout.calculate_log_probs=true",
    "worker.rollout.async_rl.enable=true",
    "worker.rollout.async_rl.placement=disaggregated",
    "worker.rollout.async_rl.rollout_workers=1",
    "worker.rollout.async_rl.max_head_offpolicyness=1",
    "worker.rollout.async_rl.weight_sync_interval=2",
    "worker.actor.use_decoupled_loss=true",
    "trainer.logger=[console,file]",
    "trainer.max_steps=40",
]


def _last_step(metrics: Path) -> int:
    """The newest step in metrics.jsonl so far (a line being written is skipped), 0 before the first."""
    steps = [0]
    if metrics.is_file():
        for line in metrics.read_text().splitlines():
            try:
                steps.append(json.loads(line)["step"])
            except json.JSONDecodeError:
                pass
    return max(steps)


def _run_until_step(tmp: Path, policy: str, step: int, then) -> tuple[int, str]:
    """Start the run, wait for ``step``'s metrics, call ``then(proc)``, and wait for the run to end (it must
    end by itself within 5 minutes: a hang fails the test). Its exit code and output."""
    log = tmp / "log.txt"
    command, env = joined(main_command(tmp, *ARGS, f"worker.rollout.async_rl.stale_policy={policy}"))
    metrics = experiment_dir(tmp) / "metrics.jsonl"
    with log.open("w") as sink:  # a file, not a pipe: nobody reads a pipe while we wait
        proc = subprocess.Popen(command, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT, env=env)
        try:
            deadline = time.monotonic() + 400
            while _last_step(metrics) < step:
                assert proc.poll() is None, log.read_text()[-5000:]
                assert time.monotonic() < deadline, f"step {step} did not finish in time"
                time.sleep(0.2)
            then(proc)
            proc.wait(timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()
    return proc.returncode, log.read_text()


@pytest.fixture(scope="module")
def dropped_then_server_killed(quickstart_assets, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("async_drop_kill")

    def kill_the_server(proc):
        server = process_of(proc.pid, "ray::RolloutServer")
        assert server is not None, "the run's rollout server process was not found"
        os.kill(server, signal.SIGKILL)

    code, output = _run_until_step(tmp, "drop", 3, kill_the_server)
    return code, output, [m for m in read_metrics(tmp) if "actor/pg_loss" in m]


@pytest.fixture(scope="module")
def accepted_then_sigterm(quickstart_assets, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("async_accept_sigterm")
    code, output = _run_until_step(tmp, "accept", 3, lambda proc: proc.send_signal(signal.SIGTERM))
    return tmp, code, output, [m for m in read_metrics(tmp) if "actor/pg_loss" in m]


def test_under_drop_no_trained_token_is_older_than_eta(dropped_then_server_killed):
    _, output, steps = dropped_then_server_killed
    assert [m["step"] for m in steps][:3] == [1, 2, 3], output[-3000:]
    assert all(m["async/lag/max"] <= 1 for m in steps)
    # Step 3 met the groups sampled at version 0 (the server had not been pushed version 1) and dropped them.
    assert steps[2]["async/stale_dropped"] == B and steps[2]["async/version"] == 2
    assert steps[0]["perf/resync_skipped"] == 1 and "perf/resync_mb" in steps[1]  # a push every 2 updates


def test_a_killed_rollout_server_fails_the_run_with_the_server_named(dropped_then_server_killed):
    code, output, _ = dropped_then_server_killed  # it ended by itself: no hang
    assert code != 0
    assert "rollout server" in output and "died" in output, output[-5000:]
    assert "Run the same command again to resume" in output


def test_under_accept_stale_groups_train_and_are_counted(accepted_then_sigterm):
    _, _, output, steps = accepted_then_sigterm
    assert [m["step"] for m in steps][:3] == [1, 2, 3], output[-3000:]
    assert steps[2]["async/stale_accepted"] == B and steps[2]["async/lag/max"] == 2
    assert steps[2]["actor/behav_prox_kl"] > 0  # the decoupled loss corrects for the two-versions-old sampler


def test_sigterm_saves_the_step_and_the_groups_in_flight_and_exits_zero(accepted_then_sigterm):
    tmp, code, output, steps = accepted_then_sigterm
    assert code == 0, output[-5000:]
    last = steps[-1]["step"]
    assert 3 <= last < 40 and f"stop requested: saved step {last}" in output
    checkpoint = experiment_dir(tmp) / "checkpoints" / f"global_step_{last}"
    assert (checkpoint / "COMPLETE").is_file()
    # The groups admitted for the next step (on the server, or waiting for rewards, at the stop) are in the
    # checkpoint, to be generated again by a resumed run: none is lost.
    from vlmrl.driver.checkpoint import load_trainer_state

    state = load_trainer_state(checkpoint)
    assert len(state["sampler"]["pending"]) == B
    assert state["sampler"]["staleness"]["version"] == last
    for m in steps:  # the idle shares are measured every step
        assert 0 <= m["async/trainer_idle_share"] <= 1 and 0 <= m["async/rollout_idle_share"] <= 1
