"""Every advantage estimator and every policy loss trains on the tiny VLM and ends with finite metrics.

Starting ``python -m vlmrl.main`` costs about half a minute (Ray, the FSDP
worker, the vLLM engine), so the variants share one Ray cluster, one reward
actor and one worker group, built with every piece any variant needs (a
reference model and a critic). Each variant is its own ``TrainingLoop`` over
those workers, as the Runner builds it, for a couple of steps: the trainer asks
the estimator what it needs (greedy baselines, values) and sends the loss
settings with each update, so nothing on the workers changes between variants.
"""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path

import pytest
from helpers.runs import SMALL
from helpers.shared_cluster import forked_runtime_env
from transformers import AutoProcessor

from vlmrl.validate import load_config
from vlmrl.data.loader import make_loader
from vlmrl.plan import detect_cluster, resolve
from vlmrl.driver.checkpoint import CheckpointManager
from vlmrl.driver.loop import TrainingLoop
from vlmrl.driver.runner import _dataset
from vlmrl.driver.sampler import OnlineFilteringError
from vlmrl.config import LoggerName
from vlmrl.loggers.tracking import RunInfo, Tracker

STEPS = 2

# Graded, so that groups have reward variance, except that every response to a
# "red" prompt scores 1: those groups are uniform and online filtering drops them.
REWARD = textwrap.dedent(
    """
    def compute_score(reward_input, **quickstart_kwargs):
        truth = reward_input["ground_truth"].lower()
        if truth == "red":
            return {"overall": 1.0, "overlap": 1.0}
        overlap = len(set(reward_input["response"].lower()) & set(truth)) / len(set(truth))
        return {"overall": overlap, "overlap": overlap}
    """
)

# What every variant shares (sizes, data, reward); the workers are built from these
# plus SUPERSET, which asks for every piece: a critic (gae) and a reference model.
COMMON = [*SMALL, "worker.critic.global_batch_size=2", "trainer.save_hf_weights=false", "trainer.logger=[file]"]
SUPERSET = ["algorithm.adv_estimator=gae", "algorithm.disable_kl=false"]

VARIANTS = {
    # estimators (with a loss type each, so every loss type also runs)
    "grpo": ["worker.actor.entropy_coeff=0.01"],
    "dr_grpo_gspo": [
        "algorithm.norm_adv_by_std_in_grpo=false",
        "worker.actor.loss_avg_mode=seq_mean_token_sum_norm",
        "worker.actor.loss_type=gspo",
    ],
    "grpo_passk_gspo_token": ["algorithm.adv_estimator=grpo_passk", "worker.actor.loss_type=gspo_token"],
    "rloo_cispo": ["algorithm.adv_estimator=rloo", "worker.actor.loss_type=cispo"],
    "reinforce_pp_sapo_no_kl": [
        "algorithm.adv_estimator=reinforce_plus_plus",
        "worker.actor.loss_type=sapo",
        "algorithm.disable_kl=true",
    ],
    "reinforce_pp_baseline_kl_in_reward": [
        "algorithm.adv_estimator=reinforce_plus_plus_baseline",
        "algorithm.use_kl_loss=false",
    ],
    "remax": ["algorithm.adv_estimator=remax"],
    "gae_adaptive_kl": [
        "algorithm.adv_estimator=gae",
        "algorithm.use_kl_loss=false",
        "algorithm.kl_type=adaptive",
        "algorithm.kl_horizon=100",
        # Step 1 trains the critic alone, step 2 both (EasyR1's and verl's count: critic_warmup <= step).
        "trainer.critic_warmup=2",
        # The critic update packs its micro-batches (the value pass follows the shared workers' config).
        "worker.critic.padding_free=true",
    ],
    "grpo_online_filtering": ["algorithm.online_filtering=true", "algorithm.filter_key=overall"],
    "grpo_two_epochs": ["worker.actor.ppo_epochs=2"],
    # The update's micro-batch holds both prompts' rows: each prompt runs once, through the FSDP2 worker.
    "grpo_shared_prompts": ["worker.actor.share_prompts=true"],
}


@pytest.fixture(scope="module")
def shared(tiny_assets, tmp_path_factory):
    """Ray, the reward actor and the worker group, once for every variant."""
    import ray

    from vlmrl.driver.scoring import start_scorers
    from vlmrl.workers.group import WorkerGroup

    tmp = tmp_path_factory.mktemp("algorithms")
    (tmp / "reward.py").write_text(REWARD)
    base = [
        "config=examples/quickstart.yaml",
        f"trainer.output_dir={tmp / 'outputs'}",
        f"worker.reward.reward_function={tmp / 'reward.py'}:compute_score",
        *COMMON,
    ]
    config = load_config([*base, *SUPERSET])
    cluster = detect_cluster()
    plan = resolve(config, cluster)
    started_ray = not ray.is_initialized()
    if started_ray:
        ray.init(address="local", num_cpus=4, include_dashboard=False, runtime_env=forked_runtime_env())
    scorers = start_scorers(config.worker.reward, validation=False)
    workers = WorkerGroup(config, plan)
    processor = AutoProcessor.from_pretrained(config.worker.actor.model.model_path)
    dataset = _dataset(config, config.data.train_files, processor)
    yield {"base": base, "cluster": cluster, "scorers": scorers, "workers": workers, "dataset": dataset}
    for w in workers.workers:
        ray.kill(w)
    if started_ray:
        ray.shutdown()


def train(shared, name: str, overrides: list[str]) -> list[dict]:
    """A TrainingLoop for this variant over the shared workers, STEPS steps; its metrics per step."""
    config = load_config([*shared["base"], f"trainer.experiment_name={name}", f"trainer.max_steps={STEPS}", *overrides])
    plan = resolve(config, shared["cluster"])
    loader = make_loader(shared["dataset"], config.data.rollout_batch_size, True, config.data.seed, drop_last=True)
    run = RunInfo(config.trainer.project_name, name, plan.experiment_dir, {}, plan.as_dict())
    tracker = Tracker([LoggerName.file], run)
    checkpoints = CheckpointManager(plan.checkpoint_dir, 1)
    TrainingLoop(config, plan, loader, None, shared["scorers"], shared["workers"], tracker, checkpoints).fit()
    path = Path(plan.experiment_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("name", list(VARIANTS))
def test_variant_trains_with_finite_metrics(shared, name):
    metrics = train(shared, name, VARIANTS[name])
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    for m in metrics:
        bad = {k: v for k, v in m.items() if isinstance(v, float) and not math.isfinite(v)}
        assert not bad, (m["step"], bad)
        for key in ("critic/advantages/mean", "critic/score/mean", "critic/zero_advantage_groups", "reward/overall"):
            assert key in m, (m["step"], key)
    trained = [m for m in metrics if "actor/pg_loss" in m]
    assert trained, "the actor never updated"
    for m in trained:
        for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm", "actor/ppo_kl"):
            assert key in m, (m["step"], key)
    # What each variant switches on shows up in its metrics.
    has = lambda key: all(key in m for m in metrics)
    if "gae" in name:
        assert has("critic/vf_loss") and has("critic/values/mean") and has("critic/returns/mean")
        # trainer.critic_warmup=2: the actor waits a step, then trains at step 2.
        assert "actor/pg_loss" not in metrics[0] and "actor/pg_loss" in metrics[1]
        coefs = [m["actor/reward_kl_penalty_coef"] for m in metrics]
        assert coefs[0] == pytest.approx(1e-3) and coefs[1] != coefs[0]  # the adaptive controller moved it
    if "kl_in_reward" in name:
        assert has("actor/reward_kl_penalty") and not any("actor/kl_loss" in m for m in metrics)
        assert all(m["actor/reward_kl_penalty_coef"] == pytest.approx(1e-3) for m in metrics)  # fixed controller
    if name == "grpo":
        assert has("actor/kl_loss") and has("actor/reference_kl")
    # The old-log-prob pass runs only where a step's update is not the single on-policy one: KL in the
    # reward reads the old log-probs before the update, a second epoch needs the first epoch's policy,
    # and a critic-warm-up step makes no update at all.
    assert has("actor/entropy_old")
    if "kl_in_reward" in name or "two_epochs" in name or "adaptive_kl" in name:
        assert has("timing_s/old")
    elif name != "grpo_online_filtering":
        assert not any("timing_s/old" in m for m in metrics)
    if "no_kl" in name:
        assert not any("timing_s/ref" in m or "actor/reference_kl" in m for m in metrics)  # no reference pass
    if name == "remax":
        assert has("reward_baseline/overall")
    if "online_filtering" in name:
        assert has("filter/tries") and has("filter/kept_group_ratio")


def test_online_filtering_stops_with_a_clear_error_after_max_tries(shared):
    # overall is at most 1, so no group mean lies in (2, 3): every round is dropped.
    overrides = [
        "algorithm.online_filtering=true",
        "algorithm.filter_low=2",
        "algorithm.filter_high=3",
        "trainer.max_try_make_batch=2",
    ]
    with pytest.raises(OnlineFilteringError, match=r"after 2 generation rounds only 0 of the 2 prompt groups"):
        train(shared, "filter_error", overrides)
