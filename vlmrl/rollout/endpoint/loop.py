"""The one thread that drives an ``Engine`` for the agent endpoint, with pause and drain for weight syncs.

An ``Engine`` is not thread-safe, and the endpoint's HTTP handlers are many
concurrent callers. They hand their requests to an ``EngineLoop``; its thread
is the only one that touches the engine: it adds what was submitted, steps the
engine while anything is unfinished, and resolves each request's future with
its output. Anything else the owner needs done on the engine (a weight load)
goes through ``call``, which runs on that thread too.

Weight syncs: ``pause`` stops new requests from being added (they wait in the
queue), ``drain`` waits until every request already added has finished, and
``resume`` lets the waiting ones in. A weight load between drain and resume
therefore never has a request in flight, so no output straddles two versions
(``Engine.load_weights`` refuses a busy engine anyway).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from typing import Any

from vlmrl.rollout.engine import Engine, EngineOutput, EngineRequest

log = logging.getLogger(__name__)


class Aborted(RuntimeError):
    """The request was aborted before it finished (its rollout ended, or the endpoint closed)."""


class EngineLoop:
    """Owns an engine on one thread: ``submit`` requests from any thread and wait on their futures."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._cond = threading.Condition()
        self._pending: deque[tuple[EngineRequest, Future]] = deque()
        self._jobs: deque[tuple[Callable[[Engine], Any], Future]] = deque()
        self._aborts: set[str] = set()
        self._in_flight: dict[str, Future] = {}
        """Requests taken to be added, or added and not finished; only the loop removes them."""
        self._paused = False
        self._closing = False
        self.busy_s = 0.0
        """Seconds the loop has spent in engine steps (the engine's busy time; its idle time is the rest)."""
        self._thread = threading.Thread(target=self._run, name="vlmrl-endpoint-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ callers

    def submit(self, request: EngineRequest) -> Future:
        """Queue ``request``; the future gets its ``EngineOutput``, or ``Aborted`` or the engine's error."""
        future: Future = Future()
        with self._cond:
            if self._closing:
                raise Aborted("the endpoint is closed")
            # Outputs are matched to futures by id: a second request under a live id would leave the first
            # future unresolved forever.
            rid = request.request_id
            if rid in self._in_flight or any(p[0].request_id == rid for p in self._pending):
                raise ValueError(f"request id {rid!r} is already queued or in flight; request ids must be unique")
            self._pending.append((request, future))
            self._cond.notify_all()
        return future

    def abort(self, request_ids: list[str]) -> None:
        """Drop these requests, queued or in flight; their futures get ``Aborted``. Unknown ids are ignored."""
        ids = set(request_ids)
        with self._cond:
            for item in [p for p in self._pending if p[0].request_id in ids]:
                self._pending.remove(item)
                _resolve(item[1], error=Aborted(f"request {item[0].request_id} was aborted"))
            self._aborts |= ids & self._in_flight.keys()
            self._cond.notify_all()

    def call(self, fn: Callable[[Engine], Any], timeout: float | None = None) -> Any:
        """Run ``fn(engine)`` on the loop's thread, between engine steps, and return what it returns."""
        future: Future = Future()
        with self._cond:
            if self._closing:
                raise Aborted("the endpoint is closed")
            self._jobs.append((fn, future))
            self._cond.notify_all()
        return future.result(timeout)

    def pause(self) -> None:
        """Add no more requests until ``resume``; requests already added go on to finish."""
        with self._cond:
            self._paused = True

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    @property
    def paused(self) -> bool:
        return self._paused

    def drain(self, timeout: float | None = None) -> bool:
        """Wait (paused) until no request is in flight; False if ``timeout`` seconds passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            if not self._paused:
                raise RuntimeError("drain() needs a paused loop: pause() first, or new requests keep it busy")
            while self._in_flight:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def in_flight(self) -> int:
        """Requests added to the engine (or being added) and not finished."""
        with self._cond:
            return len(self._in_flight)

    def queued(self) -> int:
        """Requests submitted and not yet added (held while paused)."""
        with self._cond:
            return len(self._pending)

    def close(self, timeout: float = 30.0) -> None:
        """Abort everything queued or in flight and stop the thread."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout)

    # ------------------------------------------------------------ the loop

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._closing or self._jobs or self._aborts or self._in_flight or self._takeable()):
                    self._cond.wait()
                if self._closing:
                    break
                jobs, self._jobs = list(self._jobs), deque()
                aborts, self._aborts = self._aborts, set()
                adds = []
                while self._takeable():
                    request, future = self._pending.popleft()
                    # Marked in flight while still under the lock, so a drain that starts now waits for it.
                    self._in_flight[request.request_id] = future
                    adds.append((request, future))
            for fn, future in jobs:
                _settle(future, fn, self.engine)
            if aborts:
                self._abort(aborts, "aborted")
            for request, future in adds:
                try:
                    self.engine.add(request)
                except Exception as e:  # a request the engine refuses fails alone
                    self._finish(request.request_id, error=e)
            if self._in_flight:
                started = time.perf_counter()
                try:
                    outputs = self.engine.step()
                except Exception as e:  # every request in the step is lost; fail them, keep serving
                    self._abort(set(self._in_flight), f"failed in an engine step ({type(e).__name__}: {e})")
                    continue
                finally:
                    self.busy_s += time.perf_counter() - started
                for output in outputs:
                    self._finish(output.request_id, output=output)
        self._abort(set(self._in_flight), "aborted: the endpoint closed")
        with self._cond:
            for request, future in self._pending:
                _resolve(future, error=Aborted(f"request {request.request_id} aborted: the endpoint closed"))
            self._pending.clear()
            for _, future in self._jobs:
                _resolve(future, error=Aborted("the endpoint closed"))
            self._jobs.clear()

    def _takeable(self) -> bool:
        return bool(self._pending) and not self._paused

    def _abort(self, ids: set[str], why: str) -> None:
        ids = ids & self._in_flight.keys()
        if not ids:
            return
        try:
            self.engine.abort(sorted(ids))
        except Exception:  # the loop must outlive a failed abort; the requests are failed below either way
            log.exception("aborting requests %s failed", sorted(ids))
        for request_id in ids:
            self._finish(request_id, error=Aborted(f"request {request_id} {why}"))

    def _finish(
        self, request_id: str, *, output: EngineOutput | None = None, error: BaseException | None = None
    ) -> None:
        with self._cond:
            future = self._in_flight.pop(request_id, None)
            if future is not None:
                _resolve(future, output, error)
            self._cond.notify_all()  # a drain may be waiting for the last one


def _settle(future: Future, fn: Callable[[Engine], Any], engine: Engine) -> None:
    try:
        result = fn(engine)
    except BaseException as e:
        _resolve(future, error=e)
    else:
        _resolve(future, result)


def _resolve(future: Future, result: Any = None, error: BaseException | None = None) -> None:
    """Set the future's outcome unless its waiter cancelled it (then nobody reads it)."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except InvalidStateError:
        pass


class LoopedEngine:
    """``Engine.generate`` through an ``EngineLoop``, for a caller that plays turns on an engine other calls share
    (the multi-turn loop on a rollout server): each turn's requests are submitted to the loop and waited for,
    so they share engine steps with every other call in flight, and a weight load lands between two steps.

    Request ids get a prefix unique to the call, so concurrent callers may reuse their own ids.
    """

    def __init__(self, loop: EngineLoop):
        self.loop = loop
        self._calls = itertools.count()

    @property
    def seed(self) -> int:
        return self.loop.engine.seed

    @property
    def version(self) -> int:
        return self.loop.engine.version

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Nothing: a server's engine stays awake between calls (the trainer does not share its memory)."""

    def sleep(self) -> None:
        """Nothing (see ``wake_up``)."""

    def asynchronous(self) -> LoopedAsyncEngine:
        """The view a workflow class's coroutines await (``vlmrl.rollout.workflow``), one per rollout call."""
        return LoopedAsyncEngine(self.loop, f"wf{next(self._calls)}/")

    def generate(self, requests: list[EngineRequest]) -> list[EngineOutput]:
        prefix = f"turns{next(self._calls)}/"  # itertools.count's next is atomic under the GIL
        renamed = [dataclasses.replace(r, request_id=prefix + r.request_id) for r in requests]
        futures = []
        try:
            for request in renamed:
                futures.append(self.loop.submit(request))
            outputs = [f.result() for f in futures]
        except BaseException:
            # An aborted call or a closing loop: the call's other requests must not run on for nobody.
            self.loop.abort([r.request_id for r in renamed])
            raise
        return [dataclasses.replace(o, request_id=o.request_id[len(prefix) :]) for o in outputs]


class LoopedAsyncEngine:
    """``AsyncEngine``'s ``generate`` through an ``EngineLoop``: each request submitted to the loop and its future
    awaited, request ids prefixed with the call's own prefix."""

    def __init__(self, loop: EngineLoop, prefix: str):
        self.loop, self.prefix = loop, prefix
        self.seconds = 0.0
        """Seconds awaiting the engine (the loop steps it for every caller; there is no share of one's own)."""

    async def generate(self, request: EngineRequest) -> EngineOutput:
        renamed = dataclasses.replace(request, request_id=self.prefix + request.request_id)
        start = time.perf_counter()
        future = self.loop.submit(renamed)
        try:
            output = await asyncio.wrap_future(future)
        except asyncio.CancelledError:  # a timed-out workflow: its request must not run on unread
            self.loop.abort([renamed.request_id])
            raise
        finally:
            self.seconds += time.perf_counter() - start
        return dataclasses.replace(output, request_id=request.request_id)
