"""A rollout server on the quickstart's tiny model for the tests that talk to one, in a Ray of their own."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import ray
from helpers.configs import CPU
from helpers.shared_cluster import forked_runtime_env

from vlmrl.plan import resolve
from vlmrl.workers.rollout_server import start_rollout_server


@contextmanager
def launched_server(config, max_concurrency: int) -> Iterator:
    """The server's actor handle, launched and not waited on (vLLM starts while the caller does other work);
    killed, and a Ray started here shut down, on the way out."""
    started = not ray.is_initialized()
    if started:
        # address="local": a Ray of our own, even while another process on this machine runs one.
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env=forked_runtime_env())
    handle = start_rollout_server(config, resolve(config, CPU), max_concurrency=max_concurrency)
    try:
        yield handle
    finally:
        ray.kill(handle)
        if started:
            ray.shutdown()
