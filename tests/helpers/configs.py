"""What the config tests share: the clusters they resolve against and how they collect problems."""

from __future__ import annotations

import pytest

from vlmrl.config import ConfigError

from vlmrl.validate import load_config
from vlmrl.plan import Cluster

QUICKSTART = "config=examples/quickstart.yaml"
CPU = Cluster(gpus=0, cpus=2)
GPUS = Cluster(gpus=8, cpus=64)


def problems_of(*args: str, cluster: Cluster = CPU) -> list[str]:
    """The problems ``load_config(args)`` reports (it must report some)."""
    with pytest.raises(ConfigError) as info:
        load_config(list(args), cluster)
    return info.value.problems
