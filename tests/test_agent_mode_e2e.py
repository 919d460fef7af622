"""Agent mode end to end: ``python -m vlmrl.main`` trains the demo's OpenAI-SDK agent on the real stack.

The agent (examples/openai_agent/agent.py, written with the ``openai`` package alone) makes two chat calls
per rollout with the row's picture, against the endpoint each worker serves on its own vLLM engine. One
uninterrupted run of 2 steps, with validation, serves most checks:

* every call the endpoint recorded (read by an ``on_succeeded`` hook) is in the rows: a validation row's
  tokens after its prompt are call 1's response, call 2's new prompt tokens (mask 0) and call 2's
  response, with the recorded log-probs on the trained tokens;
* the actor's log-probs of those rows equal the engine's (fp32), at every step;
* the reward function scored each rollout once, on the final answer;
* the endpoint listened on loopback only, and its port is closed once the run has ended;
* a reward the agent reports for its first call (``llm.emit_reward``) is that call's record and that turn's
  reward in the row.

A second run starts from the uninterrupted run as it stood after step 1: it must repeat the uninterrupted run's steps.
A third is the uninterrupted run's training under asynchronous training at eta = 0 (colocated, without validation):
each step's agents call the weights of the step before, so it trains exactly what the synchronous run trains;
started again from its step-1 checkpoint, it trains step 2 as it did.
"""

from __future__ import annotations

import json
import re
import socket
import sys
import textwrap

import pyarrow.parquet as pq
import pytest
from helpers.eta0 import assert_a_resume_repeats_it, assert_trains_what_sync_trains, eta0_overrides
from helpers.runs import REPO, experiment_dir, read_metrics, run_command, tail
from helpers.resume_point import resume_point
from transformers import AutoTokenizer

STEPS = 2
COMPARED = ["reward/overall", "response_length/mean", "actor/pg_loss", "actor/grad_norm", "trace/rows",
            "agent/calls", "critic/advantages/max"]  # fmt: skip

HOOKS = textwrap.dedent(
    """
    import json

    def on_succeeded(record):
        calls = [
            {{"index": c.index, "prompt_ids": list(c.prompt_ids), "response_ids": list(c.response_ids),
             "log_probs": list(c.log_probs), "version": c.version, "reward": c.reward}}
            for c in record.calls
        ]
        with open({path!r}, "a") as f:
            f.write(json.dumps({{"rollout_id": record.rollout_id, "calls": calls}}) + "\\n")
    """
)

# The demo agent, reporting a reward of 0.5 for its first call (its "look" turn) before it returns.
AGENT = textwrap.dedent(
    """
    import asyncio
    import importlib.util

    spec = importlib.util.spec_from_file_location("demo_agent", {path!r})
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)


    async def solve(task, llm):
        reward = await demo.solve(task, llm)
        await asyncio.to_thread(llm.emit_reward, 0.5, 0)
        return reward
    """
)
LOOK_REWARD = 0.5

REWARD = textwrap.dedent(
    """
    import json

    def compute_score(reward_input, log_path, **quickstart_kwargs):
        with open(log_path, "a") as f:
            f.write(json.dumps({"rollout_id": reward_input.get("rollout_id"), "response": reward_input["response"]}) + "\\n")
        return {"overall": float(reward_input["response"].strip().lower() == reward_input["ground_truth"])}
    """
)


def _command(tmp, *extra, out=None):
    return [
        sys.executable, "-m", "vlmrl.main", "config=examples/openai_agent/config.yaml",
        f"trainer.output_dir={out or tmp / 'out'}", "trainer.experiment_name=agent_mode", f"trainer.max_steps={STEPS}",
        "data.rollout_batch_size=4", "worker.actor.global_batch_size=4", "worker.rollout.n=4",
        "worker.actor.micro_batch_size_per_device_for_update=8",
        f"worker.reward.reward_function={tmp / 'reward.py'}:compute_score",
        f"worker.reward.reward_function_kwargs={{log_path: {tmp / 'scored.jsonl'}}}",
        f"worker.rollout.agent_hooks.on_succeeded={tmp / 'hooks.py'}:on_succeeded",
        f"worker.rollout.agent={tmp / 'agent.py'}:solve",
        "trainer.save_freq=1", "trainer.logger=[console,file]", *extra,
    ]  # fmt: skip



def _files(tmp):
    (tmp / "reward.py").write_text(REWARD)
    (tmp / "hooks.py").write_text(HOOKS.format(path=str(tmp / "calls.jsonl")))
    (tmp / "agent.py").write_text(AGENT.format(path=str(REPO / "examples" / "openai_agent" / "agent.py")))


def _validation(tmp):
    return [f"data.val_files={tmp / 'val.parquet'}", "trainer.val_generations_to_log=4"]


@pytest.fixture(scope="module")
def uninterrupted(quickstart_assets, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("agent_mode")
    _files(tmp)
    pq.write_table(pq.read_table(quickstart_assets.val_file).slice(0, 4), tmp / "val.parquet")
    proc = run_command(_command(tmp, *_validation(tmp)), timeout=1200)
    assert proc.returncode == 0, tail(proc)
    return tmp, proc.stdout + proc.stderr


def _recorded(tmp) -> dict[str, list[dict]]:
    rollouts = [json.loads(line) for line in (tmp / "calls.jsonl").read_text().splitlines()]
    return {r["rollout_id"]: sorted(r["calls"], key=lambda c: c["index"]) for r in rollouts}


def test_the_rows_are_the_calls_the_endpoint_recorded(uninterrupted):
    tmp, _ = uninterrupted
    recorded = _recorded(tmp)
    generations = experiment_dir(tmp / "out", "agent_mode") / "generations"
    rows = [json.loads(line) for f in sorted(generations.iterdir()) for line in f.read_text().splitlines()]
    assert len(rows) == 4 * 2  # 4 validation rows, before training and after step 2
    merged = 0
    for row in rows:
        calls = recorded[row["rollout_id"]]
        assert len(calls) == 2  # look, then answer
        first, second = calls
        assert (first["reward"], second["reward"]) == (LOOK_REWARD, 0.0)  # as the agent reported them
        start = len(first["prompt_ids"])  # the row's prompt is call 1's
        if second["prompt_ids"][:start] != first["prompt_ids"]:
            continue  # a split row (the reply did not re-encode to its tokens): checked in test_agent_mode_rows
        context = first["prompt_ids"] + first["response_ids"]
        if second["prompt_ids"][: len(context)] != context:
            continue
        merged += 1
        observation = second["prompt_ids"][len(context) :]
        assert row["response_ids"] == first["response_ids"] + observation + second["response_ids"]
        assert row["loss_mask"] == [1] * len(first["response_ids"]) + [0] * len(observation) + [1] * len(
            second["response_ids"]
        )
        assert row["turn_rewards"] == [LOOK_REWARD, 0.0]  # the reported reward reached its turn
        trained = [x for x, m in zip(row["rollout_log_probs"], row["loss_mask"]) if m]
        assert trained == pytest.approx(first["log_probs"] + second["log_probs"], abs=0)
    assert merged >= 4, "most rows of an append-only template merge both calls"


def test_the_actor_sees_the_engines_log_probs_and_each_rollout_is_scored_once(uninterrupted, quickstart_assets):
    tmp, _ = uninterrupted
    metrics = read_metrics(tmp / "out", "agent_mode")
    train = [m for m in metrics if "actor/pg_loss" in m]
    assert [m["step"] for m in train] == list(range(1, STEPS + 1))
    for m in train:
        # fp32 engine and actor: the recorded log-probs are the actor's, after a resync too.
        assert m["rollout/log_prob_diff_max"] < 1e-4, m["rollout/log_prob_diff_max"]
        assert m["agent/rollouts/ok"] == 16 and m["agent/calls"] == 32
        assert m["trace/rows"] == 16 + m["trace/mismatches"]  # one row per rollout, one more per split
        assert m["trace/rows_trained"] == m["trace/rows"] - m["trace/trimmed_rows"]
    scored = [json.loads(line) for line in (tmp / "scored.jsonl").read_text().splitlines()]
    ids = [s["rollout_id"] for s in scored]
    assert len(ids) == len(set(ids)), "a rollout was scored more than once"
    recorded = _recorded(tmp)
    assert set(ids) == set(recorded)  # every rollout that finished, training and validation
    # The answer scored is the last call's reply, as the agent got it.
    tokenizer = AutoTokenizer.from_pretrained(quickstart_assets.model_dir)
    for s in scored:
        last = recorded[s["rollout_id"]][-1]
        assert s["response"] == tokenizer.decode(last["response_ids"], skip_special_tokens=True)


def test_the_endpoint_listened_on_loopback_and_is_closed_after_the_run(uninterrupted):
    tmp, log = uninterrupted
    run_log = (experiment_dir(tmp / "out", "agent_mode") / "run.log").read_text()
    urls = re.findall(r"agent endpoint: serving http://([\d.]+):(\d+)/v1", run_log + log)
    assert urls, "the worker says where its endpoint listens"
    for host, port in urls:
        assert host == "127.0.0.1"
        assert not _endpoint_answers(int(port)), f"the endpoint on port {port} still answers after the run"


def _endpoint_answers(port: int) -> bool:
    """Whether vlmrl's endpoint answers on ``port``: it refuses a call without an API key with its own error code.
    (Once the endpoint is closed, another process on this machine may have been given the same port.)"""
    with socket.socket() as s:
        s.settimeout(2)
        if s.connect_ex(("127.0.0.1", port)) != 0:
            return False
        try:
            s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            reply = s.recv(4096)
        except OSError:
            return False
    return b"missing_api_key" in reply


@pytest.fixture(scope="module")
def resumed(uninterrupted, tmp_path_factory):
    """The uninterrupted run as it stood after step 1 (its directory without later checkpoints and metrics),
    started again with its command less the validation (which does not change what trains): it resumes from
    step 1's checkpoint. (The save being killed part way is tests/test_resume.py's; here what matters is that
    agents resume exactly.)"""
    tmp, _ = uninterrupted
    out = tmp_path_factory.mktemp("agent_mode_resumed") / "out"
    copy = resume_point(experiment_dir(tmp / "out", "agent_mode"), experiment_dir(out, "agent_mode"), step=1)
    again = run_command(_command(tmp, "data.val_files=", "trainer.val_before_train=false", out=out), timeout=1200)
    assert again.returncode == 0, tail(again)
    return copy, again.stdout + again.stderr


def test_a_resumed_agent_run_repeats_the_uninterrupted_one(uninterrupted, resumed):
    copy, log = resumed
    assert "resumed from" in log and "global_step_1" in log
    expected = [m for m in read_metrics(uninterrupted[0] / "out", "agent_mode") if "actor/pg_loss" in m]
    got = [m for m in read_metrics(copy.parents[1], "agent_mode") if "actor/pg_loss" in m]
    assert [m["step"] for m in got] == list(range(1, STEPS + 1))
    for e, g in zip(expected, got):
        for key in COMPARED:
            assert g[key] == pytest.approx(e[key], rel=1e-5, abs=1e-6), (e["step"], key)


@pytest.fixture(scope="module")
def eta0(uninterrupted, tmp_path_factory):
    """The uninterrupted run's training under async at eta = 0, colocated, each step's trained rows written."""
    tmp = tmp_path_factory.mktemp("agent_mode_eta0")
    _files(tmp)
    proc = run_command(_command(tmp, *eta0_overrides(tmp / "rows")), timeout=1200)
    assert proc.returncode == 0, tail(proc)
    return tmp


def test_an_agent_at_eta_0_trains_what_the_synchronous_run_trains(uninterrupted, eta0):
    sync = [m for m in read_metrics(uninterrupted[0] / "out", "agent_mode") if "actor/pg_loss" in m]
    got = [m for m in read_metrics(eta0 / "out", "agent_mode") if "actor/pg_loss" in m]
    # Every call of every trained row answered by the step's own weights (the context between calls has none).
    assert_trains_what_sync_trains(sync, got, eta0 / "rows", COMPARED, STEPS)


def test_an_agent_at_eta_0_resumed_repeats_its_run(eta0, tmp_path):
    copy = experiment_dir(tmp_path / "out", "agent_mode")
    command = _command(eta0, *eta0_overrides(tmp_path / "rows"), out=tmp_path / "out")  # eta0's agent and reward
    assert_a_resume_repeats_it(experiment_dir(eta0 / "out", "agent_mode"), copy, command, COMPARED)
