"""End to end: ``python -m vlmrl.main`` on the tiny VLM, through real Ray, FSDP2 (gloo) and vLLM.

The shared run (tests/conftest.py::e2e_run) is inspected by the tests below;
each checks one promise of the loop.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from helpers.runs import E2E_API_KEY, E2E_N, E2E_PROMPTS, E2E_SAMPLES_LOGGED, E2E_STEPS, read_metrics, run_command
from safetensors.torch import load_file

STEPS = E2E_STEPS


@pytest.fixture(scope="module")
def run(e2e_run):
    return {
        "assets": e2e_run.assets,
        "reward_log": e2e_run.reward_log,
        "metrics": read_metrics(e2e_run.output_dir, "e2e"),
        "generations": [
            json.loads(line) for line in (e2e_run.dir / "generations" / f"step_{STEPS}.jsonl").read_text().splitlines()
        ],
        "final_weights": e2e_run.dir / "checkpoints" / f"global_step_{STEPS}" / "actor" / "huggingface",
    }


def test_reward_function_from_file_gets_decoded_responses_and_ground_truths(run):
    calls = [json.loads(line) for line in run["reward_log"].read_text().splitlines()]
    # The quickstart's validation split, scored before training and at the last step.
    val_rows = pq.read_metadata(run["assets"].val_file).num_rows
    assert len(calls) == STEPS * E2E_PROMPTS * E2E_N + 2 * val_rows
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


def _fresh_vllm_greedy(model_dirs: list[Path], data_file: Path, generations: list[dict]) -> list[list[dict]]:
    """A fresh engine's greedy decode for each of ``model_dirs`` (one subprocess, one engine after the other)."""
    requests = [f"{g['row']}:{len(g['response_ids'])}" for g in generations]
    proc = run_command(
        [sys.executable, "tests/helpers/vllm_greedy.py", ",".join(map(str, model_dirs)), str(data_file), *requests],
        timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-5000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == len(model_dirs), proc.stdout[-3000:]
    return [json.loads(line.removeprefix("RESULT ")) for line in lines]


def test_resynced_vllm_matches_a_fresh_engine_on_the_actor_weights(run):
    """The in-loop engine, after the last resync, scores exactly like one loaded from the saved actor."""
    generations = run["generations"]
    assert len(generations) == E2E_SAMPLES_LOGGED
    fresh, untrained = _fresh_vllm_greedy(
        [run["final_weights"], run["assets"].model_dir], run["assets"].val_file, generations
    )
    for g, f in zip(generations, fresh):
        assert f["ids"] == g["response_ids"]
        torch.testing.assert_close(
            torch.tensor(f["log_probs"]), torch.tensor(g["rollout_log_probs"]), atol=1e-5, rtol=0
        )
    # Control: the untrained weights give other log-probs, so the comparison above can fail.
    assert any(
        u["ids"] != g["response_ids"]
        or not torch.allclose(torch.tensor(u["log_probs"]), torch.tensor(g["rollout_log_probs"]), atol=1e-5)
        for u, g in zip(untrained, generations)
    )


def test_vllm_and_actor_log_probs_agree_every_step(run):
    training = [m for m in run["metrics"] if m["step"] > 0]  # step 0 is the validation before training
    assert len(training) == STEPS
    for m in training:
        assert m["rollout/log_prob_diff_mean"] <= 1e-2, m


def test_one_on_policy_update_per_step_runs_no_old_log_prob_pass(run):
    # global_batch_size = rollout_batch_size and one epoch: the update's forward gives the old log-probs,
    # and the mismatch metric above compares vLLM's with those.
    assert not any("timing_s/old" in m for m in run["metrics"])
    for m in run["metrics"][1:]:
        assert m["actor/pg_clipfrac_higher"] == m["actor/pg_clipfrac_lower"] == 0  # ratio 1: nothing clips


def test_per_step_metrics_are_written(run):
    # Step 0 holds the validation before training; then one line per training step.
    assert [m["step"] for m in run["metrics"]] == list(range(0, STEPS + 1))
    assert "val/reward/overall" in run["metrics"][0]
    required = [
        "reward/overall", "reward/overlap", "actor/kl_loss", "actor/reference_kl", "actor/pg_loss", "actor/entropy",
        "response_length/mean", "rollout/log_prob_diff_mean",
        "timing_s/gen", "timing_s/reward", "timing_s/ref", "timing_s/adv", "actor/entropy_old",
        "timing_s/update_actor", "timing_s/update_weights", "timing_s/step",
    ]  # fmt: skip
    for m in run["metrics"][1:]:
        missing = [k for k in required if k not in m]
        assert not missing, f"step {m['step']} lacks {missing}"
    assert "val/reward/overall" in run["metrics"][-1]


def test_no_file_the_run_writes_and_nothing_it_prints_holds_the_secret_from_the_environment(e2e_run):
    # The reward kwarg api_key=${oc.env:VLMRL_E2E_API_KEY}: config.json beside the outputs and in the checkpoint,
    # MLflow's params and config.yaml (in mlflow.db and mlartifacts), run.log, metrics, TensorBoard.
    files = [p for p in e2e_run.dir.rglob("*") if p.is_file()]
    assert any(p.name == "config.json" and p.parent.name.startswith("global_step_") for p in files)
    leaking = [str(p) for p in files if E2E_API_KEY.encode() in p.read_bytes()]
    assert leaking == []
    assert E2E_API_KEY not in e2e_run.log
    for config_json in (e2e_run.dir / "config.json", e2e_run.dir / "checkpoints" / f"global_step_{STEPS}" / "config.json"):
        assert json.loads(config_json.read_text())["config"]["worker"]["reward"]["reward_function_kwargs"]["api_key"] == "***"
