"""vlmrl.heap: full garbage collections paused while a worker process starts, and its start-up heap frozen after.

These change this (pytest's) process's collector, so each test puts the thresholds and the callbacks back as they
were. What they freeze stays frozen: the suite froze its own start-up heap already (tests/conftest.py), and
unfreezing would hand that back to every full collection.
"""

from __future__ import annotations

import gc
import time
import weakref

import pytest

from vlmrl import heap
from vlmrl.driver import console


@pytest.fixture(autouse=True)
def collector_as_it_was():
    thresholds, callbacks = gc.get_threshold(), list(gc.callbacks)
    heap._end_pause()
    yield
    heap._end_pause()
    gc.set_threshold(*thresholds)
    gc.callbacks[:] = callbacks


def _full_collections_while_growing(objects: int) -> int:
    """Full collections that run by themselves while this process keeps ``objects`` new containers alive."""
    full = []

    def count(phase, info):
        if phase == "start" and info["generation"] == 2:
            full.append(1)

    gc.callbacks.append(count)
    try:
        kept = [[i] for i in range(objects)]
        del kept
    finally:
        gc.callbacks.remove(count)
    return len(full)


def test_a_pause_stops_full_collections_that_a_growing_heap_otherwise_triggers():
    gc.collect()  # so the growth below counts against a settled heap
    assert _full_collections_while_growing(1_500_000) >= 1  # the control: growth does trigger them
    heap.pause_full_collections()
    assert heap.paused()
    gc.collect()
    assert _full_collections_while_growing(1_500_000) == 0


def test_started_freezes_the_survivors_and_ends_the_pause():
    thresholds = gc.get_threshold()
    heap.pause_full_collections()
    assert gc.get_threshold()[2] > thresholds[2]
    kept = [[i] for i in range(1000)]  # noqa: F841 (alive through the freeze)
    frozen_before = gc.get_freeze_count()
    heap.started()
    assert not heap.paused()
    assert gc.get_threshold() == thresholds
    assert gc.get_freeze_count() >= frozen_before + 1000


def test_freezing_collects_garbage_cycles_first_so_none_is_frozen():
    class Node:
        pass

    a, b = Node(), Node()
    a.other, b.other = b, a  # a cycle only the collector frees
    alive = weakref.ref(a)
    gc.disable()  # no automatic collection between here and the freeze
    try:
        del a, b
        heap.freeze_survivors()
    finally:
        gc.enable()
    gc.collect()  # a frozen cycle would survive this too
    assert alive() is None
    assert gc.get_freeze_count() > 0


def test_a_pause_nothing_ends_lapses_at_its_deadline():
    thresholds = gc.get_threshold()
    # Half a second: a loaded machine must not pass the deadline between the pause and the first check.
    heap.pause_full_collections(seconds=0.5)
    gc.collect(0)
    assert heap.paused()  # the deadline has not passed
    time.sleep(0.6)
    gc.collect(0)  # any collection after the deadline ends it
    assert not heap.paused()
    assert gc.get_threshold() == thresholds


def test_each_ray_worker_process_of_a_run_starts_with_full_collections_paused(monkeypatch):
    # process_setup is the job's worker_process_setup_hook (console.runtime_env); without a run log it only pauses.
    assert console.runtime_env("/tmp/run.log", False)["worker_process_setup_hook"].endswith(".process_setup")
    monkeypatch.delenv(console.RUN_LOG_ENV, raising=False)
    console.process_setup()
    assert heap.paused()
