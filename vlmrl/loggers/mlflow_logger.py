"""``mlflow``, the default logger: an embedded local store unless MLFLOW_TRACKING_URI is set.

The embedded store is a SQLite file, ``<experiment dir>/mlflow.db``, with
artifacts under ``<experiment dir>/mlartifacts/``. Nothing listens on a port;
to look at it, start the UI yourself, on loopback:

    mlflow ui --backend-store-uri sqlite:///<experiment dir>/mlflow.db --host 127.0.0.1 --port 5000

The MLflow experiment is ``trainer.project_name`` and the run is named
``trainer.experiment_name``. A run holds the flattened resolved config and
plan as parameters, every metric at every step, and three artifacts:
``config.yaml`` (the resolved config; ``config=config.yaml`` reruns it),
``validation/samples.json`` (a table of validation samples with their images,
which grows at each validation and which the UI shows with the images) and
``reward_curve.png`` (redrawn at each validation, also written next to the store).

Resume: ``state()`` holds the run id, and a logger given it continues that run.

MLflow is imported when this logger is built, not before (it takes seconds).
Its usage telemetry is switched off unless the user set MLFLOW_DISABLE_TELEMETRY:
training machines often have no route out, and a run should not try one. Its
artifact progress bars are off too, unless MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR is set.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Any

import yaml

from vlmrl.loggers.base import (
    RunInfo,
    ValidationSample,
    image_strip,
    placeholder_image,
)
from vlmrl.loggers.curves import CURVE_KEYS, plot_curves

# MLflow's limits (mlflow.utils.validation): entries per log_batch call, and parameter value length.
MAX_PARAMS_PER_BATCH = 100
MAX_METRICS_PER_BATCH = 1000
MAX_PARAM_VALUE_LENGTH = 6000


def mlflow_key(key: str) -> str:
    """``key`` with the characters MLflow rejects in names replaced by ``_``.

    >>> mlflow_key("val/geo3k@test/accuracy")
    'val/geo3k_test/accuracy'
    """
    key = re.sub(r"[^/\w.\- :]", "_", key)
    return re.sub(r"/+", "/", key).strip("/")


def _chunks(items: list, size: int) -> list[list]:
    return [items[i : i + size] for i in range(0, len(items), size)]


class MlflowLogger:
    SAMPLES = "validation/samples.json"
    CURVES = "reward_curve.png"

    def __init__(self, run: RunInfo, resume: dict[str, Any] | None = None):
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        # Its download bars (log_table reads the table back to append) would tear the step bar.
        os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
        from mlflow import MlflowClient

        self.run = run
        self.experiment_dir = Path(run.experiment_dir)
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        embedded = not uri
        if embedded:
            self.experiment_dir.mkdir(parents=True, exist_ok=True)
            uri = f"sqlite:///{self.experiment_dir / 'mlflow.db'}"
        self.tracking_uri = uri
        self.client = MlflowClient(tracking_uri=uri)
        params = {mlflow_key(k): v[:MAX_PARAM_VALUE_LENGTH] for k, v in run.params().items()}
        if resume:
            self.run_id = self._continue(resume["run_id"], params)
        else:
            self.run_id = self._start(params, embedded)
        ui = f"mlflow ui --backend-store-uri {uri} --host 127.0.0.1 --port 5000" if embedded else uri
        print(f"mlflow: run {self.run_id} ({'continued' if resume else 'new'}); view it with: {ui}", flush=True)

    def _start(self, params: dict[str, str], embedded: bool) -> str:
        from mlflow.entities import Param

        experiment_id = self._experiment_id(embedded)
        mlrun = self.client.create_run(
            experiment_id, run_name=self.run.experiment, tags={"vlmrl.experiment_dir": str(self.experiment_dir)}
        )
        run_id = mlrun.info.run_id
        for chunk in _chunks([Param(k, v) for k, v in params.items()], MAX_PARAMS_PER_BATCH):
            self.client.log_batch(run_id, params=chunk)
        self.client.log_text(run_id, yaml.safe_dump(self.run.config, sort_keys=False), "config.yaml")
        return run_id

    def _experiment_id(self, embedded: bool) -> str:
        from mlflow.exceptions import MlflowException

        name = self.run.project
        experiment = self.client.get_experiment_by_name(name)
        if experiment is not None:
            if experiment.lifecycle_stage == "deleted":
                self.client.restore_experiment(experiment.experiment_id)
            return experiment.experiment_id
        # The embedded store keeps artifacts beside it; a user's store decides for itself.
        location = (self.experiment_dir / "mlartifacts").as_uri() if embedded else None
        try:
            return self.client.create_experiment(name, artifact_location=location)
        except MlflowException:
            # Another run sharing the store created it first.
            experiment = self.client.get_experiment_by_name(name)
            if experiment is None:
                raise
            return experiment.experiment_id

    def _continue(self, run_id: str, params: dict[str, str]) -> str:
        from mlflow.entities import Param
        from mlflow.exceptions import MlflowException

        try:
            mlrun = self.client.get_run(run_id)
        except MlflowException as e:
            raise RuntimeError(
                f"mlflow: cannot continue run {run_id}: it is not in {self.tracking_uri} ({e.message}). "
                "Point MLFLOW_TRACKING_URI at the store the run was logged to (unset, the store is "
                "<experiment dir>/mlflow.db), or start without the tracker's resume state for a new run."
            ) from e
        self.client.update_run(run_id, status="RUNNING")
        # MLflow keeps a parameter's first value; new keys are added, changed values reported.
        logged = mlrun.data.params
        new = [Param(k, v) for k, v in params.items() if k not in logged]
        for chunk in _chunks(new, MAX_PARAMS_PER_BATCH):
            self.client.log_batch(run_id, params=chunk)
        changed = sorted(k for k, v in params.items() if k in logged and logged[k] != v)
        if changed:
            print(
                f"mlflow: run {run_id} continues with changed settings; its parameters keep the first values: "
                + ", ".join(f"{k}={logged[k]!r}->{params[k]!r}" for k in changed),
                flush=True,
            )
        return run_id

    def log(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        entries = [Metric(mlflow_key(k), float(v), now, step) for k, v in metrics.items()]
        for chunk in _chunks(entries, MAX_METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=chunk)
        if any(k.startswith("val/") for k in metrics):
            self._draw_curves()

    def _draw_curves(self) -> None:
        history = {
            key: [(m.step, m.value) for m in self.client.get_metric_history(self.run_id, key)] for key in CURVE_KEYS
        }
        path = plot_curves(history, self.experiment_dir / self.CURVES, title=f"{self.run.project} / {self.run.experiment}")
        self.client.log_artifact(self.run_id, str(path))

    def log_samples(self, samples: list[ValidationSample], step: int) -> None:
        if not samples:
            return
        import pandas as pd

        table: dict[str, list] = {
            "step": [s.step for s in samples],
            "data_source": [s.data_source for s in samples],
            "prompt": [s.prompt for s in samples],
        }
        if any(s.images for s in samples):
            # A table column holds images or no images; a text-only prompt shows a blank tile.
            table["image"] = [image_strip(s.images) or placeholder_image() for s in samples]
        table["response"] = [s.response for s in samples]
        table["ground_truth"] = [s.ground_truth for s in samples]
        table["reward"] = [s.reward for s in samples]
        for key in sorted({k for s in samples for k in s.sub_scores}):
            table[f"score/{key}"] = [s.sub_scores.get(key) for s in samples]
        # log_table appends to the artifact if it exists, so one table holds every validation.
        self.client.log_table(self.run_id, data=pd.DataFrame(table), artifact_file=self.SAMPLES)

    def state(self) -> dict[str, Any]:
        return {"run_id": self.run_id}

    def close(self, failed: bool = False) -> None:
        self.client.set_terminated(self.run_id, "FAILED" if failed else "FINISHED")
