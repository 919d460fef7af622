"""EasyR1's own default config (examples/config.yaml at hiyouga/EasyR1 b44b311, written out in
tests/fixtures/easyr1/examples_config_b44b311.yaml) runs on vlmrl as it is.

With only the model, the data and the device count overridden it validates
on a simulated node of 8 GPUs with no problem at all (its tensor_parallel_size
of 2 included), and it trains 2 steps on CPU with the tiny text Qwen2 on 2
workers that share one vLLM engine (tensor_parallel_size=2, as the file has it).
"""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
import yaml
from helpers.configs import GPUS
from helpers.runs import REPO, run_command, tail

from vlmrl.config import parse_config, to_dict
from vlmrl.plan import resolve
from vlmrl.testing.assets import ensure_text_assets
from vlmrl.validate import load_config, validate

FIXTURE = REPO / "tests" / "fixtures" / "easyr1" / "examples_config_b44b311.yaml"
EASYR1 = f"config={FIXTURE}"


@pytest.fixture(scope="module")
def text_assets():
    return ensure_text_assets()


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch):
    monkeypatch.chdir(REPO)  # the file names ./examples/format_prompt/math.jinja and ./examples/reward_function/math.py


def ours(assets, workers: int = 8) -> list[str]:
    """The only overrides: a local model, local data, and the devices of the machine."""
    return [
        f"worker.actor.model.model_path={assets.model_dir}",
        f"data.train_files={assets.math_train_file}",
        f"data.val_files={assets.math_val_file}",
        f"trainer.n_gpus_per_node={workers}",
    ]


def _leaves(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out |= _leaves(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


def test_every_key_of_easyr1s_default_config_loads_with_its_value():
    written = _leaves(yaml.safe_load(FIXTURE.read_text()))
    assert len(written) == 88  # every leaf of EasyR1's examples/config.yaml at b44b311
    loaded = _leaves(to_dict(parse_config([EASYR1])))
    for key, value in written.items():
        assert key in loaded, key
        assert loaded[key] == value, (key, loaded[key], value)


def test_with_model_data_and_devices_overridden_it_validates_on_8_gpus_with_no_problem(text_assets, monkeypatch):
    # The file logs to wandb; the simulated GPU node has the package, as EasyR1's own image does.
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "wandb" else real_find_spec(name, *a))
    config = load_config([EASYR1, *ours(text_assets)], GPUS)
    assert validate(config, GPUS) == []
    plan = resolve(config, GPUS)
    assert (plan.world_size, plan.tensor_parallel_size, plan.rollout_groups) == (8, 2, 4)
    # Accepted, and said: rank-0 init only saves host memory at start; vlmrl loads on every worker.
    assert all("enable_rank0_init" in note for note in plan.notes), plan.notes


STEPS = 2
CPU_SIZES = [  # what a CPU can train in seconds; every other value stays EasyR1's
    f"trainer.max_steps={STEPS}",
    "data.rollout_batch_size=4",
    "data.val_batch_size=16",  # the tiny math set has 64 validation rows, EasyR1's 1024 is math12k's
    "worker.actor.global_batch_size=4",
    "data.max_response_length=16",
    "trainer.logger=[console,file]",
    "worker.rollout.calculate_log_probs=true",
    # float32 as every CPU test runs (bfloat16 is slow on CPU and leaves ~2e-2 between vLLM's and the actor's
    # log-probs, which would hide a resync that went wrong).
    "worker.actor.fsdp.torch_dtype=fp32",
    "worker.rollout.dtype=fp32",
]


@pytest.fixture(scope="module")
def easyr1_run(text_assets, tmp_path_factory):
    """``python -m vlmrl.main config=<EasyR1's file>`` with our model, data and 2 workers, and CPU-sized batches."""
    out = tmp_path_factory.mktemp("easyr1") / "outputs"
    command = [sys.executable, "-m", "vlmrl.main", EASYR1, *ours(text_assets, workers=2), *CPU_SIZES,
               f"trainer.output_dir={out}"]  # fmt: skip
    proc = run_command(command, timeout=900)
    assert proc.returncode == 0, tail(proc)
    # EasyR1's project and experiment names, unchanged.
    return out / "easy_r1" / "qwen2_5_7b_math_grpo", proc


def test_it_trains_two_steps_on_cpu_with_two_workers_sharing_one_tensor_parallel_engine(easyr1_run):
    experiment, proc = easyr1_run
    assert "a vLLM engine shard (1 engine(s), each over 2 workers)" in proc.stdout, tail(proc)
    rows = [json.loads(line) for line in (experiment / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "actor/pg_loss" in r]
    assert [r["step"] for r in train] == [1, 2]
    assert rows[0]["step"] == 0 and "val/reward/overall" in rows[0]  # val_before_train: true
    for r in train:
        assert r["actor/lr"] == 1e-6  # EasyR1's lr, constant, no warm-up
        # The two workers sample as one engine after each resync: vLLM's log-probs are the actor's.
        assert r["rollout/log_prob_diff_max"] < 1e-3, r
        assert "reward/accuracy" in r and "reward/format" in r  # EasyR1's math reward, by its EasyR1 path
    assert (experiment / "checkpoints" / f"global_step_{STEPS}" / "COMPLETE").is_file()
