"""Asynchronous training, colocated, end to end on the tiny quickstart (``worker.rollout.async_rl``).

* eta = 0 is the synchronous path: the same prompts, samples, rewards, advantages and updates as the
  shared synchronous run (``e2e_run``), step by step, and the same weights after its 4 steps.
* eta = 1: every step trains groups admitted one version earlier (the step's own groups are scored while
  the previous ones train), never older; the decoupled loss sees the lag.
* A run killed while saving step 2 and started again trains the same prompts as the uninterrupted one:
  the groups admitted but not trained when the checkpoint was taken are generated again, none is lost
  or trained twice, and the bound still holds after the resume.
"""

from __future__ import annotations

import json
import textwrap
from collections import Counter

import pytest
import torch
from helpers.resume_point import resume_point
from helpers.runs import (
    E2E_N, E2E_PROMPTS, E2E_STEPS, E2E_TRAINING, experiment_dir, logging_reward, read_metrics, run_main, tail,
)  # fmt: skip
from safetensors.torch import load_file

ASYNC = ["worker.rollout.async_rl.enable=true"]
ETA1 = ASYNC
"""The switch alone: max_head_offpolicyness defaults to 1, and the decoupled loss follows from it."""
QUIET = ["data.val_files=", "trainer.val_before_train=false", "trainer.logger=[console,file]"]
SAME = ["reward/overall", "response_length/mean", "critic/advantages/max", "critic/advantages/min",
        "critic/advantages/mean", "actor/pg_loss", "actor/grad_norm", "actor/kl_loss"]  # fmt: skip


def _weights(run_dir, step):
    hf = run_dir / "checkpoints" / f"global_step_{step}" / "actor" / "huggingface"
    tensors = {}
    for f in sorted(hf.glob("*.safetensors")):
        tensors.update(load_file(f))
    assert tensors, f"no exported weights in {hf}"
    return tensors


@pytest.fixture(scope="module")
def eta0(e2e_run, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("async_eta0")
    proc = run_main(tmp / "out", *E2E_TRAINING, *logging_reward(tmp), *QUIET, *ASYNC,
                    "worker.rollout.async_rl.max_head_offpolicyness=0", experiment="eta0", timeout=900)  # fmt: skip
    assert proc.returncode == 0, tail(proc)
    return tmp


def test_eta_0_is_the_synchronous_run(e2e_run, eta0):
    sync = [m for m in read_metrics(e2e_run.output_dir, "e2e") if "actor/pg_loss" in m]
    got = [m for m in read_metrics(eta0 / "out", "eta0") if "actor/pg_loss" in m]
    assert [m["step"] for m in got] == [m["step"] for m in sync] == list(range(1, E2E_STEPS + 1))
    for s, g in zip(sync, got):
        assert g["async/lag/max"] == 0 and g["async/carried_over"] == 0
        for key in SAME:
            assert g[key] == pytest.approx(s[key], rel=1e-6, abs=1e-9), (s["step"], key)
    # And the weights after the last step, bit for bit.
    mine, theirs = _weights(eta0 / "out" / "vlmrl" / "eta0", E2E_STEPS), _weights(e2e_run.dir, E2E_STEPS)
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)


# The shared run's graded reward, also logging the prompt, so that the tests can tell which rows were scored.
PROMPT_LOGGING_REWARD = textwrap.dedent(
    """
    import json

    def compute_score(reward_input, log_path, **quickstart_kwargs):
        with open(log_path, "a") as f:
            f.write(json.dumps({"prompt": reward_input["prompt"], "ground_truth": reward_input["ground_truth"]}) + "\\n")
        response, truth = reward_input["response"].lower(), reward_input["ground_truth"].lower()
        return {"overall": len(set(response) & set(truth)) / len(set(truth))}
    """
)


def _eta1_command(tmp):
    (tmp / "reward.py").write_text(PROMPT_LOGGING_REWARD)
    reward = [f"worker.reward.reward_function={tmp / 'reward.py'}:compute_score",
              f"worker.reward.reward_function_kwargs.log_path={tmp / 'reward_calls.jsonl'}"]  # fmt: skip
    return [*E2E_TRAINING, *reward, *QUIET, *ETA1, "trainer.save_freq=1", "trainer.max_steps=3",
            f"trainer.rollout_data_dir={tmp / 'rows'}"]  # fmt: skip


@pytest.fixture(scope="module")
def eta1(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("async_eta1")
    proc = run_main(tmp / "out", *_eta1_command(tmp), experiment="eta1", timeout=900)
    assert proc.returncode == 0, tail(proc)
    return tmp


def test_eta_1_trains_groups_one_version_old_and_never_older(eta1):
    steps = [m for m in read_metrics(eta1 / "out", "eta1") if "actor/pg_loss" in m]
    assert [m["step"] for m in steps] == [1, 2, 3]
    # Step 1 admits two steps' groups at version 0 and trains the first; from then on each step trains the
    # groups admitted a step before (lag 1) while it has admitted the next ones (carried over, scored meanwhile).
    assert [m["async/lag/max"] for m in steps] == [0, 1, 1]
    assert all(m["async/carried_over"] == E2E_PROMPTS for m in steps)
    assert all(m["async/stale_dropped"] == m["async/stale_accepted"] == 0 for m in steps)
    # The decoupled loss sees stale samples: behaviour (vLLM at v-1) differs from proximal (the actor at v).
    assert steps[0]["actor/behav_prox_kl"] == pytest.approx(0, abs=1e-5)
    assert all(m["actor/behav_prox_kl"] > 1e-4 for m in steps[1:])
    # The rows each step trained (trainer.rollout_data_dir), token by token: step 1's and step 2's sampled by
    # version 0, step 3's by version 1; B prompts x n samples a step, with their scores and advantages.
    for step, version in [(1, 0), (2, 0), (3, 1)]:
        rows = [json.loads(line) for line in (eta1 / "rows" / f"step_{step}.jsonl").read_text().splitlines()]
        assert len(rows) == E2E_PROMPTS * E2E_N and len({r["group"] for r in rows}) == E2E_PROMPTS
        assert all(r["versions"] and set(r["versions"]) == {version} for r in rows), step
        assert all(len(r["versions"]) == len(r["response_ids"]) == len(r["rollout_log_probs"]) for r in rows)
        assert all(0 <= r["scores"]["overall"] <= 1 and "advantage" in r for r in rows)


@pytest.fixture(scope="module")
def resumed(eta1, tmp_path_factory):
    """The eta=1 run as it stood after step 1 (a checkpoint holding the groups admitted for step 2), started
    again with the same command; it appends to the same reward log. (A save killed part way is
    tests/test_resume.py's concern.)"""
    scored_before = len(_scored(eta1))
    out = tmp_path_factory.mktemp("async_resumed") / "out"
    copy = resume_point(experiment_dir(eta1 / "out", "eta1"), experiment_dir(out, "eta1"), step=1)
    again = run_main(out, *_eta1_command(eta1), experiment="eta1", timeout=900)
    assert again.returncode == 0, tail(again)
    return copy, scored_before, again.stdout + again.stderr


def _scored(tmp) -> list[str]:
    """The prompts the reward function saw, once per group (its n samples share the prompt), in order."""
    calls = [json.loads(line) for line in (tmp / "reward_calls.jsonl").read_text().splitlines()]
    return [c["ground_truth"] + "|" + c["prompt"] for c in calls][::E2E_N]


def test_a_resumed_async_run_trains_the_same_prompts(eta1, resumed):
    copy, before, log = resumed
    assert "resumed from" in log and "global_step_1" in log
    batch = E2E_PROMPTS
    scored = _scored(eta1)
    uninterrupted, again = scored[:before], scored[before:]
    # Uninterrupted, steps 1 to 3 trained batches 1-3, and batch 4 was admitted and scored ahead.
    assert before == 4 * batch
    # The checkpoint of step 1 holds batch 2 as drawn and not trained: the resumed run generates it again,
    # then batches 3 and 4. Batch 1 is not repeated, batch 2 is not lost.
    assert Counter(again) == Counter(uninterrupted[batch:])
    steps = [m for m in read_metrics(copy.parents[1], "eta1") if "actor/pg_loss" in m]
    assert [m["step"] for m in steps] == [1, 2, 3]
    assert all(m["async/lag/max"] <= 1 for m in steps)  # the bound holds after the resume
    assert steps[-1]["async/version"] == 2 and steps[-1]["async/consumed"] == 3 * batch
