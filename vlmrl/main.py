"""``python -m vlmrl.main config=<yaml> key=value ...``

The config is loaded and validated in full before Ray starts or any model is
read, so a mistyped key fails in a second with every problem listed.
"""

from __future__ import annotations

import os
import sys

from vlmrl.config import ConfigError, load_config
from vlmrl.plan import resolve


def main(argv: list[str] | None = None) -> int:
    try:
        config = load_config(sys.argv[1:] if argv is None else argv)
    except ConfigError as e:
        print(f"vlmrl: {e}", file=sys.stderr)
        return 2
    plan = resolve(config)

    import ray

    from vlmrl.trainer.runner import Runner

    if not ray.is_initialized():
        if os.environ.get("RAY_ADDRESS"):
            ray.init()
        else:
            # A local cluster with no dashboard. Logical CPUs cover every actor
            # the run places even on a 2-core machine; the workers set their own
            # thread counts.
            needed = plan.world_size + config.worker.reward.num_cpus
            ray.init(num_cpus=max(os.cpu_count() or 1, needed), include_dashboard=False)
    runner = ray.remote(Runner).options(num_cpus=0).remote()
    ray.get(runner.run.remote(config, plan))
    return 0


if __name__ == "__main__":
    sys.exit(main())
