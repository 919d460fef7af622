"""``EngineLoop`` refuses a second request under an id that is still queued or in flight.

Outputs are matched to their futures by request id, so a duplicate would leave the first caller waiting
forever (found by the rollout server's concurrent calls, whose per-call ids collided). The engine is a
stand-in that never finishes a request: this is the loop's own bookkeeping, not vLLM's.
"""

from __future__ import annotations

import time

import pytest

from vlmrl.rollout.endpoint.loop import Aborted, EngineLoop
from vlmrl.rollout.engine import EngineRequest, Sampling


class Busy:
    """Takes requests and never finishes them."""

    def __init__(self):
        self.added: list[str] = []

    def add(self, request):
        self.added.append(request.request_id)

    def step(self):
        time.sleep(0.01)
        return []

    def abort(self, ids):
        pass


def _request(rid: str) -> EngineRequest:
    return EngineRequest(request_id=rid, prompt_token_ids=[1, 2], sampling=Sampling(n=1, temperature=1.0, max_tokens=4))


def test_a_request_id_that_is_queued_or_in_flight_is_refused():
    engine = Busy()
    loop = EngineLoop(engine)
    try:
        first = loop.submit(_request("a"))
        with pytest.raises(ValueError, match="request id 'a' is already queued or in flight"):
            loop.submit(_request("a"))
        second = loop.submit(_request("b"))  # another id is fine
        deadline = time.time() + 5
        while engine.added != ["a", "b"] and time.time() < deadline:
            time.sleep(0.01)
        assert engine.added == ["a", "b"] and not first.done() and not second.done()
    finally:
        loop.close(timeout=5)
    with pytest.raises(Aborted):
        first.result(timeout=5)
