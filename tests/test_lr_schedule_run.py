"""Learning-rate schedules in a real run (``python -m vlmrl.main`` on the tiny quickstart, GAE so that a critic
trains too): the rates logged each step are the hand-derived ones, the checkpoint keeps each schedule's state,
and a run resumed from a checkpoint continues both schedules exactly where the uninterrupted run was. The runs
also show that a run removes its rendezvous dir when it ends.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
from helpers.runs import SMALL, experiment_dir, read_metrics, run_main, tail

STEPS = 4
WHOLE, RESUMED = "lr-schedule-whole", "lr-schedule-resumed"  # names no other test's run has
ACTOR_LR, CRITIC_LR = 1e-5, 2e-6
RUN = [
    *SMALL,
    f"trainer.max_steps={STEPS}",
    "trainer.save_freq=2",
    "trainer.logger=[console,file]",
    "algorithm.adv_estimator=gae",
    "worker.critic.global_batch_size=2",
    f"worker.actor.optim.lr={ACTOR_LR}",
    "worker.actor.optim.lr_scheduler_type=cosine",
    "worker.actor.optim.lr_warmup_steps=1",
    "worker.actor.optim.min_lr_ratio=0.1",
    f"worker.critic.optim.lr={CRITIC_LR}",
    "worker.critic.optim.lr_warmup_ratio=0.5",
]
# The run has T = 4 training steps (max_steps); the schedule's step k is training step k + 1.
# Actor, cosine, w = 1, m = 0.1: k = 0 warm-up 0/1 = 0; after it p = (k - 1) / 3 and
#   factor = 0.1 + 0.9 x (1 + cos(pi p)) / 2:  k = 1: p = 0 -> 1;  k = 2: p = 1/3, cos = 1/2 -> 0.775;
#   k = 3: p = 2/3, cos = -1/2 -> 0.325.
EXPECTED_ACTOR_LR = [0.0, ACTOR_LR, 0.775 * ACTOR_LR, 0.325 * ACTOR_LR]
# Critic, constant, w = int(0.5 x 4) = 2: k = 0 -> 0/2, k = 1 -> 1/2, then 1.
EXPECTED_CRITIC_LR = [0.0, 0.5 * CRITIC_LR, CRITIC_LR, CRITIC_LR]
COMPARED = ["actor/lr", "critic/lr", "actor/pg_loss", "actor/grad_norm", "critic/vf_loss", "critic/grad_norm"]


@pytest.fixture(scope="module")
def runs(quickstart_assets, tmp_path_factory):
    """4 steps in one go (saving at steps 2 and 4), then a second run resumed from the first's step 2."""
    out = tmp_path_factory.mktemp("lr") / "outputs"
    whole = run_main(out, *RUN, experiment=WHOLE)
    assert whole.returncode == 0, tail(whole)
    step_2 = experiment_dir(out, WHOLE) / "checkpoints" / "global_step_2"
    resumed = run_main(out, *RUN, f"trainer.load_checkpoint_path={step_2}", experiment=RESUMED)
    assert resumed.returncode == 0, tail(resumed)
    assert f"checkpoint: resumed from {step_2} at step 2" in resumed.stdout, tail(resumed)
    return out, step_2


def test_each_step_logs_the_hand_derived_actor_and_critic_rates(runs):
    out, _ = runs
    metrics = read_metrics(out, WHOLE)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert [m["actor/lr"] for m in metrics] == pytest.approx(EXPECTED_ACTOR_LR, rel=1e-9, abs=0)
    assert [m["critic/lr"] for m in metrics] == pytest.approx(EXPECTED_CRITIC_LR, rel=1e-9, abs=0)


def test_the_checkpoint_holds_each_schedules_steps(runs):
    _, step_2 = runs
    for model in ("actor", "critic"):
        assert json.loads((step_2 / model / "lr_scheduler.json").read_text()) == {"steps": 2}


def test_a_resumed_run_continues_both_schedules_exactly(runs):
    out, _ = runs
    whole = {m["step"]: m for m in read_metrics(out, WHOLE)}
    resumed = {m["step"]: m for m in read_metrics(out, RESUMED)}
    assert sorted(resumed) == [3, 4]
    for step in (3, 4):
        for key in COMPARED:
            assert resumed[step][key] == whole[step][key], (step, key)


def test_the_rendezvous_dir_is_removed_when_the_run_ends(runs):
    for experiment in (WHOLE, RESUMED):
        left = list(Path(tempfile.gettempdir()).glob(f"vlmrl-rendezvous-{experiment}-*"))
        assert left == []
