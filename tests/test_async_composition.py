"""Asynchronous training composed with every rollout kind, DAPO's online filtering and ReMax
(``vlmrl.driver.async_sampler``).

* Validation: neither composition, nor multi-turn rollouts on rollout servers, is refused any more (a test
  fails if a refusal comes back).
* Multi-turn rollouts colocated (two training workers) and on a tensor-parallel rollout server (one), an external
  agent and a workflow class colocated (each on two training workers), a workflow class on a tensor-parallel
  rollout server, and a slow agent on a tensor-parallel rollout server, each at eta = 1. Each run writes the rows
  each step trained (``trainer.rollout_data_dir``): every trained token's version is checked against the bound,
  row by row.
* Multi-turn on a server, with a tool that waits 1 s: a push lands between a trajectory's turns, and its tokens
  say so (the first turn at the version that sampled it, the second at the next, the tool's at none).
* Every cell resumed from step 1's checkpoint: the resumed run trains each step's prompts as the uninterrupted run
  did, the checkpoint's admitted but untrained groups generated again and step 1's not repeated, within the bound.
  The slow agent's steps take the groups that finish first, so there the check is that no group the checkpoint
  held is lost (trained, or held by the last checkpoint) and none is trained twice.
* End to end, eta = 1, one run of both at once on the tiny quickstart per placement (colocated, and one rollout
  server; tests/helpers/async_dapo_remax.py, the disaggregated one shared with tests/test_async_disaggregated.py):
  every trained group's mean reward is inside the filter's bounds, each step still trains its B groups and no
  token older than the bound, and each step has ReMax's greedy baseline. The reward function makes the filter's
  choice known in advance: prompts whose answer is "red" score 1.0 on every sample (a group mean of 1, outside
  (0.01, 0.99)), every other prompt scores between 0.2 and 0.8 (inside); a sub-score ``red`` marks the first kind,
  so its mean over the trained samples, as the step logs it, is 0 exactly when no filtered group trained.

The sampler's logic itself (slots given back, max_try_make_batch, the greedy call at the group's version) is
tests/test_async_sampler.py's, on stand-ins.
"""

from __future__ import annotations

import dataclasses
import json
import textwrap
import time
from pathlib import Path

import pyarrow as pa
import pytest
from helpers.async_dapo_remax import PLACEMENTS, STEPS, dapo_remax_steps
from helpers.configs import CPU, QUICKSTART
from helpers.resume_point import resume_point
from helpers.runs import REPO, E2E_PROMPTS, experiment_dir, read_metrics, run_main, tail

from vlmrl.driver.checkpoint import load_trainer_state
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


# --------------------------------------------------------------------------- multi-turn, colocated and on a server

SMALL = [
    "data.rollout_batch_size=4", "worker.actor.global_batch_size=4", "worker.rollout.n=4",
    "worker.actor.micro_batch_size_per_device_for_update=8", "data.val_files=", "trainer.val_before_train=false",
    "trainer.logger=[console,file]", "trainer.save_freq=1",
]  # fmt: skip
"""3 steps of 4 prompts x 4 rollouts, each step saved (to resume from step 1) and its rows written."""

WAIT_S = 1.0
SLOW_REVEAL = textwrap.dedent(
    f"""
    import time

    from vlmrl.api import ToolResult, tool

    import importlib.util

    spec = importlib.util.spec_from_file_location("agent_tools", {str(REPO / "examples" / "agent_tools.py")!r})
    tools = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tools)


    @tool(name="reveal", description="Show the picture.")
    def reveal(context) -> ToolResult:
        # As a sandbox or a web request would: the trainer's step and its push fit in this wait.
        time.sleep({WAIT_S})
        return tools.reveal(context)
    """
)

MULTI_TURN = {
    "colocated": ["trainer.n_gpus_per_node=2"],  # two training workers
    # One training worker, the server's engine sharded over two processes of its own (tensor parallel); the tool
    # waits WAIT_S s, so that pushes land between a trajectory's turns.
    "on_a_server": [*PLACEMENTS["disaggregated"], "worker.rollout.tensor_parallel_size=2", "SLOW_REVEAL"],
}


@dataclasses.dataclass
class Cell:
    """One cell's run: its metrics per step, the rows each step trained, and how to run it again."""

    steps: list[dict]
    rows: dict[int, list[dict]]
    tmp: Path
    command: list[str]
    experiment: str


def run_cell(tmp: Path, experiment: str, command: list[str]) -> tuple[Cell, str]:
    full = [*command, ASYNC, f"trainer.max_steps={STEPS}", *SMALL, f"trainer.rollout_data_dir={tmp / 'rows'}"]
    proc = run_main(tmp / "out", *full, experiment=experiment, timeout=900)
    assert proc.returncode == 0, tail(proc)
    steps = [m for m in read_metrics(tmp / "out", experiment) if "actor/pg_loss" in m]
    return Cell(steps, trained_rows(tmp / "rows"), tmp, full, experiment), proc.stdout


@pytest.fixture(scope="module", params=sorted(MULTI_TURN))
def multi_turn_async(request, tmp_path_factory):
    """The agent quickstart (reveal tool, two turns) at eta = 1, colocated on two training workers and on one
    tensor-parallel rollout server with one training worker and a slow tool, a small batch."""
    tmp = tmp_path_factory.mktemp(f"async_multi_turn_{request.param}")
    command = [AGENT, "worker.rollout.calculate_log_probs=true"]
    for key in MULTI_TURN[request.param]:
        if key == "SLOW_REVEAL":
            (tmp / "slow_reveal.py").write_text(SLOW_REVEAL)
            key = f"worker.rollout.multi_turn.tools=[{tmp / 'slow_reveal.py'}:reveal]"
        command.append(key)
    cell, stdout = run_cell(tmp, f"multi_turn_{request.param}", command)
    served = request.param == "on_a_server"
    assert ("rollout servers: 1" in stdout) == served, stdout[-4000:]
    assert ("sharded over 2 processes of its own (tensor parallel)" in stdout) == served, stdout[-4000:]
    assert f"workers: {1 if served else 2} on cpu" in stdout, stdout[-4000:]
    return cell


def test_multi_turn_rollouts_run_under_async_within_the_bound(multi_turn_async):
    steps = multi_turn_async.steps
    assert [m["step"] for m in steps] == list(range(1, STEPS + 1))
    for m in steps:
        # The turn loop ran (on the server, there): tool calls were made and answered by a second turn.
        assert m["agent/tool_calls/mean"] > 0 and m["agent/turns/max"] == 2, m["step"]
        # Every trained token within the bound: the oldest token of a group (its first turn) decides.
        assert m["async/lag/max"] <= 1 and m["async/stale_accepted"] == 0, m["step"]
        assert m["async/consumed"] == m["step"] * 4
    # From step 2 the groups trained were admitted a version earlier.
    assert any(m["async/lag/max"] == 1 for m in steps[1:])
    # Per-token versions: step 1's tokens are all version 0, and the decoupled loss sees no gap there.
    assert steps[0]["async/token_lag/mean"] == 0
    assert steps[0]["actor/behav_prox_kl"] == pytest.approx(0, abs=1e-5)
    # Every trained token, row by row: sampled by a version at most one behind the step's, none newer.
    for step, rows in multi_turn_async.rows.items():
        for row in rows:
            generated = [v for v, m in zip(row["versions"], row["loss_mask"]) if m]
            assert generated and all(step - 2 <= v <= step - 1 for v in generated), (step, row["versions"])


def test_per_token_versions_across_a_push_at_a_turn_boundary(multi_turn_async):
    """On a server, a push that lands while a trajectory waits for its tool leaves its first turn at the version
    that sampled it and its second at the next: the tool's tokens have none (-1), a turn's tokens one version
    (keep_kv: a push that landed inside a turn would give that turn two, in order), and no token goes back."""
    rows = [r for step_rows in multi_turn_async.rows.values() for r in step_rows]
    straddled = 0
    for row in rows:
        turns = _turn_versions(row)
        assert all(v == -1 for v, m in zip(row["versions"], row["loss_mask"]) if not m), row["versions"]
        flat = [v for turn in turns for v in turn]
        assert flat == sorted(flat), turns  # later tokens never come from older weights
        if len(turns) == 2 and len(set(turns[0])) == len(set(turns[1])) == 1 and turns[1][0] == turns[0][0] + 1:
            straddled += 1
    if multi_turn_async.experiment == "multi_turn_colocated":
        # Colocated, the engine does not generate while the trainer trains: no trajectory meets a push.
        assert straddled == 0
        return
    # The tool waits WAIT_S s, longer than a step's update and push: trajectories admitted while the trainer
    # trained met a push between their turns.
    assert straddled >= 1, [_turn_versions(r) for r in rows]
    assert max(m["async/partial_rollout_share"] for m in multi_turn_async.steps) > 0


def _turn_versions(row: dict) -> list[list[int]]:
    """The versions of each model turn's tokens: the runs of loss_mask = 1."""
    turns, current = [], []
    for v, m in zip(row["versions"], row["loss_mask"]):
        if m:
            current.append(v)
        elif current:
            turns.append(current)
            current = []
    return [*turns, current] if current else turns


# --------------------------------------------------------------------------- kinds whose rows vary

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
    cell, stdout = run_cell(tmp, request.param, VARYING[request.param])
    workers = 2 if "trainer.n_gpus_per_node=2" in VARYING[request.param] else 1
    assert f"workers: {workers} on cpu" in stdout, stdout[-4000:]
    if "worker.rollout.tensor_parallel_size=2" in VARYING[request.param]:
        assert "sharded over 2 processes of its own (tensor parallel)" in stdout, stdout[-4000:]
    return cell


def test_agents_and_workflow_classes_train_under_async_within_the_bound(varying_rows):
    steps = varying_rows.steps
    assert [m["step"] for m in steps] == list(range(1, STEPS + 1))
    for m in steps:
        assert m["async/consumed"] == m["step"] * 4  # the step's 4 groups, whatever their rows
        assert m["async/lag/max"] <= 1 and m["async/stale_accepted"] == 0, m["step"]
        # Scored and given advantages per rollout before the passes, then trimmed to whole mini-batches.
        assert m["trace/rows_trained"] >= 4 and m["trace/rows_trained"] % 4 == 0, m["step"]
        assert m["async/carried_over"] == 4  # the next step's groups, admitted ahead
    # From step 2 the groups trained were generated by the weights one update older.
    assert all(m["async/lag/max"] == 1 for m in steps[1:])
    for step, rows in varying_rows.rows.items():
        assert len(rows) == steps[step - 1]["trace/rows_trained"]
        assert all(step - 2 <= v <= step - 1 for r in rows for v in r["versions"] if v >= 0), step
        assert_later_tokens_never_older(rows)


def assert_later_tokens_never_older(rows: list[dict]) -> None:
    """Along each row, a call (a turn) that came later was answered by the same weights or newer ones: a push
    between two calls moves the later one's tokens to the next version, never back."""
    for row in rows:
        generated = [v for v in row["versions"] if v >= 0]
        assert generated and generated == sorted(generated), row["versions"]


# --------------------------------------------------------------------------- resumed after step 1

def trained_rows(directory: Path) -> dict[int, list[dict]]:
    """trainer.rollout_data_dir's files: the rows each step trained."""
    return {
        int(f.stem.split("_")[1]): [json.loads(line) for line in f.read_text().splitlines()]
        for f in sorted(directory.glob("step_*.jsonl"))
    }


def resumed(cell: Cell, tmp_path_factory) -> tuple[Cell, list[int], str]:
    """``cell``'s run as it stood after step 1, started again with the same command (its rows written apart);
    also the data rows the step-1 checkpoint holds admitted but not trained."""
    out = tmp_path_factory.mktemp(f"resumed_{cell.experiment}")
    run_dir = experiment_dir(cell.tmp / "out", cell.experiment)
    copy = resume_point(run_dir, experiment_dir(out / "out", cell.experiment), step=1)
    pending = [int(row) for row, _ in load_trainer_state(copy / "checkpoints" / "global_step_1")["sampler"]["pending"]]
    command = [c for c in cell.command if not c.startswith("trainer.rollout_data_dir=")]
    proc = run_main(out / "out", *command, f"trainer.rollout_data_dir={out / 'rows'}", experiment=cell.experiment,
                    timeout=900)  # fmt: skip
    assert proc.returncode == 0, tail(proc)
    steps = [m for m in read_metrics(out / "out", cell.experiment) if "actor/pg_loss" in m]
    return Cell(steps, trained_rows(out / "rows"), out, command, cell.experiment), pending, proc.stdout


def assert_resume_trains_each_prompt_once(cell: Cell, again: Cell, pending: list[int], log: str) -> None:
    assert "resumed from" in log and "global_step_1" in log
    prompts = {step: sorted({r["row"] for r in rows}) for step, rows in cell.rows.items()}
    resumed_prompts = {step: sorted({r["row"] for r in rows}) for step, rows in again.rows.items()}
    # The uninterrupted run trained 4 new prompts a step, none twice.
    assert all(len(p) == 4 for p in prompts.values()) and len({r for p in prompts.values() for r in p}) == 4 * STEPS
    # The resumed run trained steps 2 and 3 only, the same prompts as the uninterrupted run (each step takes the
    # oldest admitted groups, in data order): the groups the checkpoint held admitted and not trained were
    # generated again (none lost), step 1's were not (none twice).
    assert sorted(resumed_prompts) == list(range(2, STEPS + 1))
    assert resumed_prompts == {s: p for s, p in prompts.items() if s > 1}
    assert len(pending) == 4 and set(pending) == set(prompts[2])
    assert not set(prompts[1]) & {r for p in resumed_prompts.values() for r in p}
    # Within the bound after the resume too, its first step's groups at the restored weights' version.
    # (The copy's metrics hold step 1 as the killed run logged it.)
    assert [m["step"] for m in again.steps] == list(range(1, STEPS + 1))
    assert all(m["async/lag/max"] <= 1 and m["async/stale_accepted"] == 0 for m in again.steps)
    for step, rows in again.rows.items():
        assert all(step - 2 <= v <= step - 1 for r in rows for v in r["versions"] if v >= 0), step


@pytest.fixture(scope="module")
def multi_turn_resumed(multi_turn_async, tmp_path_factory):
    return resumed(multi_turn_async, tmp_path_factory)


@pytest.fixture(scope="module")
def varying_resumed(varying_rows, tmp_path_factory):
    return resumed(varying_rows, tmp_path_factory)


def test_a_resumed_multi_turn_run_trains_each_prompt_once(multi_turn_async, multi_turn_resumed):
    assert_resume_trains_each_prompt_once(multi_turn_async, *multi_turn_resumed)


def test_a_resumed_agent_or_workflow_run_trains_each_prompt_once(varying_rows, varying_resumed):
    assert_resume_trains_each_prompt_once(varying_rows, *varying_resumed)


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
SLOW = 90
"""Seconds a slow rollout sleeps: longer than the whole run takes when no step waits for one."""


@pytest.fixture(scope="module")
def served_agent(tmp_path_factory):
    """The demo agent on one rollout server at eta = 1, its engine sharded over two processes (tensor parallel),
    consume_order=finished; rollouts of "red" tasks sleep SLOW s first. Validation runs before training (4 rows,
    on the server) to see the reported reward in a row. Each step is saved and its rows written, to resume."""
    import pyarrow.parquet as pq

    from vlmrl.testing.assets import ensure_quickstart_assets

    tmp = tmp_path_factory.mktemp("async_agent_server")
    (tmp / "agent.py").write_text(
        SLOW_AGENT.format(path=str(REPO / "examples" / "openai_agent" / "agent.py"), slow=SLOW)
    )
    # Four validation rows without a red one, so that validation does not wait for a slow rollout.
    table = pq.read_table(ensure_quickstart_assets().val_file).to_pandas()
    pq.write_table(pa_table(table[table["answer"] != "red"].head(4)), tmp / "val.parquet")
    command = [
        "config=examples/openai_agent/config.yaml", f"worker.rollout.agent={tmp / 'agent.py'}:solve",
        ASYNC, *PLACEMENTS["disaggregated"], "worker.rollout.tensor_parallel_size=2",
        "worker.rollout.async_rl.consume_order=finished",
        f"trainer.max_steps={STEPS}", "data.rollout_batch_size=4", "worker.actor.global_batch_size=4",
        "worker.rollout.n=2", "worker.actor.micro_batch_size_per_device_for_update=8",
        f"data.val_files={tmp / 'val.parquet'}", "trainer.val_before_train=true", "trainer.val_freq=-1",
        "trainer.val_generations_to_log=4", "trainer.logger=[console,file]", "trainer.save_freq=1",
    ]  # fmt: skip
    start = time.monotonic()
    proc = run_main(tmp / "out", *command, f"trainer.rollout_data_dir={tmp / 'rows'}", experiment="agent_server",
                    timeout=900)  # fmt: skip
    seconds = time.monotonic() - start
    assert proc.returncode == 0, tail(proc)
    assert "sharded over 2 processes of its own (tensor parallel)" in proc.stdout, tail(proc)
    metrics = read_metrics(tmp / "out", "agent_server")
    steps = [m for m in metrics if "actor/pg_loss" in m]
    cell = Cell(steps, trained_rows(tmp / "rows"), tmp, command, "agent_server")
    return metrics, seconds, experiment_dir(tmp / "out", "agent_server"), cell


def test_a_slow_agent_on_a_rollout_server_never_holds_up_a_step(served_agent):
    metrics, seconds, _, _ = served_agent
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
    # Every trained token within the bound, and each rollout's later call never answered by older weights.
    for step, rows in served_agent[3].rows.items():
        assert all(step - 2 <= v <= step - 1 for r in rows for v in r["versions"] if v >= 0), step
        assert_later_tokens_never_older(rows)


def test_a_reward_an_agent_reports_on_a_rollout_server_reaches_its_turn(served_agent):
    _, _, run_dir, _ = served_agent
    rows = [json.loads(line) for f in sorted((run_dir / "generations").iterdir()) for line in f.read_text().splitlines()]
    assert rows and all(r["turn_rewards"][0] == 0.5 for r in rows), [r.get("turn_rewards") for r in rows]


@pytest.fixture(scope="module")
def served_agent_resumed(served_agent, tmp_path_factory):
    return resumed(served_agent[3], tmp_path_factory)


def test_a_resumed_slow_agent_run_loses_no_prompt_and_trains_none_twice(served_agent, served_agent_resumed):
    """consume_order=finished: which admitted groups a step takes depends on which finish first, so the resumed run
    need not take the uninterrupted run's. But every group the checkpoint held admitted and untrained is generated
    again and either trained or, still running at the end, held by the last checkpoint; none is trained twice."""
    cell = served_agent[3]
    again, pending, log = served_agent_resumed
    assert "resumed from" in log and "global_step_1" in log
    assert sorted(again.rows) == list(range(2, STEPS + 1))
    first = {r["row"] for r in cell.rows[1]}
    later = [sorted({r["row"] for r in again.rows[step]}) for step in range(2, STEPS + 1)]
    assert len(first) == 4 and all(len(p) == 4 for p in later)  # each step its 4 groups
    trained = [*first, *(row for p in later for row in p)]
    assert len(trained) == len(set(trained)), "a prompt trained twice"
    run_dir = experiment_dir(again.tmp / "out", again.experiment)
    last = load_trainer_state(run_dir / "checkpoints" / f"global_step_{STEPS}")
    final = {int(row) for row, _ in last["sampler"]["pending"]}
    assert len(pending) >= 4 and not set(pending) & first
    assert set(pending) <= set(trained) | final, "a group the checkpoint held was lost"
    for m in again.steps:
        assert m["async/lag/max"] <= 1 and m["async/stale_accepted"] == 0, m["step"]
    for step, rows in again.rows.items():
        assert all(step - 2 <= v <= step - 1 for r in rows for v in r["versions"] if v >= 0), step
