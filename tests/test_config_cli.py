"""The configuration from a user's side: shipped and EasyR1 YAMLs, typos, --help and --dry-run.

The CLI runs in a subprocess, as a user would run it; --dry-run must finish
without starting Ray or loading a model.
"""

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.configs import CPU, GPUS, QUICKSTART, problems_of

from vlmrl.config import (
    DERIVED_KEYS,
    RENAMED_KEYS,
    Config,
    DType,
    help_text,
    iter_options,
    parse_config,
)
from vlmrl.plan import resolve
from vlmrl.algos import LossAvgMode
from vlmrl.validate import load_config

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((REPO / "examples").rglob("*.yaml"))
EASYR1 = "config=tests/fixtures/easyr1_config.yaml"


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch, quickstart_assets):
    # The quickstart names the format prompt and reward function relative to the repo root,
    # and resolves ${tiny:quickstart_...} to the built quickstart assets.
    monkeypatch.chdir(REPO)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    # Prints whether Ray was imported, so "exits without starting Ray" means something.
    code = (
        "import sys, runpy; sys.argv = ['vlmrl', *sys.argv[1:]]\n"
        "try:\n    runpy.run_module('vlmrl.main', run_name='__main__')\n"
        "except SystemExit as e:\n    print('ray imported:', 'ray' in sys.modules); raise\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )


# --------------------------------------------------------------------------- shipped examples


def test_there_are_examples():
    assert EXAMPLES, "examples/*.yaml went missing"


@pytest.mark.parametrize("cluster", [CPU, GPUS], ids=["cpu", "8-gpu-node"])
@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_every_example_yaml_loads_and_validates(path, cluster):
    config = load_config([f"config={path}"], cluster)
    resolve(config, cluster)


# --------------------------------------------------------------------------- an EasyR1 YAML


def test_an_easyr1_yaml_parses_unchanged():
    config = parse_config([EASYR1])
    assert (
        config.worker.actor.loss_avg_mode is LossAvgMode.token_mean
    )  # EasyR1's "token"
    assert config.worker.rollout.dtype is DType.bfloat16  # EasyR1's "bf16"
    assert config.worker.actor.fsdp.mp_reduce_dtype is DType.float32  # "fp32"
    assert config.worker.rollout.val_override_config.temperature == 0.6
    assert (
        config.worker.rollout.val_override_config.top_k is None
    )  # unset: the training top_k
    assert config.worker.critic.global_batch_size == 256
    assert config.worker.actor.model.model_path == "Qwen/Qwen2.5-VL-7B-Instruct"
    assert (
        config.algorithm.filter_key == "overall"
        and config.trainer.max_try_make_batch == 20
    )


def test_an_easyr1_yaml_validates_as_it_is_on_a_gpu_node():
    # Tensor parallelism (its tensor_parallel_size=2) is honoured now: nothing in the file is refused.
    config = load_config([EASYR1], GPUS)
    assert config.worker.rollout.tensor_parallel_size == 2


def test_an_easyr1_yaml_with_those_settings_changed_validates_and_plans(tiny_assets):
    fixes = ["worker.rollout.tensor_parallel_size=1"]  # its offload and mixed-precision settings are honoured
    config = load_config([EASYR1, *fixes], GPUS)
    plan = resolve(config, GPUS)
    assert (plan.device, plan.world_size) == ("cuda", 8)
    assert plan.samples_per_step_per_device == 512 * 5 // 8
    assert plan.micro_batches_per_update == 128 * 5 // 8  # micro-batches of 1
    assert (plan.update_token_budget, plan.experience_token_budget) == (1 * 4096, 2 * 4096)  # micro x (2048 + 2048)
    assert [n.split(":")[0] for n in plan.notes] == [
        "worker.actor.use_torch_compile=true",
        "worker.actor.fsdp.enable_rank0_init=true",
        "worker.ref.fsdp.enable_rank0_init=true",
        "worker.actor.model.model_path=Qwen/Qwen2.5-VL-7B-Instruct",
    ]


# --------------------------------------------------------------------------- typos and EasyR1's own keys


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        (
            "worker.actor.clip_ratio_hgh=0.3",
            "worker.actor.clip_ratio_hgh: unknown key; did you mean worker.actor.clip_ratio_high?",
        ),
        (
            "worker.rollout.val_override_config.temprature=0.5",
            "did you mean worker.rollout.val_override_config.temperature?",
        ),
        (
            "algorithm.adv_estimator=grop",
            "algorithm.adv_estimator='grop': not a valid option; choose one of: grpo,",
        ),
        ("algorithm.adv_estimator=grop", "; did you mean grpo?"),
        ("worker.actor.loss_type=gsop", "; did you mean gspo?"),
        ("algorithm.kl_type=adaptiv", "; did you mean adaptive?"),
        ("worker.actor.optim.strategy=adam", "; did you mean adamw?"),
        ("worker.actor.optim.lr_scheduler_type=cosin", "; did you mean cosine?"),
        ("worker.rollout.name=vlm", "; did you mean vllm?"),
        ("worker.actor.fsdp.torch_dtype=bfloat61", "; did you mean bfloat16?"),
        ("trainer.device=cdua", "; did you mean cuda?"),
    ],
)
def test_typos_in_keys_and_values_fail_with_a_suggestion(override, expected):
    (problem,) = problems_of(QUICKSTART, override)
    assert expected in problem


@pytest.mark.parametrize("key", sorted(DERIVED_KEYS))
def test_setting_a_derived_key_names_what_it_is_derived_from(key):
    (problem,) = problems_of(QUICKSTART, f"{key}=1")
    assert problem.startswith(
        f"{key}: derived, not set: vlmrl computes it from {DERIVED_KEYS[key]}"
    )
    assert "remove it" in problem


@pytest.mark.parametrize("key", sorted(RENAMED_KEYS))
def test_an_older_easyr1_name_points_to_the_new_one(key):
    (problem,) = problems_of(QUICKSTART, f"{key}=1")
    assert problem == f"{key}: an older EasyR1 name; use {RENAMED_KEYS[key]}"


# --------------------------------------------------------------------------- --help


def test_every_option_has_a_one_line_help():
    options = list(iter_options())
    assert len(options) > 150
    assert [key for key, _, _, doc in options if not doc] == []


def test_help_lists_every_option_with_type_default_and_help():
    text = help_text()
    for key, _, _, doc in iter_options():
        assert f"\n  {key}  " in text
        assert doc in text
    assert "  algorithm.adv_estimator  {grpo, rloo, " in text
    assert "  worker.rollout.val_override_config.top_p  float or null = null" in text
    assert (
        "  trainer.logger  list of {console, file, mlflow, tensorboard, wandb, swanlab} = [console, file, mlflow]"
        in text
    )


def test_help_text_comes_from_the_attribute_docstrings():
    # One place: changing the docstring is the only way to change the help.
    from vlmrl.config import TrainerConfig, field_docs

    assert (
        field_docs(TrainerConfig)["max_steps"]
        == "Stop after this many steps even if epochs remain."
    )
    assert len(field_docs(TrainerConfig)) == len(dataclasses.fields(TrainerConfig))


def test_cli_help_prints_the_options_and_exits_0():
    proc = run_cli("--help")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: python -m vlmrl.main config=<yaml>")
    assert "  worker.actor.clip_ratio_high  float = 0.3\n" in proc.stdout
    assert "ray imported: False" in proc.stdout


# --------------------------------------------------------------------------- --dry-run


def test_cli_dry_run_prints_the_config_and_plan_without_ray(tmp_path):
    proc = run_cli(QUICKSTART, "trainer.max_steps=3", "--dry-run")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "# resolved config\n" in out and "# plan\n" in out
    assert "  max_steps: 3\n" in out  # the override, resolved into the printed config
    assert "model_path: " in out and "${tiny:" not in out  # interpolations resolved
    assert "workers: 1 on cpu" in out
    assert "per update: 128 samples, 128 per device in 4 micro-batch(es) of 32" in out
    assert "ray imported: False" in out
    # The printed config is a loadable YAML that gives the same config back.
    saved = tmp_path / "resolved.yaml"
    saved.write_text(out.split("# plan")[0])
    assert load_config([f"config={saved}"], CPU) == load_config(
        [QUICKSTART, "trainer.max_steps=3"], CPU
    )


def test_cli_dry_run_with_a_bad_config_exits_2_with_every_problem():
    proc = run_cli(
        QUICKSTART, "data.shufle=true", "worker.actor.loss_type=gsop", "--dry-run"
    )
    assert proc.returncode == 2
    assert (
        "did you mean data.shuffle?" in proc.stderr
        and "did you mean gspo?" in proc.stderr
    )
    assert "Traceback" not in proc.stderr


def test_the_schema_defaults_are_easyr1_compatible_names():
    # Spot checks that the sections EasyR1 has exist under its names.
    config = Config()
    for dotted in (
        "worker.ref.fsdp.enable_cpu_offload",
        "worker.critic.cliprange_value",
        "worker.actor.model.lora.exclude_modules",
        "worker.actor.optim.lr_scheduler_type",
        "worker.rollout.val_override_config.n",
        "algorithm.kl_horizon",
        "data.mini_rollout_batch_size",
        "trainer.find_last_checkpoint",
    ):
        obj = config
        for part in dotted.split("."):
            obj = getattr(obj, part)
