"""An EasyR1 reward function, as EasyR1 users write them, runs unchanged in a training step.

The function below is written in EasyR1's exact style (module-level
``REWARD_TYPE = "batch"``, the batch signature, ``overall``, ``format`` and
``accuracy``, mathruler for grading) and never looks at vlmrl's extra keys.
One cheap step of ``python -m vlmrl.main`` (2 prompts x 2 samples, no
validation) must run it through the batch manager (it raises if called one
sample at a time) and log its sub-scores.
"""

from __future__ import annotations

import json
import sys
import textwrap

import pytest
from helpers.runs import run_command

EASYR1_REWARD = textwrap.dedent(
    r"""
    import re
    from typing import Any

    from mathruler.grader import grade_answer

    REWARD_NAME = "colour"
    REWARD_TYPE = "batch"


    def format_reward(response: str) -> float:
        pattern = re.compile(r"<answer>.*?</answer>", re.DOTALL)
        format_match = re.search(pattern, response)
        return 1.0 if format_match else 0.0


    def accuracy_reward(response: str, ground_truth: str) -> float:
        content_match = re.search(r"<answer>(.*?)</answer>", response)
        given_answer = content_match.group(1).strip() if content_match else response.strip()
        return 1.0 if grade_answer(given_answer, ground_truth.strip()) else 0.0


    def compute_score(reward_inputs: list[dict[str, Any]], format_weight: float = 0.1) -> list[dict[str, float]]:
        if not isinstance(reward_inputs, list):
            raise ValueError("Please use `reward_type=batch` for colour reward function.")

        scores = []
        for reward_input in reward_inputs:
            response = re.sub(r"\s*(<|>|/)\s*", r"\1", reward_input["response"])
            format_score = format_reward(response)
            accuracy_score = accuracy_reward(response, reward_input["ground_truth"])
            scores.append(
                {
                    "overall": (1 - format_weight) * accuracy_score + format_weight * format_score,
                    "format": format_score,
                    "accuracy": accuracy_score,
                }
            )

        return scores
    """
)


@pytest.mark.e2e
def test_an_easyr1_batch_reward_function_runs_in_a_training_step(tiny_assets, tmp_path):
    reward_file = tmp_path / "colour.py"
    reward_file.write_text(EASYR1_REWARD)
    output_dir = tmp_path / "outputs"
    cmd = [
        sys.executable, "-m", "vlmrl.main", "config=examples/quickstart.yaml",
        "trainer.max_steps=1",
        f"trainer.output_dir={output_dir}",
        "trainer.experiment_name=easyr1_reward",
        "trainer.logger=[console,file]",
        "trainer.val_before_train=false",
        "data.val_files=",
        "data.rollout_batch_size=2",
        "worker.actor.global_batch_size=2",
        "worker.actor.micro_batch_size_per_device_for_update=4",
        "worker.rollout.n=2",
        f"worker.reward.reward_function={reward_file}:compute_score",
        "worker.reward.reward_function_kwargs.format_weight=0.25",
    ]  # fmt: skip
    proc = run_command(cmd, env={"VLMRL_CACHE_DIR": str(tiny_assets.model_dir.parents[1])})
    assert proc.returncode == 0, f"vlmrl.main failed:\n{proc.stdout[-5000:]}\n{proc.stderr[-10000:]}"
    lines = (output_dir / "vlmrl" / "easyr1_reward" / "metrics.jsonl").read_text().splitlines()
    (metrics,) = [json.loads(line) for line in lines]
    assert metrics["step"] == 1
    for key in ("reward/overall", "reward/format", "reward/accuracy"):
        assert 0.0 <= metrics[key] <= 1.0, (key, metrics)
    # The kwargs reached the function: overall = 0.75 accuracy + 0.25 format, in the mean too.
    assert metrics["reward/overall"] == pytest.approx(
        0.75 * metrics["reward/accuracy"] + 0.25 * metrics["reward/format"]
    )
    assert metrics["reward/timeouts"] == 0
    assert not any(k.startswith("val/") for k in metrics)
