"""``python -m vlmrl.main config=<yaml> key=value ... [--dry-run | --help]``

The config is loaded and validated in full before Ray starts or any model is
read, so a mistyped key fails in a second with every problem listed.
``--help`` lists every option from the config's attribute docstrings;
``--dry-run`` prints the resolved config and the resource plan and stops
there, without Ray or a model.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys

import yaml

from vlmrl.config import ConfigError, help_text, to_dict
from vlmrl.plan import describe, detect_cluster, resolve
from vlmrl.testing.resolvers import register_resolvers
from vlmrl.validate import load_config


def main(argv: list[str] | None = None, hooks=None) -> int:
    """Run ``python -m vlmrl.main ARGS``; ``hooks`` (a ``vlmrl.driver.hooks.RunHooks``) are for tests only."""
    args = sys.argv[1:] if argv is None else argv
    if "--help" in args or "-h" in args:
        try:
            print(help_text(), flush=True)
        except BrokenPipeError:
            # `--help | head` closes the pipe early; the rest of the text goes nowhere, without a traceback.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    dry_run = "--dry-run" in args
    args = [a for a in args if a != "--dry-run"]
    cluster = detect_cluster()
    # examples/quickstart.yaml names its model and data as ${tiny:...}.
    register_resolvers()
    try:
        config = load_config(args, cluster)
    except ConfigError as e:
        print(f"vlmrl: {e}", file=sys.stderr)
        return 2
    plan = resolve(config, cluster)
    if dry_run:
        print("# resolved config")
        print(yaml.safe_dump(to_dict(config), sort_keys=False), end="")
        print("\n# plan")
        print(describe(plan, config))
        return 0

    from vlmrl.driver.run_lock import RunLocked, run_locks

    try:
        # One run per experiment (and checkpoint) directory, held until this process ends.
        with run_locks(plan.experiment_dir, plan.checkpoint_dir):
            return _run(config, plan, hooks)
    except RunLocked as e:
        print(f"vlmrl: {e}", file=sys.stderr)
        return 2


def _run(config, plan, hooks) -> int:
    """Start or join Ray, run the Runner to the end, and turn SIGTERM / SIGINT into a saved stop."""
    import ray

    from vlmrl.driver.runner import Runner

    if not ray.is_initialized():
        if os.environ.get("RAY_ADDRESS"):
            ray.init()
        else:
            # A local cluster with no dashboard. Logical CPUs cover every actor
            # the run places even on a 2-core machine; the workers set their own
            # thread counts.
            needed = (
                plan.world_size + 2 * config.worker.reward.num_cpus
            )  # training and validation reward actors
            ray.init(num_cpus=max(os.cpu_count() or 1, needed), include_dashboard=False)
    runner = ray.remote(Runner).options(num_cpus=0, max_concurrency=2).remote()
    done = runner.run.remote(config, plan, hooks)
    with _stop_on_signals(lambda: runner.request_stop.remote()):
        # Wait in slices so a signal is handled within a second.
        while not ray.wait([done], timeout=1.0)[0]:
            pass
    ray.get(done)
    return 0


@contextlib.contextmanager
def _stop_on_signals(request_stop):
    """SIGTERM / SIGINT: the first asks the run to save and stop; a second exits at once."""
    received = []

    def handler(signum, _frame):
        if received:
            print(
                f"vlmrl: second {signal.Signals(signum).name}, exiting now",
                file=sys.stderr,
                flush=True,
            )
            os._exit(128 + signum)
        received.append(signum)
        print(
            f"vlmrl: {signal.Signals(signum).name} received; finishing the current step, saving, then exiting "
            "(send it again to exit at once)",
            file=sys.stderr,
            flush=True,
        )
        request_stop()

    previous = {
        sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)
    }
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


if __name__ == "__main__":
    sys.exit(main())
