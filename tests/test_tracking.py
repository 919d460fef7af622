"""Unit tests of the tracker, its loggers and the perf metrics, against real stores.

The MLflow tests write to a real SQLite store in a temporary directory and read
it back through ``MlflowClient``; the TensorBoard test reads the event files
with TensorBoard's own reader. Nothing is mocked. The end-to-end view (a real
2-step run) is in test_tracking_run.py.
"""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from PIL import Image

from vlmrl.config import Config, ConfigError, LoggerName, to_dict

from vlmrl.validate import load_config
from vlmrl.loggers.base import RunInfo, ValidationSample, flatten, image_strip
from vlmrl.loggers.console import ConsoleLogger, format_line
from vlmrl.loggers.mlflow_logger import mlflow_key
from vlmrl.driver.perf import (
    count_parameters,
    measure_cpu_peak_flops,
    peak_flops,
)
from vlmrl.loggers.tracking import LOGGERS, PACKAGES, Tracker
from vlmrl.validate import logger_problems

REPO = Path(__file__).resolve().parents[1]


def run_info(tmp_path: Path, project: str = "proj", experiment: str = "exp") -> RunInfo:
    return RunInfo(project, experiment, str(tmp_path / experiment), to_dict(Config()), {"world_size": 1})


def mlflow_client(tmp_path: Path, experiment: str = "exp"):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=f"sqlite:///{tmp_path / experiment / 'mlflow.db'}")


def the_run(client, project: str = "proj"):
    experiment = client.get_experiment_by_name(project)
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1, [r.info.run_id for r in runs]
    return runs[0]


def history(client, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def sample(step: int, colour: str, images: int = 1) -> ValidationSample:
    return ValidationSample(
        step=step,
        data_source="synthetic_colour",
        prompt="<image>What colour is the shape?",
        images=[Image.new("RGB", (56, 28), colour)] * images,
        response=f"<answer>{colour}</answer>",
        ground_truth=colour,
        scores={"overall": 1.0, "accuracy": 1.0, "format": 1.0},
    )


# ------------------------------------------------------------ registry and config


def test_every_logger_name_has_one_logger_and_mlflow_is_on_by_default():
    assert set(LOGGERS) == set(LoggerName)
    assert LoggerName.mlflow in Config().trainer.logger


def test_repeated_logger_names_are_reported():
    problems = logger_problems([LoggerName.console, LoggerName.mlflow, LoggerName.mlflow])
    assert problems == ["trainer.logger names mlflow more than once; list each logger once"]


@pytest.mark.parametrize("name", [LoggerName.wandb, LoggerName.swanlab])
def test_a_logger_whose_package_is_missing_fails_validation_with_the_fix(name, tiny_assets):
    import importlib.util

    if importlib.util.find_spec(PACKAGES[name]) is not None:
        pytest.skip(f"{PACKAGES[name]} is installed here")
    with pytest.raises(ConfigError) as e:
        load_config(["config=examples/quickstart.yaml", f"trainer.logger=[console,{name.value}]"])
    assert e.value.problems == [
        (
            f"trainer.logger: {name.value} needs the {PACKAGES[name]} package, which is not installed; "
            f"`pip install {PACKAGES[name]}` or remove {name.value} from trainer.logger"
        )
    ]


def test_an_installed_logger_package_passes_validation(tmp_path, monkeypatch):
    # A package named wandb on the path is what the check looks for (it does not import it).
    (tmp_path / "wandb").mkdir()
    (tmp_path / "wandb" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert logger_problems([LoggerName.wandb]) == []


def test_an_unknown_logger_name_lists_the_valid_ones(tiny_assets):
    with pytest.raises(ConfigError) as e:
        load_config(["config=examples/quickstart.yaml", "trainer.logger=[console,mlflw]"])
    (problem,) = e.value.problems
    assert problem.startswith("trainer.logger[1]='mlflw': not a valid option; choose one of: console, file, mlflow")


def test_validation_settings_are_checked(tiny_assets):
    with pytest.raises(ConfigError) as e:
        load_config([
            "config=examples/quickstart.yaml", "trainer.val_freq=0", "trainer.val_generations_to_log=-1",
            "worker.rollout.val_override_config.temperature=-1", "worker.rollout.val_override_config.top_p=0",
            "worker.rollout.val_override_config.n=0", "worker.rollout.val_override_config.top_k=0",
        ])  # fmt: skip
    assert sorted(e.value.problems) == sorted([
        "trainer.val_freq=0: must be at least 1, or -1 to validate only at the end",
        "trainer.val_generations_to_log=-1: must be 0 or more",
        "worker.rollout.val_override_config.temperature=-1: must be a number >= 0 (0 is greedy)",
        "worker.rollout.val_override_config.top_p=0: must be a number in (0, 1]",
        "worker.rollout.val_override_config.n=0: must be an integer >= 1",
        "worker.rollout.val_override_config.top_k=0: must be -1 or an integer >= 1",
    ])  # fmt: skip


def test_mlflow_is_imported_only_by_the_mlflow_logger(tmp_path):
    """Loading a config and logging to console and file must not pay MLflow's import."""
    code = (
        "import sys\n"
        "from vlmrl.config import Config, to_dict\n"
        "from vlmrl.loggers.tracking import LoggerName, RunInfo, Tracker\n"
        f"t = Tracker([LoggerName.console, LoggerName.file], RunInfo('p', 'e', {str(tmp_path)!r}, to_dict(Config())))\n"
        "t.log({'reward/overall': 1.0}, 1); t.close()\n"
        "print(sorted(m for m in ('mlflow', 'tensorboard', 'matplotlib', 'pandas') if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"


# ------------------------------------------------------------------ small pieces


def test_flatten_gives_dotted_keys_and_json_for_lists_and_empty_mappings():
    flat = flatten({"data": {"seed": 1, "files": "x.parquet", "dir": None}, "betas": [0.9, 0.99], "kw": {}})
    assert flat == {"data.seed": "1", "data.files": "x.parquet", "data.dir": "", "betas": "[0.9, 0.99]", "kw": "{}"}
    # Every config key becomes a parameter.
    params = run_info(Path("/tmp")).params()
    assert params["worker.rollout.n"] == "5" and params["trainer.logger"] == '["console", "file", "mlflow"]'
    assert params["plan.world_size"] == "1"


def test_mlflow_key_keeps_valid_names_and_replaces_the_rest():
    assert mlflow_key("val/synthetic_colour/accuracy") == "val/synthetic_colour/accuracy"
    assert mlflow_key("val/geo3k@test/acc") == "val/geo3k_test/acc"
    assert mlflow_key("/a//b/") == "a/b"


def test_console_line_shows_the_watched_metrics_in_a_fixed_order():
    line = format_line(
        {"perf/mfu": 0.0123, "reward/overall": 0.5, "actor/reference_kl": 1.2e-3, "val/reward/overall": 0.25, "x": 9}, 7
    )
    assert line == "step 7 | reward 0.500 | val 0.250 | kl 1.20e-03 | mfu 1.23%"


def test_console_line_shows_tool_calls_per_trajectory_and_the_parse_error_rate_of_multi_turn_runs():
    # A multi-turn run whose calls never parse says so on every step line.
    line = format_line({"reward/overall": 0.0, "agent/tool_calls/mean": 1.0, "agent/tool/parse_error_rate": 1.0}, 3)
    assert line == "step 3 | reward 0.000 | calls/traj 1.00 | parse_err 100%"
    assert format_line({"reward/overall": 0.0, "agent/tool_calls/mean": 0.0}, 3) == "step 3 | reward 0.000 | calls/traj 0.00"


def test_console_summary_reports_first_and_last_validation_across_a_resume(tmp_path, capsys):
    first = ConsoleLogger(run_info(tmp_path))
    first.log({"val/reward/overall": 0.1, "val/reward/accuracy": 0.0}, 0)
    first.log({"reward/overall": 0.3}, 1)
    first.log({"val/reward/overall": 0.5, "val/reward/accuracy": 0.4, "val/synthetic_colour/accuracy": 0.4}, 2)
    state = json.loads(json.dumps(first.state()))  # it travels in the checkpoint as JSON

    # The resumed process starts its summary from the run's first validation, not its own.
    second = ConsoleLogger(run_info(tmp_path), state)
    second.log({"reward/overall": 0.7}, 3)
    second.log({"val/reward/overall": 0.9, "val/reward/accuracy": 0.875}, 4)
    capsys.readouterr()
    second.close()
    summary = capsys.readouterr().out.splitlines()
    assert summary[0].startswith("run summary: 4 steps in 0m")
    assert summary[1:] == [
        "  val accuracy: 0.000 (step 0) -> 0.875 (step 4)",
        "  val overall: 0.100 (step 0) -> 0.900 (step 4)",
    ]
    assert state["seconds"] >= 0 and second.state()["seconds"] >= state["seconds"]


def test_console_summary_says_when_no_validation_ran_and_stays_quiet_on_failure(tmp_path, capsys):
    logger = ConsoleLogger(run_info(tmp_path))
    logger.log({"reward/overall": 0.3}, 1)
    capsys.readouterr()
    logger.close()
    assert "no validation ran" in capsys.readouterr().out
    failed = ConsoleLogger(run_info(tmp_path))
    failed.close(failed=True)
    assert capsys.readouterr().out == ""


def test_the_run_summary_counts_from_the_trackers_start_clock_not_from_its_construction(tmp_path, capsys, monkeypatch):
    # The Runner builds the loggers while the workers start (MLflow's import and store take seconds) and starts
    # the clock when training starts: the summary's time is the training's. A resumed run adds its earlier time.
    import vlmrl.loggers.console as console

    now = [100.0]
    monkeypatch.setattr(console.time, "monotonic", lambda: now[0])
    tracker = Tracker([LoggerName.console], run_info(tmp_path), resume_state={"console": {"seconds": 20.0}})
    now[0] = 130.0  # 30 s of the workers' start
    tracker.start_clock()
    now[0] = 205.0  # 75 s of training
    tracker.log({"reward/overall": 0.3}, 1)
    capsys.readouterr()
    tracker.close()
    assert capsys.readouterr().out.splitlines()[0] == "run summary: 1 steps in 1m35s"  # 20 s earlier + 75 s


def test_image_strip_puts_a_prompts_images_side_by_side():
    a, b = Image.new("RGB", (56, 28), "red"), Image.new("RGB", (28, 56), "blue")
    strip = image_strip([a, b])
    assert strip.size == (56 + 4 + 28, 56)
    assert strip.getpixel((0, 0)) == (255, 0, 0) and strip.getpixel((60, 55)) == (0, 0, 255)
    assert image_strip([a]).tobytes() == a.tobytes()
    assert image_strip([]) is None


# ----------------------------------------------------------------------- MLflow


def test_mlflow_run_holds_params_metrics_config_sample_table_and_curve(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    run = run_info(tmp_path)
    tracker = Tracker([LoggerName.mlflow], run)
    tracker.log({"reward/overall": 0.25, "val/reward/overall": 0.5, "val/synthetic_colour/accuracy": 0.5}, 0)
    tracker.log({"reward/overall": 0.75, "actor/reference_kl": 0.01, "timing_s/gen": 1.5}, 1)
    tracker.log_samples([sample(1, "red"), sample(1, "blue", images=2)], 1)
    tracker.log({"reward/overall": 1.0, "val/reward/overall": 0.75}, 2)
    tracker.close()

    client = mlflow_client(tmp_path)
    mlrun = the_run(client)
    assert mlrun.info.run_name == "exp" and mlrun.info.status == "FINISHED"
    rid = mlrun.info.run_id
    assert history(client, rid, "reward/overall") == [(0, 0.25), (1, 0.75), (2, 1.0)]
    assert history(client, rid, "val/reward/overall") == [(0, 0.5), (2, 0.75)]
    assert history(client, rid, "val/synthetic_colour/accuracy") == [(0, 0.5)]
    assert mlrun.data.params == {k: v for k, v in run.params().items()}
    # Artifacts live beside the store, under the experiment dir.
    assert mlrun.info.artifact_uri.startswith((tmp_path / "exp" / "mlartifacts").as_uri())
    names = {a.path for a in client.list_artifacts(rid)}
    assert {"config.yaml", "reward_curve.png", "validation"} <= names
    import yaml

    config_file = client.download_artifacts(rid, "config.yaml", str(tmp_path / "dl"))
    assert yaml.safe_load(Path(config_file).read_text()) == run.config

    table = json.loads(Path(client.download_artifacts(rid, "validation/samples.json", str(tmp_path / "dl"))).read_text())
    rows = [dict(zip(table["columns"], r)) for r in table["data"]]
    assert [(r["step"], r["ground_truth"], r["reward"], r["score/accuracy"]) for r in rows] == [
        (1, "red", 1.0, 1.0),
        (1, "blue", 1.0, 1.0),
    ]
    for r, expected_size, colour in zip(rows, [(56, 28), (56 + 4 + 56, 28)], [(255, 0, 0), (0, 0, 255)]):
        assert r["image"]["type"] == "image"
        image = Image.open(client.download_artifacts(rid, r["image"]["filepath"], str(tmp_path / "dl")))
        assert image.size == expected_size and image.convert("RGB").getpixel((0, 0)) == colour

    png = Path(client.download_artifacts(rid, "reward_curve.png", str(tmp_path / "dl")))
    with Image.open(png) as image:
        image.verify()
        assert image.format == "PNG"
    assert (tmp_path / "exp" / "reward_curve.png").is_file()


def test_a_second_tracker_with_the_first_ones_state_continues_the_same_mlflow_run(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    first = Tracker([LoggerName.console, LoggerName.mlflow], run_info(tmp_path))
    first.log({"reward/overall": 0.1}, 1)
    first.log({"reward/overall": 0.2, "val/reward/overall": 0.3}, 2)
    first.log_samples([sample(2, "red")], 2)
    state = json.loads(json.dumps(first.state()))  # as a checkpoint would store it
    run_id = state["mlflow"]["run_id"]
    first.close(failed=True)  # the first process died
    client = mlflow_client(tmp_path)
    assert client.get_run(run_id).info.status == "FAILED"

    # The resumed run may change a setting: the new value is reported, the first one kept.
    resumed_info = run_info(tmp_path)
    resumed_info.config["trainer"]["max_steps"] = 9
    second = Tracker([LoggerName.console, LoggerName.mlflow], resumed_info, resume_state=state)
    assert second.state()["mlflow"] == state["mlflow"]
    # The console's summary state goes on from where the first process left it.
    assert second.state()["console"]["first_val"] == state["console"]["first_val"] == {"step": 2, "scores": {"overall": 0.3}}
    second.log({"reward/overall": 0.4, "val/reward/overall": 0.5}, 3)
    second.log_samples([sample(3, "green")], 3)
    assert client.get_run(run_id).info.status == "RUNNING"
    second.close()

    mlrun = the_run(client)  # still one run
    assert mlrun.info.run_id == run_id and mlrun.info.status == "FINISHED"
    assert history(client, run_id, "reward/overall") == [(1, 0.1), (2, 0.2), (3, 0.4)]
    assert history(client, run_id, "val/reward/overall") == [(2, 0.3), (3, 0.5)]
    assert mlrun.data.params["trainer.max_steps"] == ""  # the first run's (unset)
    table = json.loads(Path(client.download_artifacts(run_id, "validation/samples.json", str(tmp_path))).read_text())
    assert [r[table["columns"].index("step")] for r in table["data"]] == [2, 3]


def test_continuing_a_run_the_store_does_not_hold_fails_with_the_fix(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with pytest.raises(RuntimeError, match="cannot continue run 0123456789abcdef.*MLFLOW_TRACKING_URI"):
        Tracker([LoggerName.mlflow], run_info(tmp_path), resume_state={"mlflow": {"run_id": "0123456789abcdef"}})


def test_mlflow_tracking_uri_replaces_the_embedded_store(tmp_path, monkeypatch):
    store = tmp_path / "shared" / "mlflow.db"
    store.parent.mkdir()
    # A user's store keeps MLflow's own artifact default (./mlruns), so run where that is harmless.
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{store}")
    tracker = Tracker([LoggerName.mlflow], run_info(tmp_path, project="shared-project"))
    tracker.log({"reward/overall": 0.5}, 1)
    tracker.close()
    assert not (tmp_path / "exp" / "mlflow.db").exists()
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{store}")
    assert history(client, the_run(client, "shared-project").info.run_id, "reward/overall") == [(1, 0.5)]


# ------------------------------------------------------------- TensorBoard, file


def test_tensorboard_and_file_loggers_hold_every_scalar_of_every_step(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    steps = {
        1: {"reward/overall": 0.25, "actor/pg_loss": -0.125, "timing_s/gen": 3.5},
        2: {"reward/overall": 0.5, "actor/pg_loss": 0.0625, "val/reward/overall": 0.75},
    }
    tracker = Tracker([LoggerName.file, LoggerName.tensorboard], run_info(tmp_path))
    for step, metrics in steps.items():
        tracker.log(metrics, step)
    tracker.log_samples([sample(2, "red"), sample(2, "blue")], 2)
    tracker.close()

    events = EventAccumulator(str(tmp_path / "exp" / "tensorboard"), size_guidance={"scalars": 0, "images": 0})
    events.Reload()
    logged = {
        tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]
    }
    expected: dict[str, dict[int, float]] = {}
    for step, metrics in steps.items():
        for key, value in metrics.items():
            expected.setdefault(key, {})[step] = value
    assert logged == expected  # the values are exact in float32
    assert set(events.Tags()["images"]) == {"val/sample_0", "val/sample_1"}
    assert "val/samples/text_summary" in events.Tags()["tensors"]

    lines = [json.loads(line) for line in (tmp_path / "exp" / "metrics.jsonl").read_text().splitlines()]
    assert lines == [{"step": step, **metrics} for step, metrics in steps.items()]


# ------------------------------------------------------------------------- perf


def test_peak_table_covers_the_datacenter_gpus_and_prefers_the_longest_match():
    assert peak_flops("NVIDIA H200") == 989e12
    assert peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops("NVIDIA H100 PCIe") == 756e12
    assert peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops("NVIDIA L20") == 119.5e12
    assert peak_flops("NVIDIA L40") == 181e12
    assert peak_flops("NVIDIA L40S") == 362e12
    assert peak_flops("H100") == 989e12  # Ray's accelerator_type form
    assert peak_flops("Tesla T4") is None


def test_parameter_count_from_safetensors_headers_matches_the_loaded_model(tiny_assets):
    from safetensors.torch import load_file

    tensors = load_file(tiny_assets.model_dir / "model.safetensors")
    assert count_parameters(tiny_assets.model_dir) == sum(t.numel() for t in tensors.values())
    assert count_parameters(tiny_assets.model_dir.parent) is None  # no safetensors there


def test_cpu_peak_is_measured_and_plausible():
    peak = measure_cpu_peak_flops(threads=1, seconds=0.1, size=256)
    # One core does more than 100 MFLOP/s and less than 10 TFLOP/s of fp32 matmul.
    assert 1e8 < peak < 1e13 and math.isfinite(peak)


def test_the_cpu_peak_of_a_dtype_without_fast_kernels_takes_about_the_time_asked():
    # bfloat16 matmuls on a CPU without AMX run at about 1 GFLOP/s: four products of 1024 (the warm-up and the
    # three repetitions at least) took 12.6 s of every bf16 run's start on the 2-core machine. The measurement
    # shrinks the product instead; 0.2 s asked, 3 s allowed for a loaded machine.
    start = time.perf_counter()
    peak = measure_cpu_peak_flops(threads=1, dtype=torch.bfloat16, seconds=0.2)
    assert time.perf_counter() - start < 3.0 and 1e7 < peak < 1e13


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_resumed_run_drops_the_earlier_attempts_lines_past_its_checkpoint(tmp_path, capsys):
    # The earlier attempt validated at step 0, trained steps 1..5, saved at 3 and was killed: 4 and 5 run again.
    metrics = tmp_path / "exp" / "metrics.jsonl"
    metrics.parent.mkdir()
    earlier = [{"step": 0, "val/reward/overall": 0.5}] + [{"step": s, "reward/overall": s / 10} for s in range(1, 6)]
    metrics.write_text("".join(json.dumps(m) + "\n" for m in earlier) + '{"step": 6, "rew')  # and a line cut short
    run = dataclasses.replace(run_info(tmp_path), resumed_step=3)
    tracker = Tracker([LoggerName.file], run)
    for step in (4, 5):
        tracker.log({"reward/overall": step / 100}, step)
    tracker.close()
    lines = _lines(metrics)
    assert [m["step"] for m in lines] == [0, 1, 2, 3, 4, 5]  # each step once: a plot of the file is right
    assert lines[:4] == earlier[:4] and lines[4:] == [{"step": 4, "reward/overall": 0.04}, {"step": 5, "reward/overall": 0.05}]
    assert f"dropped 3 line(s) of {metrics} past step 3" in capsys.readouterr().out


def test_the_runner_tells_the_file_logger_the_step_it_resumes_from(tmp_path):
    from vlmrl.driver.checkpoint import save_trainer_state
    from vlmrl.driver.runner import _tracker
    from vlmrl.plan import Cluster, resolve

    config = load_config(
        ["config=examples/quickstart.yaml", f"trainer.output_dir={tmp_path}", "trainer.logger=[file]"], Cluster(0, 2)
    )
    plan = resolve(config, Cluster(0, 2))
    checkpoint = Path(plan.checkpoint_dir) / "global_step_2"
    checkpoint.mkdir(parents=True)
    save_trainer_state(checkpoint, {"global_step": 2})
    metrics = Path(plan.experiment_dir) / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"step": s, "reward/overall": 0.0}) + "\n" for s in range(1, 5)))
    _tracker(config, plan, checkpoint).close()
    assert [m["step"] for m in _lines(metrics)] == [1, 2]
    # val_only trains nothing, so it re-logs nothing: the file is left whole.
    metrics.write_text("".join(json.dumps({"step": s, "reward/overall": 0.0}) + "\n" for s in range(1, 5)))
    val_only = dataclasses.replace(config, trainer=dataclasses.replace(config.trainer, val_only=True))
    _tracker(val_only, plan, checkpoint).close()
    assert [m["step"] for m in _lines(metrics)] == [1, 2, 3, 4]
