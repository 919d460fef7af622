"""Asynchronous training composed with DAPO's online filtering and ReMax (``vlmrl.driver.async_sampler``).

* Validation: neither composition, nor multi-turn rollouts on rollout servers, is refused any more (a test
  fails if a refusal comes back).
* Multi-turn rollouts colocated and on a rollout server with two training workers, an external agent and a
  workflow class colocated (each on two training workers), and a slow agent on a rollout server, each at eta = 1.
* End to end, eta = 1, one run of both at once on the tiny quickstart per placement (colocated, and one rollout
  server; tests/helpers/async_dapo_remax.py, the disaggregated one shared with tests/test_async_disaggregated.py):
  every trained group's mean reward is inside the filter's bounds, each step still trains its B groups and no
  token older than the bound, and each step has ReMax's greedy baseline. The reward function makes the filter's choice known in advance:
  prompts whose answer is "red" score 1.0 on every sample (a group mean of 1, outside (0.01, 0.99)), every
  other prompt scores between 0.2 and 0.8 (inside); a sub-score ``red`` marks the first kind, so its mean over
  the trained samples, as the step logs it, is 0 exactly when no filtered group trained.

The sampler's logic itself (slots given back, max_try_make_batch, the greedy call at the group's version) is
tests/test_async_sampler.py's, on stand-ins.
"""

from __future__ import annotations

import json
import textwrap
import time

import pyarrow as pa
import pytest
from helpers.async_dapo_remax import PLACEMENTS, STEPS, dapo_remax_steps
from helpers.configs import CPU, QUICKSTART
from helpers.runs import REPO, E2E_PROMPTS, experiment_dir, read_metrics, run_main, tail

from vlmrl.validate import load_config

ASYNC = "worker.rollout.async_rl.enable=true"
AGENT = "config=examples/agent_quickstart.yaml"


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch, quickstart_assets):
    monkeypatch.chdir(REPO)


def pa_table(frame) -> pa.Table:
    return pa.Table.from_pandas(frame, preserve_index=False)


@pytest.mark.parametrize(
    "overrides",
    [
        ["algorithm.online_filtering=true"],
        ["algorithm.adv_estimator=remax"],
        ["algorithm.online_filtering=true", "algorithm.adv_estimator=remax"],
        ["algorithm.online_filtering=true", "worker.rollout.async_rl.max_head_offpolicyness=0"],
        ["algorithm.adv_estimator=remax", "worker.rollout.async_rl.placement=disaggregated",
         "worker.rollout.async_rl.rollout_workers=1"],
    ],
    ids=["dapo", "remax", "both", "dapo-eta0", "remax-disaggregated"],
)  # fmt: skip
def test_dapo_and_remax_validate_under_async(overrides):
    load_config([QUICKSTART, ASYNC, *overrides], CPU)  # raises ConfigError listing every problem


def test_multi_turn_on_rollout_servers_validates():
    load_config([AGENT, ASYNC, *PLACEMENTS["disaggregated"]], CPU)


@pytest.mark.parametrize("kind", ["config=examples/openai_agent/config.yaml", "config=examples/workflow.yaml"])
def test_agents_and_workflow_classes_validate_under_async_colocated(kind):
    load_config([kind, ASYNC], CPU)


@pytest.fixture(scope="module", params=sorted(PLACEMENTS))
def dapo_remax(request, tmp_path_factory):
    """The run of both at once (tests/helpers/async_dapo_remax.py), shared with tests/test_async_disaggregated.py."""
    return dapo_remax_steps(request.param, tmp_path_factory)


def test_async_online_filtering_trains_only_groups_inside_the_bounds_and_fills_each_step(dapo_remax):
    assert [m["step"] for m in dapo_remax] == list(range(1, STEPS + 1))
    for m in dapo_remax:
        assert m["reward/red"] == 0.0, m["step"]  # no trained sample came from a filtered ("red") group
        assert 0.2 <= m["reward/overall"] <= 0.8
        assert m["async/consumed"] == m["step"] * E2E_PROMPTS  # each step trained its B groups
        assert m["async/lag/max"] <= 1 and m["async/stale_accepted"] == 0
    # The data has red answers (a quarter of them): some groups were filtered out, and their slots reused.
    assert min(m["filter/kept_group_ratio"] for m in dapo_remax) < 1.0
    assert dapo_remax[-1]["async/rejected"] >= 1


def test_async_remax_has_its_greedy_baseline_each_step(dapo_remax):
    for m in dapo_remax:
        # The greedy responses of the trained groups, scored by the same function: never a "red" one either.
        assert 0.2 <= m["reward_baseline/overall"] <= 0.8 and m["reward_baseline/red"] == 0.0


# --------------------------------------------------------------------------- multi-turn on a rollout server


MULTI_TURN = {
    "colocated": [],  # one worker
    "on_a_server": [*PLACEMENTS["disaggregated"], "trainer.n_gpus_per_node=2"],  # two training workers
}


@pytest.fixture(scope="module", params=sorted(MULTI_TURN))
def multi_turn_async(request, tmp_path_factory):
    """The agent quickstart (reveal tool, two turns) at eta = 1, colocated on one worker and on one rollout server
    with two training workers, a small batch."""
    tmp = tmp_path_factory.mktemp(f"async_multi_turn_{request.param}")
    proc = run_main(
        tmp / "out", AGENT, ASYNC, *MULTI_TURN[request.param], f"trainer.max_steps={STEPS}",
        "data.rollout_batch_size=4", "worker.actor.global_batch_size=4", "worker.rollout.n=4",
        "worker.actor.micro_batch_size_per_device_for_update=8", "worker.rollout.calculate_log_probs=true",
        "data.val_files=", "trainer.val_before_train=false", "trainer.logger=[console,file]",
        experiment="multi_turn", timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, tail(proc)
    served = request.param == "on_a_server"
    assert ("rollout servers: 1" in proc.stdout) == served, tail(proc)
    assert f"workers: {2 if served else 1} on cpu" in proc.stdout, tail(proc)
    return [m for m in read_metrics(tmp / "out", "multi_turn") if "actor/pg_loss" in m]


def test_multi_turn_rollouts_run_under_async_within_the_bound(multi_turn_async):
    assert [m["step"] for m in multi_turn_async] == list(range(1, STEPS + 1))
    for m in multi_turn_async:
        # The turn loop ran (on the server, there): tool calls were made and answered by a second turn.
        assert m["agent/tool_calls/mean"] > 0 and m["agent/turns/max"] == 2, m["step"]
        # Every trained token within the bound: the oldest token of a group (its first turn) decides.
        assert m["async/lag/max"] <= 1 and m["async/stale_accepted"] == 0, m["step"]
        assert m["async/consumed"] == m["step"] * 4
    # From step 2 the groups trained were admitted a version earlier.
    assert any(m["async/lag/max"] == 1 for m in multi_turn_async[1:])
    # Per-token versions: step 1's tokens are all version 0; a later step's turns were sampled at v - 1 or, on a
    # server, for a trajectory a push reached between its turns, partly at v: none older, and the decoupled loss
    # sees them.
    assert multi_turn_async[0]["async/token_lag/mean"] == 0
    assert all(0 <= m["async/token_lag/mean"] <= 1 for m in multi_turn_async[1:])
    assert multi_turn_async[0]["actor/behav_prox_kl"] == pytest.approx(0, abs=1e-5)


# --------------------------------------------------------------------------- kinds whose rows vary, colocated

VARYING = {
    "openai_agent": ["config=examples/openai_agent/config.yaml", "trainer.n_gpus_per_node=2"],  # two workers
    "workflow_class": ["config=examples/workflow.yaml", "trainer.n_gpus_per_node=2"],  # two training workers
    # The server's engine sharded over two processes of its own (tensor parallel).
    "workflow_class_on_a_server": [
        "config=examples/workflow.yaml", *PLACEMENTS["disaggregated"], "worker.rollout.tensor_parallel_size=2"
    ],
}


@pytest.fixture(scope="module", params=sorted(VARYING))
def varying_rows(request, tmp_path_factory):
    """An external agent (the OpenAI-SDK demo, two calls a rollout) and a workflow class (zoom and answer), each at
    eta = 1 colocated on two training workers, and the workflow class on one rollout server whose engine is sharded
    over two processes, for 3 steps of 4 prompts x 4 rollouts."""
    tmp = tmp_path_factory.mktemp(f"async_{request.param}")
    proc = run_main(
        tmp / "out", *VARYING[request.param], ASYNC, f"trainer.max_steps={STEPS}", "data.rollout_batch_size=4",
        "worker.actor.global_batch_size=4", "worker.rollout.n=4", "worker.actor.micro_batch_size_per_device_for_update=8",
        "data.val_files=", "trainer.val_before_train=false", "trainer.logger=[console,file]",
        experiment=request.param, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, tail(proc)
    workers = 2 if "trainer.n_gpus_per_node=2" in VARYING[request.param] else 1
    assert f"workers: {workers} on cpu" in proc.stdout, tail(proc)
    if "worker.rollout.tensor_parallel_size=2" in VARYING[request.param]:
        assert "sharded over 2 processes of its own (tensor parallel)" in proc.stdout, tail(proc)
    return [m for m in read_metrics(tmp / "out", request.param) if "actor/pg_loss" in m]


def test_agents_and_workflow_classes_train_under_async_within_the_bound(varying_rows):
    assert [m["step"] for m in varying_rows] == list(range(1, STEPS + 1))
    for m in varying_rows:
        assert m["async/consumed"] == m["step"] * 4  # the step's 4 groups, whatever their rows
        assert m["async/lag/max"] <= 1 and m["async/stale_accepted"] == 0, m["step"]
        # Scored and given advantages per rollout before the passes, then trimmed to whole mini-batches.
        assert m["trace/rows_trained"] >= 4 and m["trace/rows_trained"] % 4 == 0, m["step"]
        assert m["async/carried_over"] == 4  # the next step's groups, admitted ahead
    # From step 2 the groups trained were generated by the weights one update older.
    assert all(m["async/lag/max"] == 1 for m in varying_rows[1:])


# --------------------------------------------------------------------------- on a rollout server, a slow agent

SLOW_AGENT = textwrap.dedent(
    """
    import asyncio
    import importlib.util
    import random

    spec = importlib.util.spec_from_file_location("demo_agent", {path!r})
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)


    async def solve(task, llm):
        # Rollouts of a "red" task take SLOW seconds; the others 0 to 1 s, at random.
        slow = task["ground_truth"] == "red"
        await asyncio.sleep({slow} if slow else random.Random(task["row_index"]).random())
        reward = await demo.solve(task, llm)
        await asyncio.to_thread(llm.emit_reward, 0.5, 0)  # the first call's turn: reported mid-rollout
        return reward
    """
)
SLOW = 60
"""Seconds a slow rollout sleeps: longer than the whole run takes when no step waits for one."""


@pytest.fixture(scope="module")
def served_agent(tmp_path_factory):
    """The demo agent on one rollout server at eta = 1, consume_order=finished; rollouts of "red" tasks sleep
    SLOW s first. Validation runs before training (4 rows, on the server) to see the reported reward in a row."""
    import pyarrow.parquet as pq

    from vlmrl.testing.assets import ensure_quickstart_assets

    tmp = tmp_path_factory.mktemp("async_agent_server")
    (tmp / "agent.py").write_text(
        SLOW_AGENT.format(path=str(REPO / "examples" / "openai_agent" / "agent.py"), slow=SLOW)
    )
    # Four validation rows without a red one, so that validation does not wait for a slow rollout.
    table = pq.read_table(ensure_quickstart_assets().val_file).to_pandas()
    pq.write_table(pa_table(table[table["answer"] != "red"].head(4)), tmp / "val.parquet")
    start = time.monotonic()
    proc = run_main(
        tmp / "out", "config=examples/openai_agent/config.yaml", f"worker.rollout.agent={tmp / 'agent.py'}:solve",
        ASYNC, *PLACEMENTS["disaggregated"], "worker.rollout.async_rl.consume_order=finished",
        f"trainer.max_steps={STEPS}", "data.rollout_batch_size=4", "worker.actor.global_batch_size=4",
        "worker.rollout.n=2", "worker.actor.micro_batch_size_per_device_for_update=8",
        f"data.val_files={tmp / 'val.parquet'}", "trainer.val_before_train=true", "trainer.val_freq=-1",
        "trainer.val_generations_to_log=4", "trainer.logger=[console,file]",
        experiment="agent_server", timeout=900,
    )  # fmt: skip
    seconds = time.monotonic() - start
    assert proc.returncode == 0, tail(proc)
    metrics = read_metrics(tmp / "out", "agent_server")
    return metrics, seconds, experiment_dir(tmp / "out", "agent_server")


def test_a_slow_agent_on_a_rollout_server_never_holds_up_a_step(served_agent):
    metrics, seconds, _ = served_agent
    steps = [m for m in metrics if "actor/pg_loss" in m]
    assert [m["step"] for m in steps] == list(range(1, STEPS + 1))
    # The steps took the groups that finished: the run was over before a slow rollout could have finished,
    # with red tasks among those admitted (a quarter of the colours; 8 groups admitted at once).
    assert seconds < SLOW, f"the run took {seconds:.0f} s: a step waited for a slow rollout"
    for m in steps:
        assert m["async/consumed"] == m["step"] * 4
        assert m["async/lag/max"] <= 1 and m["async/stale_accepted"] == 0, m["step"]
        assert m["trace/rows_trained"] >= 4, m["step"]
    # Groups admitted earlier were still generating when the last step ended: carried over, never waited for.
    assert steps[-1]["async/lag/in_flight_max"] >= 1
    assert steps[-1]["async/carried_over"] >= 1


def test_a_reward_an_agent_reports_on_a_rollout_server_reaches_its_turn(served_agent):
    _, _, run_dir = served_agent
    rows = [json.loads(line) for f in sorted((run_dir / "generations").iterdir()) for line in f.read_text().splitlines()]
    assert rows and all(r["turn_rewards"][0] == 0.5 for r in rows), [r.get("turn_rewards") for r in rows]
