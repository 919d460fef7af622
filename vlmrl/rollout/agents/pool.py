"""The processes sync agents run in: one rollout at a time each, killed and replaced on a hang or a crash.

The parent side of ``child``'s protocol. A thread (one per
rollout in flight) takes an idle process, sends it the rollout and waits for
the answer up to the rollout's timeout. A process that does not answer in
time is killed with its whole process group (whatever the agent started) and
one that dies mid-rollout is reported with how it ended; either way a fresh
process takes its place, and the next rollout it serves waits for it to load
the agent, outside that rollout's timeout.
"""

from __future__ import annotations

import os
import queue
import secrets
import signal
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

from vlmrl.user_code import UserCodeError
from vlmrl.user_process import MARKER, kill_tree, recv_data

START_TIMEOUT_S = 120.0
"""How long an agent process may take to import the user's module and get ready."""


class _Process:
    def __init__(self, init: dict, module: str, what: str):
        self.what = what
        self.a = f"{'an' if what[0] in 'aeiou' else 'a'} {what}"
        child_read, parent_write = os.pipe()
        parent_read, child_write = os.pipe()
        self.token = secrets.token_hex(8)
        self.popen = subprocess.Popen(
            [sys.executable, "-m", module, str(child_read), str(child_write)],
            pass_fds=(child_read, child_write),
            stdin=subprocess.DEVNULL,
            # The agent's prints show up even if it is killed; the marker finds what it started, setsid or not.
            env={**os.environ, "PYTHONUNBUFFERED": "1", MARKER: self.token},
            start_new_session=True,  # its own process group: a kill reaches what the agent started too
        )
        os.close(child_read)
        os.close(child_write)
        self.inbox = Connection(parent_read, writable=False)
        self.outbox = Connection(parent_write, readable=False)
        self.outbox.send(init)
        self.ready = False

    def wait_ready(self, spec: str) -> None:
        """Wait until the agent is loaded; UserCodeError with the reason if it cannot be."""
        if self.ready:
            return
        message = self._receive(START_TIMEOUT_S)
        if message == ["ready"]:
            self.ready = True
            return
        if message is None:
            raise UserCodeError(f"{self.a} process for {spec} did not load it within {START_TIMEOUT_S:.0f} s")
        if message[0] == "failed" and len(message) == 2:
            raise UserCodeError(str(message[1]))
        raise UserCodeError(f"{self.a} process for {spec} {self.exit_description()} while loading it")

    def run(self, payload: tuple, timeout: float | None) -> tuple[str, Any]:
        """``("ok", value)``, ``("raised", text)``, ``("timeout", None)`` or ``("died", text)``."""
        try:
            self.outbox.send(payload)
        except OSError:  # it died between rollouts
            return "died", f"the {self.what} process {self.exit_description()} before it was sent the work"
        message = self._receive(timeout)
        if message is None:
            return "timeout", None
        if message[0] == "eof":
            return "died", f"the {self.what} process {self.exit_description()}"
        if message[0] == "garbled" or not (len(message) == 2 and message[0] in ("ok", "raised")):
            return "died", f"the {self.what} process broke the protocol: {str(message[1:])[:200]}"
        return message[0], message[1]

    def _receive(self, timeout: float | None):
        """The next message (a list); None when ``timeout`` passed first; ``["eof"]`` when the process closed its
        pipe; ``["garbled", why]`` when what it sent is not data."""
        try:
            if not self.inbox.poll(timeout):
                return None
            message = recv_data(self.inbox)
        except (EOFError, OSError):
            return ["eof"]
        except ValueError as e:  # not data: the agent wrote to the pipe itself
            return ["garbled", f"it sent something that is not data ({e})"]
        return message if isinstance(message, list) and message else ["garbled", "it sent an empty message"]

    def exit_description(self) -> str:
        try:
            code = self.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            return "closed its pipe but is still running"
        if code < 0:
            return f"was killed by {signal.Signals(-code).name}"
        return f"exited with code {code}"

    def kill(self) -> None:
        kill_tree(self.popen.pid, self.token)  # every process of its tree, those that left its session too
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.popen.wait()
        self.inbox.close()
        self.outbox.close()


class AgentProcesses:
    """``processes`` processes running the sync agent ``spec``; ``run`` is called from many threads at once.

    ``module`` is the child's side (``agents.child``, or ``turns.tool_child`` for tools, whose ``spec`` is a
    list of tool specs); ``what`` names the process in messages.
    """

    def __init__(
        self, spec: str | list[str], key: str, processes: int, module: str = "vlmrl.rollout.agents.child",
        what: str = "agent",
    ):  # fmt: skip
        if processes < 1:
            raise ValueError(f"processes={processes}: at least one is needed")
        self.spec = spec if isinstance(spec, str) else ", ".join(spec)
        self.processes, self.module, self.what = processes, module, what
        self._init = {"sys_path": list(sys.path), "spec": spec, "key": key}
        self._idle: queue.SimpleQueue[_Process] = queue.SimpleQueue()
        self._all: set[_Process] = set()
        self._lock = threading.Lock()
        self._closed = False

    def start(self) -> None:
        """Start the processes and wait until each has loaded the agent; UserCodeError if one cannot."""
        started = [self._spawn() for _ in range(self.processes)]
        try:
            for process in started:
                process.wait_ready(self.spec)
        except BaseException:
            self.close()
            raise
        for process in started:
            self._idle.put(process)

    def run(self, task: dict, llm: dict, timeout: float | None) -> tuple[str, Any, float]:
        """Run one rollout in an idle process: its outcome (see ``_Process.run``) and the seconds it ran."""
        return self.call((task, llm), timeout)

    def call(self, payload: Any, timeout: float | None) -> tuple[str, Any, float]:
        """Send ``payload`` to an idle process: its outcome (see ``_Process.run``) and the seconds it ran."""
        process = self._idle.get()
        keep = False
        try:
            try:
                process.wait_ready(self.spec)  # a replacement loads first, on its own clock
            except UserCodeError as e:
                return "died", f"a fresh {self.what} process could not start: {e}", 0.0
            start = time.perf_counter()
            kind, value = process.run(payload, timeout)
            keep = kind in ("ok", "raised")
            return kind, value, time.perf_counter() - start
        finally:
            self._release(process, keep)

    def _release(self, process: _Process, keep: bool) -> None:
        if not keep:
            process.kill()
            with self._lock:
                self._all.discard(process)
            if self._closed:
                return
            process = self._spawn()  # it loads while the next rollout waits, not this one
        self._idle.put(process)

    def _spawn(self) -> _Process:
        with self._lock:
            if self._closed:
                raise RuntimeError("the agent processes are closed")
            process = _Process(self._init, self.module, self.what)
            self._all.add(process)
        return process

    def close(self) -> None:
        """Kill every process, busy ones too (their rollouts end as died)."""
        with self._lock:
            self._closed = True
            processes, self._all = list(self._all), set()
        for process in processes:
            process.kill()
