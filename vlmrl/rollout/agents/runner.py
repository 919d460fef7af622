"""Runs a user's agent, written in any framework, once per rollout against the agent endpoint (issue 19).

``worker.rollout.agent=my_agent.py:solve`` names a function ``solve(task, llm)``:

* ``task`` is a dict of the row's fields (``prompt``, ``ground_truth``,
  ``data_source`` and its other columns) and ``"images"``, the row's images as
  PIL images;
* ``llm`` is an ``AgentLLM``: the ``base_url``, ``api_key`` and ``model`` of an
  OpenAI-compatible server for this rollout alone (``vlmrl.rollout.endpoint``).
  Every call the agent makes with them is recorded, token ids and log-probs,
  against this rollout;
* it returns the rollout's reward (a float), or None for the reward function
  to score the final answer, which is the last call's response.

An agent imports nothing from vlmrl. For example (``tests/test_agent_runner.py``
runs this one on the tiny model)::

    import openai

    def solve(task, llm):
        client = openai.OpenAI(base_url=llm.base_url, api_key=llm.api_key)
        reply = client.chat.completions.create(
            model=llm.model, messages=[{"role": "user", "content": task["prompt"]}], max_tokens=16
        )
        return float(reply.choices[0].message.content.strip() == task["ground_truth"])

How it runs:

* ``async def`` agents run concurrently in one event loop on a thread of the
  runner, at most ``max_concurrency`` at a time, each cancelled at its
  timeout. They share the runner's process, so they get no crash isolation:
  one that blocks the loop (``time.sleep``, heavy computing) holds up the
  others and escapes its timeout. Use them for agents that wait on I/O.
  Tasks an agent leaves running are cancelled when the runner closes.
* Sync agents run in ``max_concurrency`` worker processes started fresh
  (never forked from a parent that holds vLLM's threads), one rollout at a
  time each. A process that passes the timeout is killed with what it
  started, one that crashes is reported with how it ended, and either is
  replaced; the other rollouts go on.

Each rollout is opened on the endpoint before its agent starts and closed as
soon as it ends, so a late call (a thread the agent left behind) is refused
and recorded nowhere. A rollout ends ``ok``; ``raised`` (the traceback is kept,
with the rollout's key masked; also for a return value that is not a
finite number or None); ``timeout``; ``died`` (a sync agent's
process crashed); or ``no_call`` (it returned without calling the model, so
there is nothing to train on). Only ``ok`` rollouts train; the counts say how
many of each.

Hooks by path, ``on_enqueue``, ``on_succeeded`` and ``on_failed``, get the
rollout's ``RolloutRecord`` (frozen). A hook that raises or passes the
timeout is logged and counted, never fatal. Hooks run in the runner's
process: sync ones on a thread, ``async def`` ones in the loop.
"""

from __future__ import annotations

import asyncio
import enum
import inspect
import logging
import math
import numbers
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from vlmrl.rollout.agents.child import KEY, AgentLLM, check_agent, describe
from vlmrl.rollout.agents.pool import AgentProcesses
from vlmrl.rollout.agents.traces import Call
from vlmrl.user_code import UserCodeError, load_object

if TYPE_CHECKING:  # the endpoint's module imports aiohttp: the config check imports this one
    from vlmrl.rollout.endpoint.server import AgentEndpoint

__all__ = [
    "AgentLLM",
    "AgentRun",
    "AgentRunner",
    "AgentStatus",
    "AgentTask",
    "LoadedAgent",
    "RolloutHooks",
    "RolloutRecord",
    "load_agent",
    "load_hooks",
]

log = logging.getLogger(__name__)

HOOK_KEY = "worker.rollout.agent_hooks"
HOOKS = ("on_enqueue", "on_succeeded", "on_failed")


class AgentStatus(str, enum.Enum):
    ok = "ok"
    raised = "raised"
    timeout = "timeout"
    died = "died"
    """A sync agent's process crashed (``os._exit``, a signal) mid-rollout."""
    no_call = "no_call"
    """The agent returned without calling the model."""


@dataclass(frozen=True)
class LoadedAgent:
    spec: str
    fn: Callable
    is_async: bool
    key: str = KEY


def load_agent(spec: str, key: str = KEY) -> LoadedAgent:
    """The agent ``spec`` names, its signature checked; UserCodeError naming the file and the function."""
    fn = load_object(spec, key)
    return LoadedAgent(spec, fn, check_agent(fn, spec, key), key)


@dataclass(frozen=True)
class RolloutHooks:
    on_enqueue: Callable | None = None
    """Called when the rollout is queued, before its agent starts (the record has no status yet)."""
    on_succeeded: Callable | None = None
    """Called after an ``ok`` rollout."""
    on_failed: Callable | None = None
    """Called after any other."""


def load_hooks(specs: dict[str, str | None], key: str = HOOK_KEY) -> RolloutHooks:
    """Hooks by path, e.g. ``{"on_failed": "hooks.py:alert"}``; each must take one argument, the record."""
    unknown = set(specs) - set(HOOKS)
    if unknown:
        raise UserCodeError(f"{key}: unknown hooks {sorted(unknown)}; the hooks are {', '.join(HOOKS)}")
    hooks = {}
    for name, spec in specs.items():
        if not spec:
            continue
        fn = load_object(spec, f"{key}.{name}")
        try:
            inspect.signature(fn).bind(object())
        except (TypeError, ValueError) as e:
            raise UserCodeError(
                f"{key}.{name}={spec}: a hook is called as hook(record) with the rollout's RolloutRecord; "
                f"{spec.rsplit(':', 1)[1]} cannot be ({e})"
            ) from e
        hooks[name] = fn
    return RolloutHooks(**hooks)


@dataclass(frozen=True)
class AgentTask:
    """One rollout to run: its id on the endpoint (unique per run), the row's fields and its images."""

    rollout_id: str
    fields: dict[str, Any]
    images: list[Any] = field(default_factory=list)
    seed: int | None = None
    """Seeds the rollout's calls that give no seed (``AgentEndpoint.open_rollout``); None: unseeded."""
    temperature: float = 1.0
    """The temperature of the rollout's calls that give none."""

    def as_argument(self) -> dict[str, Any]:
        """The ``task`` the agent gets."""
        return {**self.fields, "images": list(self.images)}


@dataclass(frozen=True)
class RolloutRecord:
    rollout_id: str
    task: AgentTask
    status: AgentStatus | None = None
    """None until the agent has run (as ``on_enqueue`` sees it)."""
    reward: float | None = None
    """What the agent returned; None when the reward function is to score ``answer``."""
    calls: tuple[Call, ...] = ()
    """The calls the endpoint recorded for the rollout, in index order (also for failed rollouts)."""
    answer: str | None = None
    """The last call's response decoded, when the runner has a ``decode`` and the agent returned no reward."""
    error: str | None = None
    seconds: float = 0.0
    """How long the agent ran."""

    @property
    def last_call(self) -> Call | None:
        return self.calls[-1] if self.calls else None


@dataclass
class AgentRun:
    rollouts: list[RolloutRecord]
    """One per task, in the tasks' order."""
    hook_errors: Counter = field(default_factory=Counter)
    """Hook name -> hooks that raised or timed out in this run."""
    seconds: float = 0.0

    def counts(self) -> dict[str, int]:
        """Rollouts per status (every status, zeros included)."""
        found = Counter(r.status for r in self.rollouts)
        return {s.value: found[s] for s in AgentStatus}


class AgentRunner:
    """Runs ``agent`` once per ``AgentTask`` against ``endpoint`` (which must be started)."""

    def __init__(
        self,
        agent: LoadedAgent,
        endpoint: AgentEndpoint,
        *,
        max_concurrency: int,
        timeout: float | None,
        hooks: RolloutHooks = RolloutHooks(),
        decode: Callable[[Sequence[int]], str] | None = None,
    ):
        """``max_concurrency``: agents running at once (for a sync agent, its processes). ``timeout``: seconds
        per rollout, and per hook call; None for none. ``decode`` turns response ids into ``answer``."""
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency={max_concurrency}: at least 1")
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout={timeout}: a positive number of seconds, or None")
        self.agent, self.endpoint, self.hooks, self.decode = agent, endpoint, hooks, decode
        self.max_concurrency, self.timeout = max_concurrency, timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._threads: ThreadPoolExecutor | None = None
        self._hook_threads: ThreadPoolExecutor | None = None
        self._processes: AgentProcesses | None = None

    def start(self) -> AgentRunner:
        """Start the event loop and, for a sync agent, its processes (raises if one cannot load the agent)."""
        if self._loop is not None:
            raise RuntimeError("the agent runner was started already")
        self._threads = ThreadPoolExecutor(self.max_concurrency, thread_name_prefix="vlmrl-agent")
        self._loop = asyncio.new_event_loop()
        self._loop.set_default_executor(self._threads)
        # Hooks have threads of their own: hooks that hang can use these up, never the rollouts' ones.
        self._hook_threads = ThreadPoolExecutor(4, thread_name_prefix="vlmrl-agent-hook")
        self._thread = threading.Thread(target=self._loop.run_forever, name="vlmrl-agent-loop", daemon=True)
        self._thread.start()
        if not self.agent.is_async:
            self._processes = AgentProcesses(self.agent.spec, self.agent.key, self.max_concurrency)
            try:
                self._processes.start()
            except BaseException:
                self.close()
                raise
        return self

    def close(self) -> None:
        if self._processes is not None:
            self._processes.close()
        if self._loop is not None and self._thread is not None:
            if self._thread.is_alive():  # what agents left behind (a task still to call, say) is cancelled
                asyncio.run_coroutine_threadsafe(_cancel_leftovers(), self._loop).result(30)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(30)
            self._loop.close()
        for pool in (self._threads, self._hook_threads):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
        self._loop = self._thread = self._threads = self._hook_threads = self._processes = None

    def __enter__(self) -> AgentRunner:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def run(self, tasks: Sequence[AgentTask]) -> AgentRun:
        """Run every task's rollout (concurrently, up to ``max_concurrency``); one record per task, in order."""
        if self._loop is None:
            raise RuntimeError("the agent runner is not started")
        ids = [t.rollout_id for t in tasks]
        if len(set(ids)) != len(ids):
            raise ValueError("the tasks' rollout ids must be unique")
        return asyncio.run_coroutine_threadsafe(self._run(list(tasks)), self._loop).result()

    # ------------------------------------------------------------ in the loop

    async def _run(self, tasks: list[AgentTask]) -> AgentRun:
        start = time.perf_counter()
        run = AgentRun(rollouts=[])
        slots = asyncio.Semaphore(self.max_concurrency)
        records = [RolloutRecord(t.rollout_id, t) for t in tasks]
        await asyncio.gather(*(self._hook("on_enqueue", r, run) for r in records))
        run.rollouts = list(await asyncio.gather(*(self._rollout(r, slots, run) for r in records)))
        run.seconds = time.perf_counter() - start
        return run

    async def _rollout(self, record: RolloutRecord, slots: asyncio.Semaphore, run: AgentRun) -> RolloutRecord:
        async with slots:
            endpoint, rollout_id = self.endpoint, record.rollout_id
            key = endpoint.open_rollout(rollout_id, record.task.seed, record.task.temperature)
            llm = AgentLLM(endpoint.base_url, key, endpoint.model_name)
            try:
                status, value, seconds = await self._call_agent(record.task, llm)
            finally:
                calls = tuple(endpoint.close_rollout(rollout_id))
        reward = error = None
        if status is AgentStatus.ok:
            reward, error = _as_reward(value)
            if error is not None:
                status = AgentStatus.raised
            elif not calls:
                status, reward = AgentStatus.no_call, None
                error = "the agent returned without calling the model, so the rollout has nothing to train on"
        else:
            error = value
        if error is not None:
            # The agent may have printed its key: its token and its secret are masked wherever they appear.
            for secret in llm.api_key.split(":", 1)[0].split("."):
                error = error.replace(secret, "<token>")
        answer = None
        if status is AgentStatus.ok and reward is None and self.decode is not None:
            answer = self.decode(calls[-1].response_ids)
        record = replace(record, status=status, reward=reward, calls=calls, answer=answer, error=error, seconds=seconds)
        await self._hook("on_succeeded" if status is AgentStatus.ok else "on_failed", record, run)
        return record

    async def _call_agent(self, task: AgentTask, llm: AgentLLM) -> tuple[AgentStatus, Any, float]:
        """The agent's outcome on ``task``: a status, the returned value or the error text, the seconds it ran."""
        if not self.agent.is_async:
            fields = {"base_url": llm.base_url, "api_key": llm.api_key, "model": llm.model}
            kind, value, seconds = await asyncio.get_running_loop().run_in_executor(
                None, self._processes.run, task.as_argument(), fields, self.timeout
            )
            if kind == "timeout":
                value = f"the agent did not return within {self.timeout} s; its process was killed"
            return AgentStatus(kind), value, seconds
        start = time.perf_counter()
        try:
            value = await asyncio.wait_for(self.agent.fn(task.as_argument(), llm), self.timeout)
        except asyncio.TimeoutError:
            message = f"the agent did not return within {self.timeout} s; it was cancelled"
            return AgentStatus.timeout, message, time.perf_counter() - start
        except Exception as e:
            return AgentStatus.raised, describe(e), time.perf_counter() - start
        return AgentStatus.ok, value, time.perf_counter() - start

    async def _hook(self, name: str, record: RolloutRecord, run: AgentRun) -> None:
        hook = getattr(self.hooks, name)
        if hook is None:
            return
        try:
            if inspect.iscoroutinefunction(hook):
                await asyncio.wait_for(hook(record), self.timeout)
            else:
                on_thread = asyncio.get_running_loop().run_in_executor(self._hook_threads, hook, record)
                await asyncio.wait_for(on_thread, self.timeout)
        except asyncio.TimeoutError:
            run.hook_errors[name] += 1
            log.warning("hook %s did not return within %s s for rollout %s", name, self.timeout, record.rollout_id)
        except Exception as e:
            run.hook_errors[name] += 1
            log.warning("hook %s raised for rollout %s (training goes on): %s", name, record.rollout_id, describe(e))


async def _cancel_leftovers() -> None:
    leftovers = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in leftovers:
        task.cancel()
    if leftovers:
        await asyncio.wait(leftovers, timeout=10)


def _as_reward(value: Any) -> tuple[float | None, str | None]:
    """The agent's return value as a reward, or the error saying why it is not one."""
    if value is None:
        return None, None
    if not isinstance(value, numbers.Real):  # bools, numpy and Python numbers
        return None, f"the agent returned {type(value).__name__} {value!r:.200}; return the reward (a float) or None"
    reward = float(value)
    if not math.isfinite(reward):
        return None, f"the agent returned the reward {reward}; a reward must be finite"
    return reward, None
