"""``python -m vlmrl.main config=<yaml> key=value ... [--dry-run | --help [KEY_PREFIX]]``

The config is loaded and validated in full before Ray starts or any model is
read or built, so a mistyped key fails in seconds with every problem listed; the
tiny assets a YAML names as ``${tiny:...}`` are built only after that (never
under ``--dry-run``), with one console line saying what, and their progress in
the run's log.
``--help`` lists every option from the config's attribute docstrings (``--help
worker.rollout`` only those under that prefix); ``--dry-run`` prints the
resolved config and the resource plan and stops there, without Ray or a model.

During the run the terminal shows vlmrl's own lines and a progress bar; the
engines' logs go to ``<experiment dir>/run.log`` (``vlmrl.driver.console``).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import pickle
import signal
import subprocess
import sys
from pathlib import Path

import yaml

from vlmrl.config import ConfigError, help_text, to_dict
from vlmrl.config.help import USAGE
from vlmrl.config.redact import mask_text
from vlmrl.plan import describe, detect_cluster, resolve


def main(argv: list[str] | None = None, hooks=None) -> int:
    """Run ``python -m vlmrl.main ARGS``; ``hooks`` (a ``vlmrl.driver.hooks.RunHooks``) are for tests only."""
    args = sys.argv[1:] if argv is None else argv
    if "--help" in args or "-h" in args:
        at = args.index("--help") if "--help" in args else args.index("-h")
        following = args[at + 1] if at + 1 < len(args) else ""
        prefix = following if "=" not in following and not following.startswith("-") else ""  # --help KEY_PREFIX
        try:
            print(help_text(prefix), flush=True)
        except BrokenPipeError:
            # `--help | head` closes the pipe early; the rest of the text goes nowhere, without a traceback.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    dry_run = "--dry-run" in args
    args = [a for a in args if a != "--dry-run"]
    if not args:
        print(USAGE, file=sys.stderr)
        return 2
    missing = [a for a in args if a.startswith("config=") and not Path(a.removeprefix("config=")).is_file()]
    if missing:
        print(f"vlmrl: {missing[0]}: no such file\n{USAGE}", file=sys.stderr)
        return 2
    # Imported here, not at the top: the driver process of a run (``_session_child``) imports this module too,
    # and needs neither the checks (datasets, pandas) nor the tiny assets' builders.
    from vlmrl.testing.resolvers import build_missing, register_resolvers
    from vlmrl.validate import load_config

    cluster = detect_cluster()
    # examples/quickstart.yaml names its model and data as ${tiny:...}. They are only planned here, not built, so
    # that every key is checked first, in seconds; what is not built yet is built below, once the config is valid.
    tiny = register_resolvers(build=False)
    try:
        config = load_config(args, cluster, pending=tiny.pending)
    except ConfigError as e:
        print(f"vlmrl: {e}", file=sys.stderr)
        return 2
    finally:
        register_resolvers()  # later loads in this process (the checks after a build, tests) build what they name
    plan = resolve(config, cluster)
    if dry_run:
        print("# resolved config")
        print(yaml.safe_dump(to_dict(config), sort_keys=False), end="")
        print("\n# plan")
        print(mask_text(describe(plan, config)))  # a path built from ${oc.env:...} shows as ***
        if tiny.missing:
            print(f"not built yet (a run builds them first; --dry-run builds nothing): {tiny.describe_missing()}")
        return 0

    from vlmrl.driver.run_lock import RunLocked, run_locks

    try:
        # One run per experiment (and checkpoint) directory, held until this process ends.
        with run_locks(plan.experiment_dir, plan.checkpoint_dir):
            if tiny.missing:
                from vlmrl.driver.console import LOG_FILE

                build_missing(tiny, Path(plan.experiment_dir) / LOG_FILE)
                try:  # what needed the built files: the models' kinds, the judge template on the first row
                    config = load_config(args, cluster)
                except ConfigError as e:
                    print(f"vlmrl: {e}", file=sys.stderr)
                    return 2
            return _run_in_own_session(config, plan) if _splits_session(hooks) else _run(config, plan, hooks)
    except RunLocked as e:
        print(f"vlmrl: {e}", file=sys.stderr)
        return 2


LOCAL_CLUSTER_SYSTEM_CONFIG = {
    # No prestarted idle workers: Ray starts one per logical CPU, each a Python process importing Ray (about 0.6 s
    # of CPU apiece), and none of the run's actors was seen to take one: the Runner and the reward actors started
    # processes of their own beside them. Without them a launch is no slower.
    "enable_worker_prestart": False,
    "prestart_worker_first_driver": False,
    # Ray starts its worker processes at nice 15, below its own daemons and the driver (nice 0). Each wakeup of one
    # of those then preempts a worker's thread at once, and the worker's other thread waits for it at the end of
    # the OpenMP region. At nice 0, two alternating pairs of runs at the step benchmark's shape (4 December):
    # step 7.12 / 6.94 -> 6.69 / 6.10 s, generation 3.51 / 3.50 -> 3.35 / 2.96, reference 0.93 / 0.91 -> 0.85 / 0.78,
    # update 2.58 / 2.43 -> 2.41 / 2.25.
    "worker_niceness": 0,
}
"""Ray's settings for the local cluster a run starts itself (not for a cluster it joins)."""


def _run(config, plan, hooks) -> int:
    """Start or join Ray, run the Runner to the end, and turn SIGTERM / SIGINT into a saved stop."""
    import ray

    from vlmrl.driver.console import LOG_FILE, ConsoleView, quiet_ray_notices, runtime_env
    from vlmrl.driver.runner import Runner

    verbose = config.trainer.verbose
    log_path = Path(plan.experiment_dir) / LOG_FILE
    log_path.parent.mkdir(parents=True, exist_ok=True)
    if not ray.is_initialized():
        # Every worker process of the run sends its output to run.log (and, verbose, to the terminal too).
        options = {
            "runtime_env": runtime_env(str(log_path), verbose),
            # Quiet: the driver's own Ray lines only from warnings up ("Started a local Ray instance." is INFO).
            "logging_level": logging.INFO if verbose else logging.WARNING,
        }
        if not verbose:
            quiet_ray_notices()
        if os.environ.get("RAY_ADDRESS"):
            ray.init(**options)
            from vlmrl.driver.cluster_auth import unauthenticated_cluster_warning

            warning = unauthenticated_cluster_warning(os.environ, config.trainer.warn_unauthenticated_ray)
            if warning:
                print(warning, file=sys.stderr, flush=True)
        else:
            # A local cluster with no dashboard. Logical CPUs cover every actor
            # the run places even on a 2-core machine; the workers set their own
            # thread counts.
            reward = config.worker.reward
            separate_rm = bool(reward.reward_model.model_path) and reward.reward_model.placement == "separate"
            # The workers, the rollout servers (disaggregated), the training reward actors and the validation
            # one, and a separate reward model's actor.
            needed = plan.world_size + plan.rollout_servers + (plan.reward_workers + 1) * reward.num_cpus
            needed += reward.reward_model.num_cpus if separate_rm else 0
            # address="local": a cluster of its own even when another one on this machine (ray start) is found;
            # on 127.0.0.1 only (vlmrl.driver.local_cluster).
            from vlmrl.driver.local_cluster import loopback_only

            with loopback_only():
                ray.init(
                    address="local",
                    num_cpus=max(os.cpu_count() or 1, needed),
                    include_dashboard=False,
                    _system_config=LOCAL_CLUSTER_SYSTEM_CONFIG,
                    **options,
                )
    print(f"vlmrl: {plan.experiment_dir} (engine logs: {log_path})", flush=True)
    # Three threads: run, request_stop and take_console can each arrive while the others wait.
    runner = ray.remote(Runner).options(num_cpus=0, max_concurrency=3).remote()
    done = runner.run.remote(config, plan, hooks)
    view = ConsoleView(verbose)
    try:
        with _stop_on_signals(lambda: runner.request_stop.remote()):
            # Wait in slices, showing the Runner's lines, so a signal is handled within a second.
            while not ray.wait([done], timeout=0.5)[0]:
                view.show(*ray.get(runner.take_console.remote()))
        with contextlib.suppress(ray.exceptions.RayActorError):  # a Runner that died has no lines left
            view.show(*ray.get(runner.take_console.remote()))
    finally:
        view.close()
    try:
        ray.get(done)
    except Exception:
        print(f"vlmrl: the run failed; the engines' logs are in {log_path}", file=sys.stderr, flush=True)
        raise
    return 0


def _splits_session(hooks) -> bool:
    """Whether this run starts a local Ray cluster of its own, to be kept apart from the caller's signals."""
    ray = sys.modules.get("ray")
    joined = os.environ.get("RAY_ADDRESS") or (ray is not None and ray.is_initialized())
    # Test hooks run in this process's Runner; without prctl's parent-death signal (Linux only) a child left
    # behind by a killed parent would train on alone.
    return hooks is None and not joined and sys.platform.startswith("linux")


_CHILD = "import sys\nfrom vlmrl.main import _session_child\nsys.exit(_session_child())"


def _run_in_own_session(config, plan) -> int:
    """Run ``_run`` in a child process that leads a session of its own, and pass it SIGTERM and SIGINT.

    The local Ray cluster (gcs_server, the raylet, the worker processes holding the Runner and the workers) is
    started by the process that calls ``ray.init`` and stays in its session and process group. A signal sent to
    the whole job (``kill -TERM -<pgid>``, every process of the session, ``tini -g`` as a container's PID 1)
    would kill them before the step is finished and saved. This process stays in the caller's group and session
    and holds the run lock; the child, the driver proper, and the cluster are out of reach of a signal to the
    group or session and get it once, from here. A child whose parent dies (SIGKILL) is killed with it
    (``_session_child``), and the cluster with the child (Ray's own fate-sharing).
    """
    child = subprocess.Popen([sys.executable, "-c", _CHILD], stdin=subprocess.PIPE, start_new_session=True)

    def forward(signum, _frame):
        with contextlib.suppress(ProcessLookupError):
            os.kill(child.pid, signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        with contextlib.suppress(BrokenPipeError):  # a child that died at start says why on stderr
            child.stdin.write(pickle.dumps((config, plan, os.getpid())))
            child.stdin.close()
        code = child.wait()
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
    return code if code >= 0 else 128 - code  # killed by a signal: the shell's 128 + N


def _session_child() -> int:
    """The child of ``_run_in_own_session``: die with the parent, then run as the driver."""
    config, plan, parent = pickle.load(sys.stdin.buffer)
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before the line above
        return 1
    return _run(config, plan, None)


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
