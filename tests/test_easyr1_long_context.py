"""EasyR1's long-context example, its DAPO run of Qwen3-14B with 20k-token responses, validates as written.

The script (examples/qwen3_14b_dapo17k_dapo.sh at hiyouga/EasyR1 b44b311) splits each sequence over 8 ranks
(``worker.actor.ulysses_size=8``) and shards the engine over 4 (``tensor_parallel_size=4``). Its arguments are
kept as the script passes them in tests/fixtures/easyr1/qwen3_14b_dapo17k_dapo_b44b311.args (read with the
shell's quoting), over EasyR1's own default config. Only what cannot exist here is replaced: the model and the
data (a Hub id and a Hub dataset) by the tiny local ones, and EasyR1's reward file by vlmrl's DAPO reward, which
takes the same keyword arguments. On a simulated node of 8 GPUs the result has no problem at all, and the plan
holds the sequence-parallel group the script asked for; with hybrid sharding added (``fsdp.fsdp_size``) too.
"""

from __future__ import annotations

import importlib.util
import shlex

import pytest
from helpers.configs import GPUS
from helpers.runs import REPO

from vlmrl.plan import resolve
from vlmrl.testing.assets import ensure_text_assets
from vlmrl.validate import load_config, validate

EASYR1 = REPO / "tests" / "fixtures" / "easyr1"
SCRIPT_ARGS = EASYR1 / "qwen3_14b_dapo17k_dapo_b44b311.args"


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch):
    monkeypatch.chdir(REPO)  # the script names ./examples/format_prompt/dapo.jinja


@pytest.fixture
def wandb_installed(monkeypatch):
    """EasyR1's config logs to wandb; the simulated GPU node has the package, as EasyR1's own image does."""
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if name == "wandb" else real_find_spec(name, *a)
    )


def script_args(assets) -> list[str]:
    args = shlex.split(SCRIPT_ARGS.read_text())
    assert args[0] == "config=examples/config.yaml", args[0]
    return [
        f"config={EASYR1 / 'examples_config_b44b311.yaml'}",  # EasyR1's examples/config.yaml as it was
        *args[1:],
        # Later keys win, as on the command line.
        f"worker.actor.model.model_path={assets.model_dir}",
        f"data.train_files={assets.math_train_file}",
        f"data.val_files={assets.math_val_file}",
        "worker.reward.reward_function=reward_functions/dapo.py:compute_score",
    ]


def test_the_script_sets_what_this_test_is_about():
    args = shlex.split(SCRIPT_ARGS.read_text())
    assert "worker.actor.ulysses_size=8" in args and "worker.rollout.tensor_parallel_size=4" in args
    assert "trainer.n_gpus_per_node=8" in args


@pytest.mark.parametrize(
    ("extra", "mesh"),
    [([], (8,)), (["worker.actor.fsdp.fsdp_size=4"], (2, 4))],
    ids=["as-written", "with-hybrid-sharding"],
)
def test_easyr1s_ulysses_example_validates_on_8_gpus_with_no_problem(extra, mesh, wandb_installed):
    from vlmrl.train.fsdp_options import mesh_shape

    assets = ensure_text_assets()
    config = load_config([*script_args(assets), *extra], GPUS)  # raises ConfigError listing every problem
    assert validate(config, GPUS) == []
    plan = resolve(config, GPUS)
    assert config.worker.actor.ulysses_size == 8
    assert (plan.world_size, plan.tensor_parallel_size) == (8, 4)
    assert mesh_shape(plan.world_size, config.worker.actor.fsdp.fsdp_size) == mesh
