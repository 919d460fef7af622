"""Fixtures shared by the fault tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def local_ray():
    """A fresh 2-CPU local Ray cluster for one test (any cluster an earlier test left is shut down first)."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_cpus=2, include_dashboard=False)
    yield ray
    ray.shutdown()
