"""Reward processes: the user's reward function runs in child processes that can be killed.

A per-call timeout needs something that can be stopped from outside: a thread
cannot be, and ``signal.alarm`` does not interrupt C code. A crash in user code
(``os._exit``, a segfault in a C extension) then ends only its process; the
manager reports it, and a fresh process takes that one's place for the next call.

Each child is ``python -m vlmrl.reward.sandbox READ_FD WRITE_FD``, started with
``subprocess`` rather than ``multiprocessing`` so that it neither re-imports
the Ray worker's ``__main__`` (as spawn would) nor inherits its threads (as
fork would). It loads the function itself, so no function is ever pickled, and
imports nothing heavy besides the user's module. The protocol, over two pipes
(the child's stdout and stderr stay free for the user's prints):

* parent -> child, pickled (the child trusts its parent): ``{"sys_path", "spec", "kwargs", ...}`` once,
  then lists of ``(call_id, payload)``;
* child -> parent, as data (``vlmrl.user_process.send_data``: JSON, so that nothing the user's code
  returns is unpickled, and run, in the manager): ``["ready"]`` or ``["failed", message]`` once, then
  one ``["ok", call_id, value]`` or ``["raised", call_id, message]`` per call, in order.
* With a reward model (``vlmrl.reward.model_client``), a call may also send
  ``["ask", call_id, method, args]`` and wait for the parent's ``("answer", value)``
  or ``("error", message)``; the parent answers from a thread through ``service``.

The limits hold for the whole tree of processes the user's code starts
(``vlmrl.user_process``): a child is a subreaper, so what its code starts stays
its descendant after ``setsid``; the tree's memory and process count are
checked while it works; a timeout, a death or a breach kills the whole tree; and
what a call leaves running is killed when the call returns. A child loads the
module from the run's directory, then serves calls in a scratch directory,
with a cut-down environment (``worker.reward.env``).

A child runs the calls of a list one after the other, so the call it is working
on is always the oldest one not yet answered: that is the one a deadline or a
death is charged to, and the rest of its list goes back to the queue.
"""

from __future__ import annotations

import enum
import math
import os
import resource
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

from vlmrl import user_process
from vlmrl.reward.function import RewardFunctionError, check_kwargs, load_reward_function
from vlmrl.reward.model_client import PARAMETER, RewardModelClient, make_ask

START_TIMEOUT_S = 120.0
"""How long a reward process may take to import the user's module and get ready."""

MAX_PROCESSES = 128
"""Processes one reward process's tree may hold (itself included); past it the call fails and the tree is killed."""

MAX_OPEN_FILES = 4096
"""RLIMIT_NOFILE of a reward process and of what it starts."""

POLL_S = 0.2
"""How often the tree of a working reward process is measured against the limits."""


class Status(enum.Enum):
    ok = "ok"
    raised = "raised"
    timed_out = "timed_out"
    died = "died"


@dataclass
class Outcome:
    """What one call gave: the returned value (ok) or a description (raised, died)."""

    status: Status
    value: Any = None


# ----------------------------------------------------------------------------- parent side


class _State(enum.Enum):
    starting = "starting"
    idle = "idle"
    busy = "busy"


_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])
"""The directory vlmrl is imported from: a child started elsewhere must find it too."""


def _environment(extra: dict[str, str], scratch: str, token: str) -> dict[str, str]:
    env = {"TMPDIR": scratch, **user_process.child_env(extra)}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"  # the user's prints show up even if the call is killed
    env[user_process.MARKER] = token  # every process of its tree carries it, setsid or not
    return env


class _Child:
    def __init__(self, init: dict, env: dict[str, str], scratch: str):
        child_read, parent_write = os.pipe()
        parent_read, child_write = os.pipe()
        self.token = secrets.token_hex(8)
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "vlmrl.reward.sandbox", str(child_read), str(child_write)],
            pass_fds=(child_read, child_write),
            stdin=subprocess.DEVNULL,
            cwd=scratch,
            env=_environment(env, scratch, self.token),
            start_new_session=True,  # its own process group and session, apart from the manager's
        )
        os.close(child_read)
        os.close(child_write)
        self.inbox = Connection(parent_read, writable=False)
        self.outbox = Connection(parent_write, readable=False)
        self.outbox.send(init)
        self.state = _State.starting
        self.deadline = time.monotonic() + START_TIMEOUT_S
        self.next_check = 0.0
        """When its tree is next measured against the limits."""
        self.pending: deque[int] = deque()
        """Call ids sent and not yet answered, oldest (the one running) first."""

    def dispatch(self, call_ids: list[int], payloads: list, timeout: float | None) -> None:
        self.outbox.send([(i, payloads[i]) for i in call_ids])
        self.pending.extend(call_ids)
        self.state = _State.busy
        self.deadline = time.monotonic() + (timeout if timeout is not None else math.inf)

    def exit_description(self) -> str:
        try:
            code = self.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            return "closed its pipe but is still running"
        if code < 0:
            return f"was killed by {signal.Signals(-code).name}"
        return f"exited with code {code}"

    def kill(self) -> None:
        """Kill it and every process of its tree: descendants (setsid or not) and whatever carries its marker."""
        user_process.kill_tree(self.popen.pid, self.token)
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.popen.wait()
        self.inbox.close()
        self.outbox.close()


class Sandbox:
    """``processes`` reward processes running ``spec``, each call limited to ``timeout`` seconds."""

    def __init__(
        self,
        spec: str,
        kwargs: dict[str, Any],
        processes: int,
        timeout: float | None,
        memory_limit_mb: int | None = None,
        reward_model_kind: str | None = None,
        service: Callable[[str, Any], Any] | None = None,
        env: dict[str, str] | None = None,
        max_processes: int = MAX_PROCESSES,
    ):
        self.spec, self.timeout, self.processes = spec, timeout, processes
        self.memory_limit_mb, self.max_processes = memory_limit_mb, max_processes
        self.env = dict(env or {})
        """The user's variables (worker.reward.env), on top of the allowlisted ones."""
        cwd = os.getcwd()
        self.init = {
            "cwd": cwd,  # where the module is loaded from; calls run in the scratch directory
            # The manager's import path, with its working directory as `python -m` would add it.
            "sys_path": [p or cwd for p in sys.path] + ([cwd] if cwd not in sys.path else []),
            "spec": spec,
            "kwargs": dict(kwargs),
            "memory_limit_mb": memory_limit_mb,
            "reward_model": reward_model_kind,
        }
        self.service = service
        """Answers a call's ``("ask", ...)`` (a reward model request): ``service(method, args) -> value``."""
        self.children: list[_Child] = []
        self._scratch: str | None = None

    def _spawn(self) -> _Child:
        if self._scratch is None:
            self._scratch = tempfile.mkdtemp(prefix="vlmrl-reward-")
        return _Child(self.init, self.env, self._scratch)

    def start(self) -> None:
        """Start the processes and wait until each has loaded the function; raise if one cannot."""
        while len(self.children) < self.processes:
            self.children.append(self._spawn())
        while any(c.state is _State.starting for c in self.children):
            self._wait_and_handle(None, None, None)

    def close(self) -> None:
        for child in self.children:
            child.kill()
        self.children = []
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # at interpreter exit; the processes end with their parent anyway
            pass

    def run(self, payloads: list, chunk_size: int, stop: Callable[[Outcome], bool]) -> list[Outcome | None]:
        """``fn(payload, **kwargs)`` for each payload, over the processes; one Outcome per payload.

        Returns early, with None for the calls not made, once ``stop(outcome)`` is true.
        Whatever happens, no process is left working on a call when this returns.
        """
        self.start()
        n = len(payloads)
        outcomes: list[Outcome | None] = [None] * n
        queue = deque(list(range(i, min(i + chunk_size, n))) for i in range(0, n, chunk_size))
        stopped = False
        try:
            while not stopped and (queue or any(c.pending for c in self.children)):
                for child in self.children:
                    if child.state is _State.idle and queue:
                        try:
                            child.dispatch(queue.popleft(), payloads, self.timeout)
                        except OSError as e:  # it died between calls (a thread of user code, say)
                            what = child.exit_description()
                            self._drop(child)
                            raise RewardFunctionError(f"a reward process for {self.spec} {what} between calls") from e
                stopped = self._wait_and_handle(outcomes, queue, stop)
        finally:
            self._reset_busy()
        assert stopped or all(o is not None for o in outcomes), "reward calls were lost"
        return outcomes

    def _wait_and_handle(self, outcomes, queue, stop) -> bool:
        """Wait for a message or the earliest deadline and handle what came; True when ``stop`` fired."""
        live = [c for c in self.children if c.state is not _State.idle]
        assert live, "waiting with no process starting or busy"
        timeout = min(POLL_S, max(0.0, min(c.deadline for c in live) - time.monotonic()))
        ready = wait([c.inbox for c in live], timeout=timeout)
        stopped = False
        for child in live:
            if child.inbox in ready:
                try:
                    message = user_process.recv_data(child.inbox)
                except (EOFError, OSError):
                    message = None
                except ValueError as e:  # not data: the user's code wrote to the pipe itself
                    message = ["garbled", f"sent the manager something that is not data ({e})"]
                stopped |= self._handle(child, message, outcomes, queue, stop)
            elif time.monotonic() >= child.deadline:
                stopped |= self._expire(child, outcomes, queue, stop)
            elif time.monotonic() >= child.next_check and (breach := self._breach(child)) is not None:
                stopped |= self._kill_for(child, breach, outcomes, queue, stop)
        return stopped

    def _breach(self, child: _Child) -> str | None:
        """How ``child``'s tree is over a limit, or None."""
        child.next_check = time.monotonic() + POLL_S
        used, count = user_process.tree_usage(child.popen.pid)
        if self.memory_limit_mb is not None and used > self.memory_limit_mb * 1024 * 1024:
            return (
                f"was killed with the {count} process(es) of its tree: together they held {used / 2**20:.0f} MB, "
                f"more than worker.reward.memory_limit_mb={self.memory_limit_mb} MB"
            )
        if count > self.max_processes:
            return f"was killed with the {count} processes of its tree: more than {self.max_processes} at once"
        return None

    def _kill_for(self, child: _Child, why: str, outcomes, queue, stop) -> bool:
        if child.state is _State.starting:
            self._drop(child)
            raise RewardFunctionError(f"a reward process for {self.spec} {why} while loading it")
        call_id = child.pending.popleft()
        outcomes[call_id] = Outcome(Status.died, f"the reward process {why}")
        self._replace(child, queue)
        return stop(outcomes[call_id])

    def _handle(self, child: _Child, message, outcomes, queue, stop) -> bool:
        kind = message[0] if isinstance(message, list) and message else None
        if child.state is _State.starting:
            if message == ["ready"]:
                child.state = _State.idle
                return False
            if kind == "failed" and len(message) == 2 and isinstance(message[1], str):
                self._drop(child)
                raise RewardFunctionError(message[1])
            what = child.exit_description() if message is None else f"{_garbled(message)}"
            self._drop(child)
            raise RewardFunctionError(f"a reward process for {self.spec} {what} while loading it")
        if kind == "ask" and len(message) == 4:  # the running call waits on the reward model
            _, _, method, args = message
            threading.Thread(target=self._answer, args=(child, method, args), daemon=True).start()
            return False
        valid = kind in ("ok", "raised") and len(message) == 3 and message[1] == child.pending[0]
        if message is None or not valid:  # died mid-call, or broke the protocol
            call_id = child.pending.popleft()
            what = child.exit_description() if message is None else _garbled(message)
            outcome = Outcome(Status.died, f"the reward process {what}")
            self._replace(child, queue)
        else:
            kind, call_id, value = message
            child.pending.popleft()
            outcome = Outcome(Status(kind), value)
            child.deadline = time.monotonic() + (self.timeout if self.timeout is not None else math.inf)
            if not child.pending:
                child.state = _State.idle
        outcomes[call_id] = outcome
        return stop(outcome)

    def _answer(self, child: _Child, method: str, args: Any) -> None:
        """Serve one ask in a thread, so that other processes' answers and deadlines are handled meanwhile."""
        try:
            if self.service is None:
                raise RuntimeError("no reward model is configured (worker.reward.reward_model.model_path)")
            reply = ("answer", self.service(method, args))
        except Exception as e:
            reply = ("error", str(e) or type(e).__name__)
        try:
            child.outbox.send(reply)
        except (OSError, ValueError):  # the call timed out meanwhile and its process was killed
            pass

    def _expire(self, child: _Child, outcomes, queue, stop) -> bool:
        if child.state is _State.starting:
            self._drop(child)
            raise RewardFunctionError(
                f"a reward process for {self.spec} did not finish loading it within {START_TIMEOUT_S:.0f} s"
            )
        call_id = child.pending.popleft()
        outcomes[call_id] = Outcome(Status.timed_out)
        self._replace(child, queue)
        return stop(outcomes[call_id])

    def _replace(self, child: _Child, queue) -> None:
        """Kill ``child``, put its unstarted calls back at the front of the queue, and start a fresh process."""
        if child.pending:
            queue.appendleft(list(child.pending))
        self._drop(child)
        self.children.append(self._spawn())

    def _drop(self, child: _Child) -> None:
        child.kill()
        self.children.remove(child)

    def _reset_busy(self) -> None:
        for child in [c for c in self.children if c.state is _State.busy]:
            child.pending.clear()
            self._replace(child, None)


def _garbled(message: Any) -> str:
    if isinstance(message, list) and len(message) == 2 and message[0] == "garbled":
        return str(message[1])
    return f"broke the protocol: it sent {str(message)[:200]}"


_LOAD_CHECKS: dict[tuple, str | None] = {}


def check_loads(
    spec: str,
    kwargs: dict[str, Any],
    memory_limit_mb: int | None,
    reward_model_kind: str | None = None,
    env: dict[str, str] | None = None,
) -> None:
    """Load ``spec`` and check ``kwargs`` against it in a reward process, as a run would; raise RewardFunctionError.

    Used at validation, so that a module that calls ``os._exit`` or crashes at import ends a child, not the
    driver. The answer is kept per process for the same spec, kwargs and file contents (validation runs often).
    """
    location = spec.rsplit(":", 1)[0]
    try:
        stamp = os.stat(location).st_mtime_ns if location.endswith(".py") else None
    except OSError:
        stamp = None
    key = (spec, repr(sorted(kwargs.items())), stamp, memory_limit_mb, reward_model_kind, tuple(sys.path), os.getcwd(),
           repr(sorted((env or {}).items())))  # fmt: skip
    if key not in _LOAD_CHECKS:
        sandbox = Sandbox(
            spec, kwargs, processes=1, timeout=None, memory_limit_mb=memory_limit_mb,
            reward_model_kind=reward_model_kind, env=env,
        )  # fmt: skip
        try:
            sandbox.start()
            _LOAD_CHECKS[key] = None
        except RewardFunctionError as e:
            _LOAD_CHECKS[key] = str(e)
        finally:
            sandbox.close()
    if _LOAD_CHECKS[key] is not None:
        raise RewardFunctionError(_LOAD_CHECKS[key])


# ----------------------------------------------------------------------------- child side


def _exit_with_parent() -> None:
    """End this process, and whatever user code started, when the manager that started it is gone, even mid-call.

    Polled rather than PR_SET_PDEATHSIG: that signal follows the parent *thread*,
    and the manager starts processes from whichever of its threads needs one.
    """
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(1.0)
        # Kill this process's tree and its process group, so that no process the user's code started
        # (setsid or not) outlives the manager either.
        try:
            user_process.kill_tree(os.getpid(), os.environ.get(user_process.MARKER), spare={os.getpid()})
            os.killpg(os.getpgid(0), signal.SIGKILL)
        finally:
            os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def _describe(e: BaseException) -> str:
    """``Type: message``, then the traceback from the user's code down."""
    frames = "".join(traceback.format_exception(type(e), e, e.__traceback__.tb_next if e.__traceback__ else None))
    return f"{type(e).__name__}: {e}\n{frames.rstrip()}"


def serve(read_fd: int, write_fd: int) -> None:
    inbox, outbox = Connection(read_fd, writable=False), Connection(write_fd, readable=False)
    user_process.become_subreaper()  # what the user's code starts stays in this tree, setsid or double fork
    _exit_with_parent()
    init = inbox.recv()
    limit_mb = init.get("memory_limit_mb")
    if limit_mb is not None:
        # Address space, before the user's module loads: a function that eats memory gets MemoryError
        # in its own call instead of the kernel's OOM killer picking the biggest process (a worker).
        # Per process; the manager bounds the tree's total.
        limit = limit_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    files = MAX_OPEN_FILES if hard == resource.RLIM_INFINITY else min(hard, MAX_OPEN_FILES)
    resource.setrlimit(resource.RLIMIT_NOFILE, (files, files))
    sys.path[:] = init["sys_path"]
    kwargs = dict(init["kwargs"])
    running = [-1]  # the call being served, for the reward model's asks
    scratch = os.getcwd()
    os.chdir(init["cwd"])  # a relative spec, and what the module reads as it loads, resolve as in the run
    try:
        fn, _ = load_reward_function(init["spec"])
        kwargs.update(_reward_model_kwargs(fn, init, make_ask(inbox, outbox, lambda: running[0])))
        check_kwargs(fn, init["spec"], kwargs)
    except RewardFunctionError as e:
        user_process.send_data(outbox, ["failed", str(e)])
        return
    finally:
        os.chdir(scratch)
    # Processes the module started as it loaded (a pool, say) live as long as this one; those a call starts do not.
    resident = set(user_process.tree(os.getpid())) - {os.getpid()}
    user_process.send_data(outbox, ["ready"])
    try:
        _serve_calls(fn, kwargs, inbox, outbox, limit_mb, running, resident)
    except (EOFError, BrokenPipeError):  # the manager closed the pipes or is gone
        return


def _reward_model_kwargs(fn: Callable, init: dict, ask: Callable) -> dict[str, Any]:
    """``{"reward_model": handle}`` when ``fn`` takes that parameter; an error when it needs one and none is set."""
    import inspect

    parameter = inspect.signature(fn).parameters.get(PARAMETER)
    kind = init.get("reward_model")
    if parameter is None:
        if kind is not None:
            raise RewardFunctionError(
                f"worker.reward.reward_model is set but reward function {init['spec']} has no {PARAMETER!r} "
                f"parameter, so the model would load and never be asked; add the parameter "
                f"(def fn(reward_input(s), {PARAMETER}): ...), or leave worker.reward.reward_function empty to "
                "reward with the model's score alone"
            )
        return {}
    if kind is None:
        if parameter.default is inspect.Parameter.empty:
            raise RewardFunctionError(
                f"reward function {init['spec']} takes a {PARAMETER!r} parameter but no reward model is configured; "
                f"set worker.reward.reward_model.model_path, or give the parameter a default (None)"
            )
        return {}
    return {PARAMETER: RewardModelClient(ask, kind)}


def _serve_calls(
    fn: Callable,
    kwargs: dict,
    inbox: Connection,
    outbox: Connection,
    limit_mb: int | None,
    running: list[int],
    resident: set[int],
) -> None:
    while True:
        calls = inbox.recv()
        for call_id, payload in calls:
            running[0] = call_id
            try:
                value = fn(payload, **kwargs)
            except BaseException as e:  # sys.exit() in user code is a failed call too
                message = _describe(e)
                if isinstance(e, MemoryError) and limit_mb is not None:
                    message = f"it needed more than worker.reward.memory_limit_mb={limit_mb} MB: {message}"
                value, kind = message, "raised"
            else:
                kind = "ok"
            _end_leftovers(resident)
            try:
                user_process.send_data(outbox, [kind, call_id, value])
            except user_process.NotData as e:  # found before anything was written
                message = (
                    f"it returned a value that cannot be sent back: {e}; a reward returns data (dicts, lists, "
                    "strings, numbers, booleans, None), never objects, which could run code when rebuilt"
                )
                user_process.send_data(outbox, ["raised", call_id, message])


def _end_leftovers(resident: set[int]) -> None:
    """Kill what the call started and left running (the resident processes and theirs excepted)."""
    if not user_process.has_children():  # the common case, without a look through /proc
        return
    me = os.getpid()
    spare = {me} | {p for r in resident for p in user_process.tree(r)}
    killed = user_process.kill_tree(me, spare=spare)
    user_process.reap(killed)


if __name__ == "__main__":
    serve(int(sys.argv[1]), int(sys.argv[2]))
