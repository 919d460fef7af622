"""Where the gathered weights go.

A sink takes one sync's stream of ``(name, full tensor)`` and the policy
version they make, and must consume the whole stream (the gathers behind it are
collectives). In process today: the engine lives in the worker's process and
loads the stream as it arrives. A sink for an engine elsewhere (NCCL broadcast
to inference ranks, an object store) implements the same ``load``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext
from typing import Protocol

import torch

from vlmrl.rollout.engine import Engine


class Sink(Protocol):
    def load(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None: ...


class EngineSink:
    """In process: hands the stream and the version to the engine's ``load_weights``.

    ``hold``, when the engine also serves others between steps (the agent
    endpoint), is entered around the load: it holds new calls and waits for
    those in flight (``AgentEndpoint.paused``), so no call straddles two
    versions. The load itself stays on this thread, where the stream's
    gathers (collectives) must run.
    """

    def __init__(self, engine: Engine, hold: Callable[[], AbstractContextManager] | None = None):
        self.engine, self.hold = engine, hold

    def load(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        with self.hold() if self.hold is not None else nullcontext():
            self.engine.load_weights(named_tensors, version)
