"""What runs the user's agent: its documented signature, its check, and the process a sync agent runs in.

Kept apart from ``runner`` so that an agent process imports only this
module, ``vlmrl.user_code`` and the user's own module: no torch, vLLM or
aiohttp. A process is ``python -m vlmrl.rollout.agents.child READ_FD
WRITE_FD`` (``subprocess``, not ``multiprocessing``: it neither re-imports
the parent's ``__main__`` as spawn would nor inherits the parent's vLLM
threads as fork would). It loads the agent itself, so no function is pickled.
The protocol, over two pipes (stdout and stderr stay the user's):

* parent -> child, pickled (the child trusts its parent): ``{"sys_path", "spec", "key"}`` once, then
  ``(task, llm fields)`` per rollout;
* child -> parent, as data (``vlmrl.user_process.send_data``: JSON, so that nothing the agent returns
  is unpickled, and run, in the rollout worker): ``["ready"]`` or ``["failed", message]`` once, then
  ``["ok", value]`` or ``["raised", traceback text]`` per rollout.

One rollout at a time per process, so a hang or a crash is charged to the one
rollout the process was running.
"""

from __future__ import annotations

import inspect
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from vlmrl.user_code import UserCodeError, load_object
from vlmrl.user_process import MARKER, NotData, become_subreaper, kill_tree, send_data

KEY = "worker.rollout.agent"


@dataclass(frozen=True)
class AgentLLM:
    """How an agent reaches the policy: an OpenAI-compatible server for this rollout alone.

    Give ``base_url`` and ``api_key`` to any OpenAI-compatible client; every call
    made with them is recorded against this rollout and trained on. ``model`` is
    the endpoint's model name (any name is accepted).
    """

    base_url: str
    api_key: str = field(repr=False)
    """This rollout's own key (the endpoint's token and the rollout's secret): never print or log it."""
    model: str = "vlmrl"

    def emit_reward(self, reward: float, call: int | None = None, timeout: float = 30.0) -> None:
        """Report a reward for one of this rollout's calls before the rollout ends (default: its latest call):
        it is added on that call's last response token, as a tool's turn reward is. Rewards for one call add up.
        Blocking (a small HTTP POST to ``base_url/rewards``); from an ``async def`` agent use
        ``await asyncio.to_thread(llm.emit_reward, r)``. Raises ``RuntimeError`` with the endpoint's message
        when it refuses the reward."""
        import json
        import urllib.error
        import urllib.request

        body = json.dumps({"reward": reward, **({} if call is None else {"call": call})}).encode()
        request = urllib.request.Request(
            self.base_url.rstrip("/") + "/rewards", data=body, method="POST",
            headers={"Authorization": f"Bearer {self.api_key}", "Content-Type": "application/json"},
        )  # fmt: skip
        try:
            # No proxy: the endpoint is on this machine, and a proxy from the environment would not reach it.
            with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(request, timeout=timeout) as response:
                response.read()
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"the endpoint refused the reward ({e.code}): {e.read().decode(errors='replace')}") from None


def check_agent(fn: Any, spec: str, key: str = KEY) -> bool:
    """Raise UserCodeError naming ``spec`` unless ``fn`` can be called as ``fn(task, llm)``; True if it is
    ``async def``."""
    location, name = spec.rsplit(":", 1)
    where = f"{key}={spec}: {name} in {location}"
    if not callable(fn) or inspect.isclass(fn):
        raise UserCodeError(f"{where} is a {type(fn).__name__}, not a function; define def {name}(task, llm): ...")
    if inspect.isasyncgenfunction(fn) or inspect.isgeneratorfunction(fn):
        raise UserCodeError(f"{where} is a generator; an agent returns its reward (a float) or None")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError) as e:
        raise UserCodeError(f"{where}: cannot read its signature ({e})") from e
    try:
        signature.bind(object(), object())
    except TypeError as e:
        raise UserCodeError(
            f"{where} has the signature {name}{signature}, which cannot be called as {name}(task, llm) ({e}); an "
            f"agent takes two positional arguments: the row's fields with its images, and an AgentLLM"
        ) from e
    return inspect.iscoroutinefunction(fn)


def describe(e: BaseException) -> str:
    """``Type: message``, then the traceback from the user's code down."""
    frames = "".join(traceback.format_exception(type(e), e, e.__traceback__.tb_next if e.__traceback__ else None))
    return f"{type(e).__name__}: {e}\n{frames.rstrip()}"


# ----------------------------------------------------------------------------- child side


def exit_with_parent() -> None:
    """End this process (and what the agent started: it leads its own process group) when its parent is gone.

    Polled rather than PR_SET_PDEATHSIG, which follows the parent *thread*.
    """
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(1.0)
        try:
            kill_tree(os.getpid(), os.environ.get(MARKER), spare={os.getpid()})  # setsid ones too
            os.killpg(os.getpgid(0), signal.SIGKILL)
        finally:
            os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def serve(read_fd: int, write_fd: int) -> None:
    inbox, outbox = Connection(read_fd, writable=False), Connection(write_fd, readable=False)
    become_subreaper()  # what the agent starts stays in this tree, setsid or double fork
    exit_with_parent()
    init = inbox.recv()
    # The parent's import path, and its working directory as `python -m` would add it.
    sys.path[:] = init["sys_path"] + ([os.getcwd()] if os.getcwd() not in init["sys_path"] else [])
    try:
        fn = load_object(init["spec"], init["key"])
        if check_agent(fn, init["spec"], init["key"]):
            raise UserCodeError(f"{init['key']}={init['spec']} is async def; it runs in the runner's event loop")
    except UserCodeError as e:
        send_data(outbox, ["failed", str(e)])
        return
    send_data(outbox, ["ready"])
    try:
        _serve_rollouts(fn, inbox, outbox)
    except (EOFError, BrokenPipeError):  # the parent closed the pipes or is gone
        return


def _serve_rollouts(fn: Callable, inbox: Connection, outbox: Connection) -> None:
    while True:
        task, llm = inbox.recv()
        try:
            value = fn(task, AgentLLM(**llm))
        except BaseException as e:  # sys.exit() in the agent is a failed rollout too
            send_data(outbox, ["raised", describe(e)])
            continue
        try:
            send_data(outbox, ["ok", value])
        except NotData as e:  # found before anything was written
            send_data(outbox, ["raised", f"the agent returned a value that cannot be sent back: {e}; an agent "
                                         "returns its reward (a number) or None, never an object"])


if __name__ == "__main__":
    serve(int(sys.argv[1]), int(sys.argv[2]))
