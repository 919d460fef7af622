"""``vlmrl.api.train``: one training from Python, in this process, with the data, the reward function and the
workflow class given as objects, and the config as a mapping; everything checked before Ray starts. One training
(a module fixture) serves the tests of the objects and of the mapping."""

from __future__ import annotations

import io
import json

import pyarrow.parquet as pq
import pytest
import ray
import yaml
from PIL import Image

from vlmrl.api import TrainResult, train
from vlmrl.config import ConfigError
from vlmrl.user_code import load_object

FILE = "tests/fixtures/workflows/workflows.py"
SMALL = {
    "trainer.max_steps": 1, "data.rollout_batch_size": 2, "worker.actor.global_batch_size": 2,
    "worker.actor.micro_batch_size_per_device_for_update": 4, "worker.rollout.n": 2, "data.val_files": "",
    "trainer.val_before_train": False, "trainer.logger": ["file"], "trainer.save_freq": -1,
}  # fmt: skip


def _rows(quickstart_assets, n: int = 4) -> list[dict]:
    """The first quickstart rows as a user would build them: PIL images, not parquet cells."""
    table = pq.read_table(quickstart_assets.train_file).slice(0, n).to_pylist()
    return [{**r, "images": [Image.open(io.BytesIO(i["bytes"])) for i in r["images"]]} for r in table]


def test_bad_input_is_refused_before_ray_starts():
    assert not ray.is_initialized()
    with pytest.raises(TypeError, match="top level of a Python file"):
        train("examples/quickstart.yaml", reward=lambda reward_input: 0.0)
    with pytest.raises(ConfigError) as e:
        train("examples/quickstart.yaml", {"trainer.max_stepz": 1, "worker.rollout.n": 0})
    assert "trainer.max_stepz" in str(e.value) and "worker.rollout.n" in str(e.value)  # every problem at once
    assert not ray.is_initialized()


def test_a_bad_row_given_as_an_object_is_named_by_its_file_and_row(quickstart_assets, tmp_path):
    rows = _rows(quickstart_assets)
    rows[2] = {k: v for k, v in rows[2].items() if k != "images"}  # its prompt's <image> has no picture
    with pytest.raises(Exception) as e:
        train("examples/quickstart.yaml", {**SMALL, "trainer.output_dir": str(tmp_path)}, train_data=rows)
    written = tmp_path / "vlmrl" / "quickstart" / "data" / "train.parquet"
    assert written.is_file() and f"{written} row 2, key 'images'" in str(e.value), str(e.value)[-2000:]


@pytest.fixture(scope="module")
def trained(quickstart_assets, tmp_path_factory):
    """One in-process training that both tests below read: the config as a mapping with mapping overrides, the
    rows, the workflow class and the reward function as objects."""
    tmp = tmp_path_factory.mktemp("python_train")
    with open("examples/quickstart.yaml") as f:
        config = yaml.safe_load(f)  # the quickstart as a mapping, its ${tiny:...} paths included
    config["trainer"]["experiment_name"] = "from_a_mapping"
    workflow = load_object(f"{FILE}:LookAgain", "test")
    reward = load_object(f"{FILE}:logging_reward", "test")
    log = tmp / "calls.jsonl"
    result = train(
        config,
        {**SMALL, "trainer.output_dir": str(tmp / "out"), "data.max_response_length": 48,
         "worker.reward.reward_function_kwargs": {"log_path": str(log)}},
        train_data=_rows(quickstart_assets), workflow=workflow, reward=reward,
    )  # fmt: skip
    return result, log


def test_a_workflow_reward_and_rows_given_as_objects_train(trained):
    result, log = trained
    assert isinstance(result, TrainResult) and result.steps == 1
    assert "actor/pg_loss" in result.metrics and result.metrics["agent/turns/mean"] > 1.5
    assert (result.experiment_dir / "data" / "train.parquet").is_file()
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(calls) == 4 and all(c["turns"] == 2 for c in calls)  # the object reward scored the workflow's turns
    assert not ray.is_initialized()  # the cluster this call started went with it


def test_a_mapping_config_and_mapping_overrides_train(trained):
    result, _ = trained
    assert result.steps == 1 and result.experiment_dir.name == "from_a_mapping" and "actor/pg_loss" in result.metrics
    assert not ray.is_initialized()  # the cluster this call started went with it
