"""examples/workflow.yaml end to end: a user's workflow class trains through ``python -m vlmrl.main``.

One run of 2 steps (4 prompts x 2 samples), validating before training with the generations logged: the
two-turn conversations (answer, a crop of the image, answer again) are trained, the actor's log-probs agree
with the engine's, and the validation generations show both turns and the crop. A second run is the first's
training under asynchronous training at eta = 0 (colocated, without validation): it trains exactly what the
synchronous run trains; started again from its step-1 checkpoint, it trains step 2 as it did.
"""

from __future__ import annotations

import json
import sys

import pytest
import pyarrow.parquet as pq
from helpers.eta0 import assert_a_resume_repeats_it, assert_trains_what_sync_trains, eta0_overrides
from helpers.runs import experiment_dir, read_metrics, run_command, tail

STEPS = 2


def _command(tmp, *extra):
    return [
        sys.executable, "-m", "vlmrl.main", "config=examples/workflow.yaml", f"trainer.output_dir={tmp}",
        f"trainer.max_steps={STEPS}", "data.rollout_batch_size=4", "worker.actor.global_batch_size=4",
        "worker.rollout.n=2", "worker.actor.micro_batch_size_per_device_for_update=8",
        "worker.rollout.calculate_log_probs=true", "trainer.logger=[console,file]",
        "worker.rollout.workflow_kwargs.zoom=3.0", *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def workflow_run(quickstart_assets, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("workflow")
    val = tmp / "val.parquet"
    pq.write_table(pq.read_table(quickstart_assets.val_file).slice(0, 2), val)
    proc = run_command(_command(tmp, f"data.val_files={val}", "trainer.val_generations_to_log=2"), timeout=900)
    assert proc.returncode == 0, tail(proc)
    return tmp, proc.stdout + proc.stderr


def test_the_workflows_conversations_train(workflow_run):
    tmp, _ = workflow_run
    metrics = read_metrics(tmp, "workflow")
    train = [m for m in metrics if m["step"] > 0 and "actor/pg_loss" in m]
    assert [m["step"] for m in train] == list(range(1, STEPS + 1))
    for m in train:
        # Every sample played two turns unless its budget ran out, and nothing was dropped.
        assert m["agent/turns/mean"] > 1.5 and m["agent/images/mean"] > 0.5, m
        assert m["workflow/dropped"] == m["workflow/errors"] == m["workflow/timeouts"] == 0
        # Token-in/token-out: the actor's log-probs of the sampled tokens are the engine's (fp32 on both sides).
        assert m["rollout/log_prob_diff_max"] < 0.05, m["rollout/log_prob_diff_max"]
        assert "timing_s/gen/workflow" in m and "timing_s/gen/engine" in m


def test_the_validation_generations_show_both_turns_and_the_crop(workflow_run):
    tmp, _ = workflow_run
    generations = experiment_dir(tmp, "workflow") / "generations"
    rows = [json.loads(line) for f in sorted(generations.iterdir()) for line in f.read_text().splitlines()]
    assert rows
    for r in rows:
        assert [m["role"] for m in r["messages"]] == ["assistant", "user", "assistant"]
        assert r["images"] == 2  # the row's image and the crop
        assert "Answer again" in json.dumps(r["messages"][1])
        trained = sum(r["loss_mask"])
        assert 0 < trained < len(r["response_ids"])  # the crop's message and tokens are context, never trained


COMPARED = ["reward/overall", "response_length/mean", "actor/pg_loss", "actor/grad_norm", "agent/turns/mean",
            "trace/rows_trained"]  # fmt: skip


@pytest.fixture(scope="module")
def eta0(workflow_run, tmp_path_factory):
    """The synchronous run's training under async at eta = 0, colocated, each step's trained rows written."""
    tmp = tmp_path_factory.mktemp("workflow_eta0")
    proc = run_command(_command(tmp, *eta0_overrides(tmp / "rows")), timeout=900)
    assert proc.returncode == 0, tail(proc)
    return tmp


def test_a_workflow_class_at_eta_0_trains_what_the_synchronous_run_trains(workflow_run, eta0):
    sync = [m for m in read_metrics(workflow_run[0], "workflow") if m["step"] > 0 and "actor/pg_loss" in m]
    got = [m for m in read_metrics(eta0, "workflow") if "actor/pg_loss" in m]
    # Both turns of every trained conversation sampled by the step's own weights.
    assert_trains_what_sync_trains(sync, got, eta0 / "rows", COMPARED, STEPS)


def test_a_workflow_class_at_eta_0_resumed_repeats_its_run(eta0, tmp_path):
    copy = experiment_dir(tmp_path, "workflow")
    command = _command(tmp_path, *eta0_overrides(tmp_path / "rows"))
    assert_a_resume_repeats_it(experiment_dir(eta0, "workflow"), copy, command, COMPARED)
