"""The judge quickstart's command end to end, with the judge in its own actor and inside the worker.

Each placement trains 2 steps on the real stack (Ray, FSDP, two vLLM engines, the tuned tiny judge). The
reward function logs what it got from the judge, so the checks are on verdicts that reached training: one
per sample, in [0, 1], and mostly the verdict exact match would give (the judge is tuned to agree).
"""

from __future__ import annotations

import json
import sys
import textwrap

import pytest
from helpers.runs import read_metrics, run_command, tail

STEPS = 2
REWARD = textwrap.dedent(
    """
    import json

    REWARD_TYPE = "batch"

    def compute_score(reward_inputs, reward_model, log_path):
        verdicts = reward_model.score(reward_inputs)
        with open(log_path, "a") as f:
            for x, v in zip(reward_inputs, verdicts):
                f.write(json.dumps({"response": x["response"], "truth": x["ground_truth"], "verdict": v}) + "\\n")
        return [{"overall": v} for v in verdicts]
    """
)


def _command(out, tmp, placement):
    return [
        sys.executable, "-m", "vlmrl.main", "config=examples/judge_quickstart.yaml",
        f"trainer.output_dir={out}", f"trainer.experiment_name={placement}", f"trainer.max_steps={STEPS}",
        "data.rollout_batch_size=4", "worker.actor.global_batch_size=4", "worker.rollout.n=4",
        "worker.actor.micro_batch_size_per_device_for_update=8", "data.val_files=", "trainer.val_before_train=false",
        f"worker.reward.reward_function={tmp / 'reward.py'}:compute_score",
        f"worker.reward.reward_function_kwargs={{log_path: {tmp / placement}.jsonl}}",
        f"worker.reward.reward_model.placement={placement}", "trainer.logger=[console,file]",
    ]  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from vlmrl.testing.judge_assets import ensure_judge_assets

    ensure_judge_assets()
    tmp = tmp_path_factory.mktemp("judge")
    (tmp / "reward.py").write_text(REWARD)
    done = {}
    for placement in ("separate", "colocated"):
        proc = run_command(_command(tmp / "out", tmp, placement), timeout=900)
        assert proc.returncode == 0, tail(proc)
        done[placement] = read_metrics(tmp / "out", placement)
    return tmp, done


@pytest.mark.e2e
@pytest.mark.parametrize("placement", ["separate", "colocated"])
def test_each_placement_trains_on_the_judges_verdicts(runs, placement):
    tmp, metrics = runs
    rows = [json.loads(line) for line in (tmp / f"{placement}.jsonl").read_text().splitlines()]
    assert len(rows) == STEPS * 16  # 4 prompts x 4 samples a step, one verdict each
    assert all(r["verdict"] in (0.0, 1.0) for r in rows)
    agree = sum(r["verdict"] == float(r["response"].strip().lower() == r["truth"]) for r in rows)
    assert agree >= 0.8 * len(rows), rows
    steps = [m for m in metrics[placement] if "actor/pg_loss" in m]
    assert [m["step"] for m in steps] == list(range(1, STEPS + 1))
    for m in steps:
        assert m["reward_model/items"] == 16 and m["reward_model/requests"] == 1  # the step in one request
        assert m["reward_model/seconds"] > 0 and m["reward_model/invalid"] == 0
        assert m["reward/overall"] == pytest.approx(m["reward_model/score_mean"])

