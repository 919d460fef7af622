"""What a user sees of a real run (tests/conftest.py::e2e_run, the tiny VLM for 4 steps):
its MLflow store (read through ``MlflowClient``), its TensorBoard event
files and its metrics.jsonl, all checked against each other.

The run validates before training (step 0) and at its last step, logging 2
samples each time.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from helpers.runs import E2E_N, E2E_PROMPTS, E2E_SAMPLES_LOGGED, E2E_STEPS
from PIL import Image

from vlmrl.config import to_dict

from vlmrl.validate import load_config
from vlmrl.testing.synthetic import COLOURS

STEPS = E2E_STEPS
SAMPLES_LOGGED = E2E_SAMPLES_LOGGED
VALIDATED_AT = [0, STEPS]


@pytest.fixture(scope="module")
def run(e2e_run, tmp_path_factory):
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{e2e_run.dir / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("vlmrl").experiment_id])
    assert len(runs) == 1
    return {
        "args": e2e_run.args,
        "dir": e2e_run.dir,
        "client": client,
        "mlrun": runs[0],
        "jsonl": [json.loads(line) for line in (e2e_run.dir / "metrics.jsonl").read_text().splitlines()],
        "log": e2e_run.log,
        "downloads": tmp_path_factory.mktemp("downloads"),
    }


def mlflow_metrics(run) -> dict[str, dict[int, float]]:
    """Every metric of the MLflow run as {key: {step: value}}."""
    client, run_id = run["client"], run["mlrun"].info.run_id
    return {
        key: {m.step: m.value for m in client.get_metric_history(run_id, key)} for key in run["mlrun"].data.metrics
    }


def test_the_mlflow_run_holds_every_metric_of_every_step(run):
    mlrun = run["mlrun"]
    assert mlrun.info.run_name == "e2e" and mlrun.info.status == "FINISHED"
    metrics = mlflow_metrics(run)
    per_step = [
        "reward/overall", "reward/overlap", "actor/pg_loss", "actor/kl_loss", "actor/reference_kl",
        "actor/entropy", "response_length/mean",
        "timing_s/gen", "timing_s/reward", "timing_s/ref", "timing_s/adv", "timing_s/update_actor",
        "timing_s/update_weights", "timing_s/step",
        "perf/throughput", "perf/time_per_step", "perf/total_num_tokens", "perf/mfu", "perf/mfu/actor",
    ]  # fmt: skip
    for key in per_step:
        assert sorted(metrics.get(key, {})) == list(range(1, STEPS + 1)), key
    # Validation, overall and per data source and sub-score, before training and at the end.
    for key in ["val/reward/overall", "val/reward/overlap", "val/shape_colour/overall",
                "val/shape_colour/overlap"]:  # fmt: skip
        assert sorted(metrics[key]) == VALIDATED_AT, key
    assert sorted(metrics["timing_s/testing"]) == [STEPS]
    for step in (1, 2):
        assert metrics["perf/time_per_step"][step] == metrics["timing_s/step"][step]
        tokens = metrics["perf/total_num_tokens"][step]
        assert tokens == int(tokens) > 0
        assert metrics["perf/throughput"][step] == pytest.approx(tokens / metrics["timing_s/step"][step])
        assert 0 < metrics["perf/mfu"][step] < 1 and 0 < metrics["perf/mfu/actor"][step] < 1


def test_the_mlflow_run_holds_the_resolved_config_as_parameters_and_as_a_file(run):
    config = load_config(run["args"])
    params = run["mlrun"].data.params
    assert params["trainer.max_steps"] == str(STEPS)
    assert params["worker.rollout.n"] == str(E2E_N) and params["data.rollout_batch_size"] == str(E2E_PROMPTS)
    assert params["worker.actor.model.model_path"] == config.worker.actor.model.model_path  # resolved ${tiny:...}
    assert params["plan.samples_per_step"] == str(E2E_PROMPTS * E2E_N)
    path = run["client"].download_artifacts(run["mlrun"].info.run_id, "config.yaml", str(run["downloads"]))
    assert to_dict(load_config([f"config={path}"])) == to_dict(config)


def test_the_sample_table_shows_each_response_with_its_image(run):
    client, run_id = run["client"], run["mlrun"].info.run_id
    path = client.download_artifacts(run_id, "validation/samples.json", str(run["downloads"]))
    table = json.loads(Path(path).read_text())
    rows = [dict(zip(table["columns"], r)) for r in table["data"]]
    assert [r["step"] for r in rows] == [s for s in VALIDATED_AT for _ in range(SAMPLES_LOGGED)]
    for r in rows:
        assert {"prompt", "response", "ground_truth", "reward", "score/overlap"} <= r.keys()
        assert "What colour is the shape?" in r["prompt"]
        image_file = client.download_artifacts(run_id, r["image"]["filepath"], str(run["downloads"]))
        with Image.open(image_file) as image:
            colours = {c for _, c in image.convert("RGB").getcolors(maxcolors=1 << 20)}
        # The image is the one the answer was about: it holds the shape in the ground-truth colour, no other.
        assert COLOURS[r["ground_truth"]] in colours
        assert not {c for name, c in COLOURS.items() if name != r["ground_truth"]} & colours
    # The table's rows are the ones in generations/step_<k>.jsonl, in order.
    for step in VALIDATED_AT:
        generations = [json.loads(x) for x in (run["dir"] / "generations" / f"step_{step}.jsonl").read_text().splitlines()]
        logged = [r for r in rows if r["step"] == step]
        assert [(g["response"], g["ground_truth"]) for g in generations] == [
            (r["response"], r["ground_truth"]) for r in logged
        ]
        assert [g["scores"]["overall"] for g in generations] == [r["reward"] for r in logged]


def test_the_reward_curve_is_a_png(run):
    path = run["client"].download_artifacts(run["mlrun"].info.run_id, "reward_curve.png", str(run["downloads"]))
    with Image.open(path) as image:
        image.verify()
        assert image.format == "PNG" and image.size[0] >= 400


def test_tensorboard_holds_the_same_scalars(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run["dir"] / "tensorboard"), size_guidance={"scalars": 0, "images": 0})
    events.Reload()
    logged = {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}
    expected = mlflow_metrics(run)
    assert logged.keys() == expected.keys()
    for key, values in expected.items():
        assert logged[key].keys() == values.keys(), key
        for step, value in values.items():
            assert logged[key][step] == pytest.approx(value, rel=1e-6), (key, step)  # float32 in TensorBoard
    assert {f"val/sample_{i}" for i in range(SAMPLES_LOGGED)} <= set(events.Tags()["images"])


def test_the_json_lines_file_has_one_line_per_step_with_the_same_numbers(run):
    lines = run["jsonl"]
    assert [line["step"] for line in lines] == list(range(0, STEPS + 1))  # step 0: validation before training
    metrics = mlflow_metrics(run)
    for line in lines:
        step = line["step"]
        for key, value in line.items():
            if key != "step":
                assert metrics[key][step] == pytest.approx(value, rel=1e-12), (key, step)
        assert {key for key, values in metrics.items() if step in values} == line.keys() - {"step"}


def test_console_shows_a_line_per_step_the_progress_bar_and_the_device_peak(run):
    log = run["log"]
    for step in range(0, STEPS + 1):
        assert f"step {step} | " in log
    assert "perf: device cpu" in log and "GFLOP/s (measured" in log
    # Not a terminal, so no bar (tests/test_console.py draws it on one): a line for the training's start.
    assert f"training: steps 1 to {STEPS}" in log
    assert f"mlflow: run {run['mlrun'].info.run_id} (new)" in log
