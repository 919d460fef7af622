"""The agent quickstart's command end to end (tools, tool images, the real stack), cut down to seconds a step.

One uninterrupted run of 2 steps serves most checks: the trajectories are conversations (the reveal tool
was called and its picture shown), the reward function got the conversation, the metrics and the logged
validation conversations are there. A second run starts from a copy of the uninterrupted run as it stood after
step 1 (tests/helpers/resume_point.py: as one killed while saving step 2 would) and trains step 2 again (a step
after a resync): it must repeat the uninterrupted run's step exactly (same prompts, same samples turn by turn,
same update). (A save killed part way is tests/test_resume.py's concern.)

A third run is the uninterrupted one under asynchronous training at eta = 0 (``worker.rollout.async_rl``, colocated,
without validation, which does not change what trains): every step samples its conversations with the weights of
the step before, so it trains exactly what the synchronous run trains, turn by turn; started again from its
step-1 checkpoint, it trains step 2 as it did.
"""

from __future__ import annotations

import json
import shutil
import sys
import textwrap

import pytest
import pyarrow.parquet as pq
from helpers.eta0 import assert_a_resume_repeats_it, assert_trains_what_sync_trains, eta0_overrides
from helpers.resume_point import resume_point
from helpers.runs import experiment_dir, read_metrics, run_command, tail

STEPS = 2
COMPARED = ["reward/overall", "response_length/mean", "actor/pg_loss", "actor/grad_norm", "agent/turns/mean",
            "agent/tool_calls/mean", "action/ratio"]  # fmt: skip

REWARD = textwrap.dedent(
    """
    import json

    def compute_score(reward_input, log_path, **quickstart_kwargs):
        keys = ("num_turns", "turn_rewards", "stop_reason", "tool_calls", "messages")
        with open(log_path, "a") as f:
            f.write(json.dumps({k: reward_input.get(k) for k in keys} | {"images": len(reward_input["images"]),
                                "response": reward_input["response"]}, default=str) + "\\n")
        right = reward_input["response"].strip().lower() == reward_input["ground_truth"]
        return {"overall": float(right)}
    """
)


def _command(out, tmp, *extra):
    return [
        sys.executable, "-m", "vlmrl.main", "config=examples/agent_quickstart.yaml",
        f"trainer.output_dir={out}", "trainer.experiment_name=agent", f"trainer.max_steps={STEPS}",
        "data.rollout_batch_size=4", "worker.actor.global_batch_size=4", "worker.rollout.n=4",
        "worker.actor.micro_batch_size_per_device_for_update=8", "worker.rollout.calculate_log_probs=true",
        f"worker.reward.reward_function={tmp / 'reward.py'}:compute_score",
        f"worker.reward.reward_function_kwargs={{log_path: {tmp / 'calls.jsonl'}}}",
        "trainer.save_freq=1", "trainer.logger=[console,file]", *extra,
    ]  # fmt: skip



@pytest.fixture(scope="module")
def agent_assets():
    from vlmrl.testing.agent_assets import ensure_agent_assets

    return ensure_agent_assets()


@pytest.fixture(scope="module")
def uninterrupted(agent_assets, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("agent")
    (tmp / "reward.py").write_text(REWARD)
    val = tmp / "val.parquet"
    pq.write_table(pq.read_table(agent_assets.val_file).slice(0, 4), val)
    command = _command(tmp / "out", tmp, f"data.val_files={val}", "trainer.val_generations_to_log=2")
    proc = run_command(command, timeout=1200)
    assert proc.returncode == 0, tail(proc)
    # The resumed run below appends to calls.jsonl (its reward settings must be this run's to resume): the
    # calls of this run alone, as it left them.
    shutil.copyfile(tmp / "calls.jsonl", tmp / "uninterrupted_calls.jsonl")
    return tmp, proc.stdout + proc.stderr


def test_the_rollouts_are_conversations_with_the_tools_pictures(uninterrupted):
    tmp, _ = uninterrupted
    calls = [json.loads(line) for line in (tmp / "uninterrupted_calls.jsonl").read_text().splitlines()]
    assert len(calls) >= STEPS * 16
    called = [c for c in calls if c["tool_calls"]]
    assert called, "the tuned start calls reveal on most prompts; no call was made"
    assert any(x["name"] == "reveal" and x["status"] == "ok" for c in called for x in c["tool_calls"])
    for c in called:
        # A call the parser could not read has no name; one to a misspelt tool is unknown_tool, never run. A call
        # in the last allowed turn (the second: examples/agent_quickstart.yaml's max_turns) is not run at all.
        for x in c["tool_calls"]:
            if x["status"] == "skipped":
                assert x["turn"] == 1 and x["name"], x
                continue
            assert x["status"] == {"reveal": x["status"], "": "parse_error"}.get(x["name"], "unknown_tool")
    answered = [c for c in called if c["tool_calls"][0]["status"] == "ok" and c["num_turns"] == 2]
    assert answered, "no trajectory called reveal and then answered"
    for c in answered:
        assert c["images"] == 1  # the revealed picture: the prompt has none (vlmrl/testing/agent_assets.py)
        assert c["messages"][0]["role"] == "assistant" and "<tool_response>" in json.dumps(c["messages"][1])
    assert {c["stop_reason"] for c in calls} <= {"done", "max_turns", "length", "error"}


def test_the_metrics_and_the_logged_conversations(uninterrupted):
    tmp, log = uninterrupted
    metrics = read_metrics(tmp / "out", "agent")
    train = [m for m in metrics if m["step"] > 0 and "actor/pg_loss" in m]
    assert [m["step"] for m in train] == list(range(1, STEPS + 1))
    for key in ("agent/turns/mean", "agent/tool_calls/mean", "agent/tool_calls/reveal", "agent/stop/done",
                "agent/tool/success_rate", "agent/tool/latency_p95_s", "action/ratio", "agent/images/mean",
                "agent/render_mismatch_rate", "agent/log_prob_diff/turn_0", "timing_s/gen/tools"):  # fmt: skip
        assert key in train[0], key
    assert 0 < train[0]["action/ratio"] <= 1
    # Token-in/token-out: the actor's view of vLLM's samples, turn by turn, after a resync too.
    assert all(m["rollout/log_prob_diff_max"] < 0.1 for m in train)
    generations = experiment_dir(tmp / "out", "agent") / "generations"
    rows = [json.loads(line) for f in sorted(generations.iterdir()) for line in f.read_text().splitlines()]
    assert rows and all("messages" in r and len(r["loss_mask"]) == len(r["response_ids"]) for r in rows)


@pytest.fixture(scope="module")
def resumed(uninterrupted, tmp_path_factory):
    """The uninterrupted run as it stood after step 1, started again without validation (which does not change
    what trains). The reward settings are the uninterrupted run's (its checkpoint's fingerprint holds them), so
    it appends to the same reward log."""
    source, _ = uninterrupted
    out = tmp_path_factory.mktemp("agent_resumed") / "out"
    copy = resume_point(experiment_dir(source / "out", "agent"), experiment_dir(out, "agent"), step=1)
    again = run_command(_command(out, source, "data.val_files=", "trainer.val_before_train=false"), timeout=1200)
    assert again.returncode == 0, tail(again)
    return copy.parents[1], again.stdout + again.stderr


def test_a_resumed_multi_turn_run_repeats_the_uninterrupted_one(uninterrupted, resumed):
    out, log = resumed
    assert "resumed from" in log and "global_step_1" in log
    expected = [m for m in read_metrics(uninterrupted[0] / "out", "agent") if m["step"] > 0 and "actor/pg_loss" in m]
    got = [m for m in read_metrics(out, "agent") if "actor/pg_loss" in m]
    assert [m["step"] for m in got] == list(range(1, STEPS + 1))
    for e, g in zip(expected, got):
        for key in COMPARED:
            assert g[key] == pytest.approx(e[key], rel=1e-5, abs=1e-6), (e["step"], key)


@pytest.fixture(scope="module")
def eta0(uninterrupted, tmp_path_factory):
    """The uninterrupted run's training under async at eta = 0, colocated, each step's trained rows written."""
    tmp = tmp_path_factory.mktemp("agent_eta0")
    (tmp / "reward.py").write_text(REWARD)
    proc = run_command(_command(tmp / "out", tmp, *eta0_overrides(tmp / "rows")), timeout=1200)
    assert proc.returncode == 0, tail(proc)
    return tmp


def test_multi_turn_at_eta_0_trains_what_the_synchronous_run_trains(uninterrupted, eta0):
    sync = [m for m in read_metrics(uninterrupted[0] / "out", "agent") if m["step"] > 0 and "actor/pg_loss" in m]
    got = [m for m in read_metrics(eta0 / "out", "agent") if "actor/pg_loss" in m]
    # Both turns of every trained conversation sampled by the step's own weights; 4 prompts x 4 a step.
    assert_trains_what_sync_trains(sync, got, eta0 / "rows", COMPARED, STEPS, rows_per_step=16)


def test_multi_turn_at_eta_0_resumed_repeats_its_run(eta0, tmp_path):
    copy = experiment_dir(tmp_path / "out", "agent")
    command = _command(tmp_path / "out", eta0, *eta0_overrides(tmp_path / "rows"))  # eta0's reward settings
    assert_a_resume_repeats_it(experiment_dir(eta0 / "out", "agent"), copy, command, COMPARED)
