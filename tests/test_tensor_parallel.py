"""vLLM tensor parallelism over the workers (worker.rollout.tensor_parallel_size): the rollout's split of the
prompts per tensor-parallel group, and the seeds and plan that make a group's workers one engine.

A real run: 2 CPU workers share one vLLM engine (TP=2, vLLM's external
launcher) and a large learning rate moves the weights each step; vLLM's
log-probs of what it sampled equal the actor's only if the resync gave each
TP rank its shard of the new weights. tests/test_easyr1_default_config.py
trains EasyR1's default config the same way.
"""

from __future__ import annotations

import pytest
from helpers.configs import CPU, GPUS, QUICKSTART
from helpers.runs import SMALL, read_metrics, run_main, tail

from vlmrl.plan import resolve
from vlmrl.validate import load_config
from vlmrl.workers.group import per_tensor_parallel_group


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch, quickstart_assets):
    from helpers.runs import REPO

    monkeypatch.chdir(REPO)


def test_each_group_of_consecutive_ranks_gets_one_share_of_the_prompts():
    prompts = list(range(8))
    # 8 workers, TP=2: 4 engines (ranks 0-1, 2-3, 4-5, 6-7), 2 prompts each, both ranks of an engine the same 2.
    assert per_tensor_parallel_group(prompts, world=8, tp=2) == [
        [0, 1], [0, 1], [2, 3], [2, 3], [4, 5], [4, 5], [6, 7], [6, 7],
    ]  # fmt: skip
    # TP=4: 2 engines of 4 prompts.
    assert per_tensor_parallel_group(prompts, world=8, tp=4) == [[0, 1, 2, 3]] * 4 + [[4, 5, 6, 7]] * 4
    # TP=1 is the split per worker it always was.
    assert per_tensor_parallel_group(prompts, world=4, tp=1) == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_a_share_that_does_not_split_over_the_engines_is_an_error():
    with pytest.raises(ValueError, match="3 items do not split evenly over 2 workers"):
        per_tensor_parallel_group([0, 1, 2], world=4, tp=2)


def test_the_plan_counts_one_engine_per_group_and_says_so():
    config = load_config(
        [QUICKSTART, "trainer.n_gpus_per_node=8", "worker.rollout.tensor_parallel_size=2",
         "worker.actor.micro_batch_size_per_device_for_update=16"], GPUS
    )
    plan = resolve(config, GPUS)
    assert (plan.tensor_parallel_size, plan.rollout_groups) == (2, 4)
    from vlmrl.plan import describe

    assert "a vLLM engine shard (4 engine(s), each over 2 workers)" in describe(plan, config)
    one = resolve(load_config([QUICKSTART], CPU), CPU)
    assert (one.tensor_parallel_size, one.rollout_groups) == (1, 1)


@pytest.fixture(scope="module")
def tp_run(quickstart_assets, tmp_path_factory):
    out = tmp_path_factory.mktemp("tp") / "outputs"
    # The two workers are also one Ulysses group (worker.actor.ulysses_size=2, padding-free): the actor's
    # log-probs, split over them, must still equal the engine's, and the run is the command-line check of SP.
    proc = run_main(
        out, *SMALL, "trainer.max_steps=3", "trainer.logger=[console,file]", "trainer.n_gpus_per_node=2",
        "worker.rollout.tensor_parallel_size=2", "worker.actor.micro_batch_size_per_device_for_update=2",
        "worker.rollout.calculate_log_probs=true", "worker.actor.optim.lr=1e-3", "worker.actor.entropy_coeff=0.01",
        "worker.actor.ulysses_size=2", "worker.actor.padding_free=true",
        experiment="tp", timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, tail(proc)
    return out, proc.stdout


def test_two_workers_share_one_engine_and_each_resync_reaches_both_shards(tp_run):
    out, stdout = tp_run
    assert "a vLLM engine shard (1 engine(s), each over 2 workers)" in stdout
    steps = [m for m in read_metrics(out, "tp") if "actor/pg_loss" in m]
    assert [m["step"] for m in steps] == [1, 2, 3]
    for m in steps:
        # fp32 everywhere: a rank left with its old shard would put the engine's log-probs far from the actor's.
        assert m["rollout/log_prob_diff_max"] < 1e-3, m
        assert m["actor/grad_norm"] > 0


def test_a_ulysses_group_of_two_workers_trains_through_the_command_line(tp_run):
    out, stdout = tp_run
    assert "sequence parallel: Ulysses groups of 2 workers" in stdout and "1 group(s) share each update" in stdout
    steps = [m for m in read_metrics(out, "tp") if "actor/pg_loss" in m]
    assert [m["step"] for m in steps] == [1, 2, 3]
    # Each step's update moved the weights, and the next step's engine (resynced) agrees with the split actor.
    assert all(m["actor/grad_norm"] > 0 and m["rollout/log_prob_diff_max"] < 1e-3 for m in steps), steps
