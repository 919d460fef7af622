"""The agent runner on the real in-process vLLM (tiny model) behind the real agent endpoint.

The agents are small files in ``tests/fixtures/agents/``, written with the official ``openai`` package.

- Loading: a function that cannot be called as ``solve(task, llm)``, something that is not a function, and a
  hook that cannot take the record are refused at load time with the file and the function named.
- An async agent and a sync one (in worker processes) each make two calls per rollout, the image in the first:
  each rollout's record holds its own two calls, as the endpoint recorded them; the async agent leaves the
  reward to the reward function (``answer`` is its final reply), the sync one returns it.
- Nothing but the endpoint listens: neither the runner nor its agent processes open a port.
- The module docstring's example agent runs as written.
- Outcomes: an agent that raises (traceback kept, the endpoint's token masked), one that returns text where a
  reward belongs, one that makes no call, a sync agent that hangs past the 3 s timeout (its process killed) and
  an async one (cancelled), a sync agent whose process exits mid-rollout (replaced: the next rollout runs in a
  fresh process). The calls they made before are still returned; the counts say each.
- Concurrency: 8 async agents that each wait 0.5 s, at most 4 at once, run 4 at once and take far less than
  the 4 s they would one after the other.
- A call an agent makes after its rollout ended is refused (410) and recorded nowhere.
- Hooks: ``on_enqueue`` sees every rollout before it runs, ``on_failed`` the failed ones; a hook that raises
  is counted and the rollouts it was called for are still ok.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import openai
import psutil
import pytest
import torch
from PIL import Image
from transformers import AutoProcessor

from vlmrl.rollout.agents import runner as agent_runner
from vlmrl.rollout.agents.runner import (
    AgentLLM,
    AgentRunner,
    AgentStatus,
    AgentTask,
    load_agent,
    load_hooks,
)
from vlmrl.user_code import UserCodeError, load_object

AGENTS = Path(__file__).parent / "fixtures" / "agents"
from helpers import agent_endpoint  # noqa: E402
MAX_MODEL_LEN, MAX_TOKENS = 512, 64


def spec(name: str) -> str:
    return f"{AGENTS / name.split(':')[0]}.py:{name.split(':')[1]}"


@pytest.fixture(scope="module")
def processor(tiny_assets):
    return AutoProcessor.from_pretrained(tiny_assets.model_dir)


@pytest.fixture(scope="module")
def endpoint(tiny_assets, processor):
    with agent_endpoint.tiny_engine(tiny_assets.model_dir, processor, MAX_MODEL_LEN) as engine:
        with agent_endpoint.new_endpoint(engine, processor, MAX_MODEL_LEN, MAX_TOKENS).start() as started:
            yield started


@pytest.fixture
def decode(processor):
    return lambda ids: processor.tokenizer.decode(ids, skip_special_tokens=True)


def _image(seed: int) -> Image.Image:
    g = torch.Generator().manual_seed(seed)
    return Image.fromarray(torch.randint(0, 256, (70, 90, 3), generator=g, dtype=torch.uint8).numpy(), "RGB")


def _tasks(prefix: str, n: int, images: bool = True) -> list[AgentTask]:
    return [
        AgentTask(
            rollout_id=f"{prefix}-{i}",
            fields={"prompt": f"Task {prefix} {i}: which colour? One word.", "ground_truth": "red", "data_source": "x"},
            images=[_image(i)] if images else [],
        )
        for i in range(n)
    ]


def _run(endpoint, name: str, tasks, *, timeout: float = 120, max_concurrency: int = 4, **kwargs):
    agent = load_agent(spec(name))
    with AgentRunner(agent, endpoint, max_concurrency=max_concurrency, timeout=timeout, **kwargs).start() as runner:
        return runner.run(tasks)


def _assert_two_calls_with_the_image_first(record, processor):
    pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    calls = record.calls
    assert [c.index for c in calls] == [0, 1] and all(c.rollout_id == record.rollout_id for c in calls)
    assert len(calls[0].images) == 1 and pad in calls[0].prompt_ids  # the row's image, expanded to its patches
    first = processor.tokenizer.decode(calls[0].prompt_ids)
    assert record.task.fields["prompt"] in first  # this rollout's own row
    assert list(calls[1].prompt_ids[: len(calls[0].prompt_ids)]) == list(calls[0].prompt_ids)  # the second goes on
    assert all(len(c.log_probs) == len(c.response_ids) > 0 for c in calls)


# ---------------------------------------------------------------------------------------------------- loading


def test_what_cannot_be_an_agent_or_a_hook_is_refused_at_load_time_by_name():
    file = AGENTS / "bad_signatures.py"
    for name, says in [
        ("one_argument", "one_argument(task)"),
        ("three_arguments", "three_arguments(task, llm, extra)"),
        ("NOT_A_FUNCTION", "not a function"),
    ]:
        with pytest.raises(UserCodeError) as e:
            load_agent(f"{file}:{name}")
        message = str(e.value)
        assert "worker.rollout.agent" in message and str(file) in message and name in message and says in message
    with pytest.raises(UserCodeError, match="does not exist"):
        load_agent(f"{AGENTS}/missing.py:solve")
    with pytest.raises(UserCodeError, match=r"on_failed=.*no_arguments.*hook\(record\)"):
        load_hooks({"on_failed": f"{file}:no_arguments"})
    with pytest.raises(UserCodeError, match="on_finish"):
        load_hooks({"on_finish": f"{file}:one_argument"})
    assert load_agent(spec("look_and_answer:solve")).is_async and not load_agent(spec("hanging:solve")).is_async
    assert "api_key" not in repr(AgentLLM("http://127.0.0.1:1/v1", "secret:r"))  # the key is never printed


# ---------------------------------------------------------------------------------------------------- agents


def test_an_async_openai_agent_makes_two_calls_per_rollout_and_leaves_the_reward(endpoint, processor, decode):
    tasks = _tasks("async", 3)
    run = _run(endpoint, "look_and_answer:solve", tasks, decode=decode)
    final = load_object(spec("look_and_answer:FINAL"), "test")
    assert [r.rollout_id for r in run.rollouts] == [t.rollout_id for t in tasks]
    for record in run.rollouts:
        assert record.status is AgentStatus.ok and record.error is None and record.reward is None, record.error
        _assert_two_calls_with_the_image_first(record, processor)
        assert record.answer == final[record.task.fields["prompt"]] == decode(record.last_call.response_ids)
        assert record.seconds > 0
    assert run.counts() == {"ok": 3, "raised": 0, "timeout": 0, "died": 0, "no_call": 0}


def test_a_sync_openai_agent_runs_in_worker_processes_and_returns_the_reward(endpoint, processor, decode):
    before = _listening()
    assert ("127.0.0.1", endpoint.port) in before
    agent = load_agent(spec("look_and_answer:solve_sync"))
    with AgentRunner(agent, endpoint, max_concurrency=2, timeout=120).start() as runner:
        assert len(psutil.Process().children()) >= 2  # its processes, started fresh
        run = runner.run(_tasks("sync", 3))
        assert _listening() == before  # neither the runner nor its processes listen: the endpoint alone does
    for record in run.rollouts:
        assert record.status is AgentStatus.ok, record.error
        _assert_two_calls_with_the_image_first(record, processor)
        assert record.reward == float("red" in decode(record.last_call.response_ids))
        assert record.answer is None


def _listening() -> set[tuple[str, int]]:
    """The addresses this process and its children listen on."""
    processes = [psutil.Process(), *psutil.Process().children(recursive=True)]
    return {
        (c.laddr.ip, c.laddr.port)
        for p in processes
        for c in p.net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN
    }


def test_the_docstring_example_runs(endpoint, tmp_path):
    code = re.search(r"::\n\n(.*?)\n\n(?=\S)", agent_runner.__doc__, re.S).group(1)
    (tmp_path / "example_agent.py").write_text(code.replace("\n    ", "\n").strip() + "\n")
    task = AgentTask("doc-0", {"prompt": "Say red.", "ground_truth": "red"})
    with AgentRunner(load_agent(f"{tmp_path}/example_agent.py:solve"), endpoint, max_concurrency=1, timeout=120) as r:
        [record] = r.start().run([task]).rollouts
    assert record.status is AgentStatus.ok and record.reward in (0.0, 1.0) and len(record.calls) == 1, record.error


# ---------------------------------------------------------------------------------------------------- outcomes


def test_raising_and_callless_agents_are_counted_and_on_failed_sees_them(endpoint):
    from_hooks = load_object(spec("hooks:SEEN"), "test")
    from_hooks.clear()
    hooks = load_hooks({"on_enqueue": spec("hooks:on_enqueue"), "on_failed": spec("hooks:on_failed")})
    raised = _run(endpoint, "raising:solve", _tasks("raise", 2, images=False), hooks=hooks)
    for record in raised.rollouts:
        token = endpoint.api_key(record.rollout_id).split(":")[0]  # the endpoint's token and the rollout's secret
        assert record.status is AgentStatus.raised and record.reward is None
        assert len(record.calls) == 1  # what it did before raising is still returned
        assert record.error.startswith("ValueError: this agent gave up") and "raising.py" in record.error
        assert token not in record.error and "<token>" in record.error  # the key it printed is masked
    assert raised.counts()["raised"] == 2
    assert sorted(from_hooks) == sorted(
        [("enqueue", f"raise-{i}", None) for i in range(2)] + [("failed", f"raise-{i}", "raised") for i in range(2)]
    )
    [record] = _run(endpoint, "no_call:solve", _tasks("quiet", 1)).rollouts
    assert record.status is AgentStatus.no_call and record.calls == () and record.reward is None
    assert "without calling the model" in record.error
    [record] = _run(endpoint, "raising:returns_text", _tasks("text", 1, images=False)).rollouts
    assert record.status is AgentStatus.raised and len(record.calls) == 1
    assert record.error == "the agent returned str 'red'; return the reward (a float) or None"


def test_an_agent_that_hangs_is_stopped_at_its_timeout(endpoint):
    start = time.monotonic()
    run = _run(endpoint, "hanging:solve", _tasks("hang", 1, images=False), timeout=3, max_concurrency=1)
    [record] = run.rollouts
    assert record.status is AgentStatus.timeout and "3" in record.error and len(record.calls) == 1
    assert 3 <= record.seconds < 10 and time.monotonic() - start < 60
    assert run.counts()["timeout"] == 1
    [record] = _run(endpoint, "hanging:solve_async", _tasks("hang-async", 1, images=False), timeout=1).rollouts
    assert record.status is AgentStatus.timeout and "cancelled" in record.error and len(record.calls) == 1


def test_a_sync_agent_whose_process_dies_is_replaced(endpoint):
    # One process, two rollouts: the second runs in the process that replaced the first.
    run = _run(endpoint, "crashing:solve", _tasks("crash", 2, images=False), max_concurrency=1)
    for record in run.rollouts:
        assert record.status is AgentStatus.died and record.error == "the agent process exited with code 3"
        assert len(record.calls) == 1
    assert run.counts()["died"] == 2


# ---------------------------------------------------------------------------------------------------- concurrency


def test_async_agents_run_concurrently_up_to_the_bound(endpoint):
    sleepy = load_object(spec("sleepy:solve"), "test").__globals__
    sleepy["PEAK"] = 0
    run = _run(endpoint, "sleepy:solve", _tasks("sleepy", 8, images=False), max_concurrency=4)
    assert run.counts()["ok"] == 8 and all(r.reward == 0.5 for r in run.rollouts)
    assert sleepy["PEAK"] == 4  # the bound holds, and is reached
    # One after the other, they would take 8 x 0.5 s = 4 s before any call; 4 at once, about a quarter of the
    # time they took together.
    assert run.seconds < 3.5 and run.seconds < sum(r.seconds for r in run.rollouts) / 2, run.seconds


def test_a_call_after_the_rollout_ended_is_refused(endpoint):
    late = load_object(spec("late:LATE"), "test")
    late.clear()
    with AgentRunner(load_agent(spec("late:solve")), endpoint, max_concurrency=1, timeout=60).start() as runner:
        [record] = runner.run(_tasks("late", 1, images=False)).rollouts
        assert record.status is AgentStatus.ok and len(record.calls) == 1
        deadline = time.monotonic() + 30
        while not late and time.monotonic() < deadline:  # the call it left behind, made from the runner's loop
            time.sleep(0.05)
    assert len(late) == 1 and isinstance(late[0], openai.APIStatusError), late
    assert late[0].status_code == 410 and "late-0" in str(late[0])


# ---------------------------------------------------------------------------------------------------- hooks


def test_a_hook_that_raises_is_counted_and_does_not_stop_the_rollouts(endpoint, caplog):
    hooks = load_hooks({"on_succeeded": spec("hooks:on_succeeded")})
    with caplog.at_level("WARNING", logger="vlmrl.rollout.agents.runner"):
        run = _run(endpoint, "sleepy:solve", _tasks("hooked", 2, images=False), hooks=hooks)
    assert run.counts()["ok"] == 2 and run.hook_errors == {"on_succeeded": 2}
    failures = sorted(m for m in caplog.messages if "raised for rollout" in m)
    assert len(failures) == 2
    for i, message in enumerate(failures):  # with the hook's traceback
        assert message.startswith(f"hook on_succeeded raised for rollout hooked-{i} (training goes on): RuntimeError")
        assert "hooks.py" in message
