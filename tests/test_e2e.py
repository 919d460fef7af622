"""End to end: ``python -m vlmrl.main`` on the tiny VLM, through real Ray, FSDP2 (gloo) and vLLM.

One training run (3 steps) is shared by the tests below; each checks one
promise of the loop.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers.runs import REPO, experiment_dir, read_metrics, run_main, tail
from safetensors.torch import load_file

STEPS = 3
PROMPTS_PER_STEP = 4
N = 4
GENERATIONS_LOGGED = 2

# Graded, not exact-match, so that a random policy's groups have reward variance
# and the update has a gradient from the first step.
REWARD_FILE = textwrap.dedent(
    """
    import json

    def compute_score(reward_input, log_path, **quickstart_kwargs):
        with open(log_path, "a") as f:
            f.write(json.dumps({"response": reward_input["response"],
                                "ground_truth": reward_input["ground_truth"]}) + "\\n")
        response, truth = reward_input["response"].lower(), reward_input["ground_truth"].lower()
        overlap = len(set(response) & set(truth)) / len(set(truth))
        return {"overall": overlap, "overlap": overlap}
    """
)


@pytest.fixture(scope="module")
def run(tiny_assets, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("e2e")
    reward_file = tmp / "reward.py"
    reward_file.write_text(REWARD_FILE)
    reward_log = tmp / "reward_calls.jsonl"
    output_dir = tmp / "outputs"
    proc = run_main(
        output_dir,
        f"trainer.max_steps={STEPS}",
        "trainer.val_before_train=false",
        f"trainer.val_generations_to_log={GENERATIONS_LOGGED}",
        f"data.rollout_batch_size={PROMPTS_PER_STEP}",
        f"worker.actor.global_batch_size={PROMPTS_PER_STEP}",
        "worker.actor.micro_batch_size_per_device_for_update=8",
        f"worker.rollout.n={N}",
        f"worker.reward.reward_function={reward_file}:compute_score",
        f"worker.reward.reward_function_kwargs.log_path={reward_log}",
        experiment="e2e",
        env={"VLMRL_CACHE_DIR": str(tiny_assets.model_dir.parents[1])},
        timeout=900,
    )
    assert proc.returncode == 0, f"vlmrl.main failed:\n{tail(proc)}"
    experiment = experiment_dir(output_dir, "e2e")
    return {
        "assets": tiny_assets,
        "reward_log": reward_log,
        "metrics": read_metrics(output_dir, "e2e"),
        "generations": [
            json.loads(line) for line in (experiment / "generations" / f"step_{STEPS}.jsonl").read_text().splitlines()
        ],
        "final_weights": experiment / "checkpoints" / f"global_step_{STEPS}" / "actor" / "huggingface",
        "log": proc.stdout + proc.stderr,
    }


def test_reward_function_from_file_gets_decoded_responses_and_ground_truths(run):
    calls = [json.loads(line) for line in run["reward_log"].read_text().splitlines()]
    val_rows = 64  # the synthetic validation split, scored once at the last step
    assert len(calls) == STEPS * PROMPTS_PER_STEP * N + val_rows
    answers = {"red", "green", "blue", "yellow"}
    assert {c["ground_truth"] for c in calls} <= answers
    # The validation responses the run logged are the decoded texts the function saw.
    seen = {(c["response"], c["ground_truth"]) for c in calls}
    for g in run["generations"]:
        assert (g["response"], g["ground_truth"]) in seen


def test_actor_parameters_changed(run):
    initial = load_file(run["assets"].model_dir / "model.safetensors")
    final = load_file(run["final_weights"] / "model.safetensors")
    assert initial.keys() == final.keys()
    changed = [name for name in initial if not torch.equal(initial[name], final[name])]
    # Both towers and the head get gradients. (save_pretrained writes the
    # checkpoint names: model.layers.* for the language model, visual.* for the vision tower.)
    assert any(".layers." in n for n in changed)
    assert any("visual." in n for n in changed)
    assert "lm_head.weight" in changed
    assert all(torch.isfinite(t).all() for t in final.values())


def _fresh_vllm_greedy(model_dir: Path, data_file: Path, generations: list[dict]) -> list[dict]:
    requests = [f"{g['row']}:{len(g['response_ids'])}" for g in generations]
    proc = subprocess.run(
        [sys.executable, "tests/helpers/vllm_greedy.py", str(model_dir), str(data_file), *requests],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-5000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def test_resynced_vllm_matches_a_fresh_engine_on_the_actor_weights(run):
    """The in-loop engine, after the last resync, scores exactly like one loaded from the saved actor."""
    generations = run["generations"]
    assert len(generations) == GENERATIONS_LOGGED
    fresh = _fresh_vllm_greedy(run["final_weights"], run["assets"].val_file, generations)
    for g, f in zip(generations, fresh):
        assert f["ids"] == g["response_ids"]
        torch.testing.assert_close(torch.tensor(f["log_probs"]), torch.tensor(g["rollout_log_probs"]), atol=1e-5, rtol=0)
    # Control: the untrained weights give other log-probs, so the comparison above can fail.
    untrained = _fresh_vllm_greedy(run["assets"].model_dir, run["assets"].val_file, generations)
    assert any(
        u["ids"] != g["response_ids"] or not torch.allclose(torch.tensor(u["log_probs"]), torch.tensor(g["rollout_log_probs"]), atol=1e-5)
        for u, g in zip(untrained, generations)
    )


def test_vllm_and_actor_log_probs_agree_every_step(run):
    for m in run["metrics"]:
        assert m["rollout/log_prob_diff_mean"] <= 1e-2, m


def test_per_step_metrics_are_written(run):
    assert [m["step"] for m in run["metrics"]] == list(range(1, STEPS + 1))
    required = [
        "reward/overall", "reward/overlap", "actor/kl_loss", "actor/reference_kl", "actor/pg_loss", "actor/entropy",
        "response_length/mean", "rollout/log_prob_diff_mean",
        "timing_s/gen", "timing_s/reward", "timing_s/old", "timing_s/ref", "timing_s/adv",
        "timing_s/update_actor", "timing_s/update_weights", "timing_s/step",
    ]  # fmt: skip
    for m in run["metrics"]:
        missing = [k for k in required if k not in m]
        assert not missing, f"step {m['step']} lacks {missing}"
    assert "val/reward/overall" in run["metrics"][-1]
