"""The local Ray cluster a single-node run starts, listening on 127.0.0.1 only.

Ray 2.60 takes a node's address from the route out of the machine and
replaces a loopback ``_node_ip_address`` with it; its daemons (gcs_server, the
raylet, the runtime-env and dashboard agents) and every worker's and the
driver's gRPC server then listen on every interface (``::``) or on that
address. Only where Ray is told that it runs no cluster of several machines
(``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, the setting that Windows and macOS
default to) does it take 127.0.0.1 as the node's address, and its servers bind
that address alone. A cluster started that way cannot take other nodes, which
a run that starts its own cluster never adds.

Ray reads the setting when ``ray`` is first imported, so ``loopback_only``
sets Ray's constant in this process as well as the environment that Ray's
processes inherit, for the span of ``ray.init``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
"""Ray's switch for clusters of several machines; "0" keeps a node on 127.0.0.1."""


@contextmanager
def loopback_only() -> Iterator[None]:
    """Around ``ray.init`` of a local cluster: the cluster it starts takes 127.0.0.1 as its node's address, and
    its processes listen there (the environment and Ray's constant are put back after)."""
    import ray._private.ray_constants as ray_constants

    before_env, before_constant = os.environ.get(LOOPBACK_ENV), ray_constants.ENABLE_RAY_CLUSTER
    os.environ[LOOPBACK_ENV] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = before_constant
        if before_env is None:
            os.environ.pop(LOOPBACK_ENV, None)
        else:
            os.environ[LOOPBACK_ENV] = before_env
