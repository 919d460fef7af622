"""Keep Python's cyclic garbage collector from walking a process's start-up heap over and over.

A worker process builds, while it starts, a heap of about a million objects that live as long as it does: the
modules of torch, transformers and vLLM, the models, the engine. Python runs a full (generation-2) collection
each time the objects that survived earlier collections grow by a quarter, and each one walks the whole heap, so
a growing heap is walked again and again. Measured on the step benchmark's shape (2 cores): the hybrid worker ran
14 full collections while it started, 0.04 s to 0.72 s each and 4.7 s in all, and the Runner 2 s.

So each Ray worker process of a run starts with full collections paused (``pause_full_collections``, from the
job's process set-up); the young generations are still collected, which is where start-up makes garbage. A
process that has built what it keeps calls ``started``: one collection, then ``gc.freeze`` moves the survivors
to a generation no collection walks (vLLM's server does the same after it starts), and the pause ends.
A process that never calls it gets the usual collector back after ``PAUSE_S`` seconds.
"""

from __future__ import annotations

import gc
import time

PAUSE_S = 300.0
"""The longest a pause lasts when nothing ends it: a process that is not one of the run's heavy actors (a reward
actor, a task) gets the usual collector back after this."""

_THRESHOLD_2 = 1 << 30
"""Collections of generation 1 before a full one: more than a process ever runs."""

_saved: tuple[int, int, int] | None = None
"""The thresholds a pause replaced; None when no pause is on."""
_deadline = 0.0


def pause_full_collections(seconds: float = PAUSE_S) -> None:
    """Run no full collection until ``started`` or for ``seconds``, whichever comes first."""
    global _saved, _deadline
    if _saved is not None:
        return
    _saved = gc.get_threshold()
    _deadline = time.monotonic() + seconds
    gc.set_threshold(_saved[0], _saved[1], _THRESHOLD_2)
    if _end_at_deadline not in gc.callbacks:
        gc.callbacks.append(_end_at_deadline)


def freeze_survivors() -> None:
    """Collect what is garbage now and exempt every surviving object from later collections.

    The collection comes first because frozen cycles are never freed. Objects made afterwards are collected as
    usual; a frozen object that loses its last reference is still freed at once. Worth calling before a library
    that runs full collections itself (vLLM does while it sizes its memory): they then walk only what is new.
    """
    gc.collect()
    gc.freeze()


def started() -> None:
    """This process has built what it keeps: freeze the survivors and end any pause."""
    freeze_survivors()
    _end_pause()


def paused() -> bool:
    """Whether full collections are paused in this process."""
    return _saved is not None


def _end_pause() -> None:
    global _saved
    if _saved is not None:
        gc.set_threshold(*_saved)
        _saved = None


def _end_at_deadline(phase: str, info: dict) -> None:
    # Runs at every collection: a comparison while a pause is on, nothing after. It stays in the list, because
    # removing a callback while the collector walks that list would skip the next one.
    if _saved is not None and phase == "stop" and time.monotonic() > _deadline:
        _end_pause()
