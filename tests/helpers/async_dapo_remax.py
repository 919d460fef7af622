"""The asynchronous DAPO + ReMax run at eta = 1 on the tiny quickstart, once per placement for the whole session.

tests/test_async_composition.py checks online filtering and ReMax's baseline on it (both placements), and
tests/test_async_disaggregated.py checks, on the disaggregated one (1 rollout server + 1 trainer worker), how
the groups the server generated while the trainer trained are trained: one run serves both, whichever file
asks first (a dict of this module, one per pytest process).

The reward function makes the filter's choice known in advance: prompts whose answer is "red" score 1.0 on every
sample (a group mean of 1, outside (0.01, 0.99)), every other prompt scores between 0.2 and 0.8 (inside); a
sub-score ``red`` marks the first kind, so its mean over the trained samples, as the step logs it, is 0 exactly
when no filtered group trained.
"""

from __future__ import annotations

import textwrap

from helpers.runs import E2E_TRAINING, read_metrics, run_main, tail

STEPS = 3
PLACEMENTS = {
    "colocated": [],
    "disaggregated": ["worker.rollout.async_rl.placement=disaggregated", "worker.rollout.async_rl.rollout_workers=1"],
}

FILTER_REWARD = textwrap.dedent(
    """
    def compute_score(reward_input, **quickstart_kwargs):
        truth = reward_input["ground_truth"].lower()
        if truth == "red":  # every sample 1.0: the group's mean is outside (0.01, 0.99), online filtering drops it
            return {"overall": 1.0, "red": 1.0}
        response = reward_input["response"].lower()
        overlap = len(set(response) & set(truth)) / len(set(truth))
        return {"overall": 0.2 + 0.6 * overlap, "red": 0.0}  # inside the bounds whatever the samples say
    """
)

_runs: dict[str, list[dict]] = {}


def dapo_remax_steps(placement: str, tmp_path_factory) -> list[dict]:
    """The trained steps' metrics of the run on ``placement`` (run on the first call)."""
    if placement not in _runs:
        tmp = tmp_path_factory.mktemp(f"async_dapo_remax_{placement}")
        (tmp / "reward.py").write_text(FILTER_REWARD)
        proc = run_main(
            tmp / "out", *E2E_TRAINING, f"trainer.max_steps={STEPS}", "worker.rollout.async_rl.enable=true",
            *PLACEMENTS[placement], "worker.rollout.async_rl.max_head_offpolicyness=1",
            "worker.actor.use_decoupled_loss=true", "algorithm.online_filtering=true", "algorithm.adv_estimator=remax",
            f"worker.reward.reward_function={tmp / 'reward.py'}:compute_score",
            "data.val_files=", "trainer.val_before_train=false", "trainer.logger=[console,file]",
            experiment="dapo_remax", timeout=900,
        )  # fmt: skip
        assert proc.returncode == 0, tail(proc)
        if placement == "disaggregated":
            assert "rollout servers: 1" in proc.stdout, tail(proc)
        _runs[placement] = [m for m in read_metrics(tmp / "out", "dapo_remax") if "actor/pg_loss" in m]
    return _runs[placement]
