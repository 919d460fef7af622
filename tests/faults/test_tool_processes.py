"""Fault: a tool that ends its process, one that hangs, and a tool or sync agent that returns an object that would
run code when unpickled.

With ``multi_turn.tool_processes`` (on by default) tools run in child
processes of the rollout worker: ``os._exit`` in a tool ends its process, not
the worker, and the model reads an error; a hung call's process is killed at
the timeout and replaced; what a tool returns (and leaves in
``context.state``) comes back as data. With ``tool_processes=0`` they run in
the worker's threads, and once every thread is held by a call that timed
out, the next call fails loudly (ToolPoolExhausted) instead of timing out
unseen.
"""

from __future__ import annotations

import asyncio
import os
import signal
import textwrap
import time

import pytest
from helpers.processes import alive

from vlmrl.config import ConfigError
from vlmrl.rollout.turns.tools import ToolContext, ToolPoolExhausted, ToolRunner, ToolStatus, load_tools
from vlmrl.validate import load_config

TOOLS = """
    import os, time

    class Evil:
        def __init__(self, path):
            self.path = path

        def __reduce__(self):  # unpickled, this would make a directory: code run wherever it is rebuilt
            return (os.mkdir, (self.path,))

    def crash(code: int):
        os._exit(code)

    def hang(pid_file: str, seconds: float = 600):
        with open(pid_file, "w") as f:
            f.write(str(os.getpid()))
        time.sleep(seconds)

    def count(context):
        context.state["n"] = context.state.get("n", 0) + 1
        return f"call {context.state['n']} of sample {context.sample_id}, turn {context.turn}"

    def evil(path: str):
        return {"text": "x", "images": [Evil(path)]}
"""


@pytest.fixture
def tools(tmp_path):
    path = tmp_path / "tools.py"
    path.write_text(textwrap.dedent(TOOLS))
    return load_tools([f"{path}:{name}" for name in ("crash", "hang", "count", "evil")])


def _context(state: dict | None = None) -> ToolContext:
    return ToolContext(row={"ground_truth": "a"}, images=[], turn=2, state=state if state is not None else {},
                       sample_id="s0")  # fmt: skip


def test_os_exit_in_a_tool_ends_its_process_not_the_worker(tools):
    runner = ToolRunner(tools, timeout=60, processes=1)
    try:
        crashed = asyncio.run(runner.call("crash", {"code": 3}, _context()))
        assert crashed.status is ToolStatus.error, crashed
        assert "the tool process exited with code 3" in crashed.result.text
        state = {}
        after = asyncio.run(runner.call("count", {}, _context(state)))  # a fresh process serves the next call
        assert after.status is ToolStatus.ok and after.result.text == "call 1 of sample s0, turn 2", after
        assert state == {"n": 1}  # context.state came back from the child
    finally:
        runner.close()


def test_a_hung_tools_process_is_killed_at_the_timeout(tools, tmp_path):
    pid_file = tmp_path / "pid"
    runner = ToolRunner(tools, timeout=2, processes=1)
    try:
        hung = asyncio.run(runner.call("hang", {"pid_file": str(pid_file)}, _context()))
        assert hung.status is ToolStatus.timeout, hung
        pid = int(pid_file.read_text())
        deadline = time.monotonic() + 10
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        running = alive(pid)
        if running:
            os.kill(pid, signal.SIGKILL)
        assert not running, "the hung tool's process was not killed"
        assert asyncio.run(runner.call("count", {}, _context())).status is ToolStatus.ok
    finally:
        runner.close()


def test_a_tool_result_that_would_run_code_when_unpickled_runs_nothing(tools, tmp_path):
    mark = tmp_path / "ran-in-the-worker"
    runner = ToolRunner(tools, timeout=60, processes=1)
    try:
        outcome = asyncio.run(runner.call("evil", {"path": str(mark)}, _context()))
    finally:
        runner.close()
    assert not mark.exists(), "a tool's result ran code in the rollout worker"
    assert outcome.status is ToolStatus.error and "is not data" in outcome.result.text, outcome


def test_threads_held_by_hung_calls_fail_the_next_call_loudly(tools, tmp_path):
    runner = ToolRunner(tools, timeout=0.5, threads=2, processes=0)
    pids = tmp_path / "pid"

    async def calls():
        first = await asyncio.gather(*(runner.call("hang", {"pid_file": str(pids), "seconds": 5}, _context()) for _ in range(2)))
        assert [o.status for o in first] == [ToolStatus.timeout] * 2
        with pytest.raises(ToolPoolExhausted, match="all 2 tool threads are held by calls that ran past"):
            await runner.call("count", {}, _context())

    try:
        asyncio.run(calls())
    finally:
        runner.close()  # the two threads sleep on for a few seconds


def test_tool_processes_is_a_validated_key():
    agent = ["config=examples/agent_quickstart.yaml"]
    assert load_config(agent).worker.rollout.multi_turn.tool_processes == 4
    with pytest.raises(ConfigError, match="multi_turn.tool_processes=-1: must be at least 0"):
        load_config([*agent, "worker.rollout.multi_turn.tool_processes=-1"])


AGENT = """
    import os

    class Evil:
        def __reduce__(self):
            return (os.mkdir, (os.environ["EVIL_MARK"],))

    def agent(task, llm):
        return Evil()
"""


def test_a_sync_agents_return_value_that_would_run_code_when_unpickled_runs_nothing(tmp_path, monkeypatch):
    from vlmrl.rollout.agents.pool import AgentProcesses

    mark = tmp_path / "ran-in-the-worker"
    monkeypatch.setenv("EVIL_MARK", str(mark))
    (tmp_path / "agent.py").write_text(textwrap.dedent(AGENT))
    processes = AgentProcesses(f"{tmp_path / 'agent.py'}:agent", "worker.rollout.agent", 1)
    processes.start()
    try:
        kind, value, _ = processes.run({"prompt": "p"}, {"base_url": "http://127.0.0.1:1/v1", "api_key": "k"}, 60)
    finally:
        processes.close()
    assert not mark.exists(), "an agent's return value ran code in the rollout worker"
    assert kind == "raised" and "the agent returned a value that cannot be sent back" in value, (kind, value)
