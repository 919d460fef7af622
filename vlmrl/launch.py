"""One training run from Python or the command line: load and check the config, take the run lock, build the
tiny assets it names, start or join Ray, and run the ``Runner`` to the end.

``train`` is the Python entry point (``vlmrl.api.train``): a config as a YAML path or a mapping, overrides as
``key=value`` strings or a mapping, the data as an HF ``Dataset`` or a list of rows, and the reward function or
the workflow class as Python objects. It runs in the calling process, on the Ray cluster already up in it (or the
one ``RAY_ADDRESS`` names), else on a local cluster it starts for the run. ``vlmrl.main`` is
the command line over ``prepare`` and ``execute``.
"""

from __future__ import annotations

import contextlib
import ctypes
import inspect
import io
import json
import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vlmrl.config import ConfigError
from vlmrl.config.loading import parse
from vlmrl.plan import Plan, detect_cluster, resolve


@dataclass(frozen=True)
class Prepared:
    """A checked config and its plan, and what the run still has to build first."""

    args: list[str]
    base: dict | None
    config: Any
    plan: Plan
    tiny: Any
    """The ``${tiny:...}`` assets the config names (``vlmrl.testing.resolvers``); ``tiny.missing`` are not built."""


def prepare(args: list[str], base: dict | None = None) -> Prepared:
    """Load and check the config from ``config=<yaml>`` / ``key=value`` arguments (over ``base``, a config tree
    as a mapping); raises ``ConfigError`` listing every problem. Builds nothing and starts nothing."""
    from vlmrl.testing.resolvers import register_resolvers
    from vlmrl.validate import load_config

    cluster = detect_cluster()
    # The tiny assets a config names as ${tiny:...} are only planned here, not built, so that every key is checked
    # first, in seconds; what is not built yet is built by ``execute``, once the config is valid.
    tiny = register_resolvers(build=False)
    try:
        config = load_config(args, cluster, pending=tiny.pending, base=base)
    finally:
        register_resolvers()  # later loads in this process (the checks after a build, tests) build what they name
    return Prepared(list(args), base, config, resolve(config, cluster), tiny)


def execute(prepared: Prepared, hooks=None, *, own_session: bool = True) -> int:
    """Run ``prepared`` to the end: the run lock, the missing tiny assets (then the config is checked again: the
    models' kinds, the judge template on the first row), Ray and the Runner. ``own_session``: a local cluster this
    call starts runs in a child process of its own session (``_run_in_own_session``), as the command line does.
    Raises ``ConfigError`` and ``RunLocked``."""
    from vlmrl.driver.run_lock import run_locks

    config, plan, tiny = prepared.config, prepared.plan, prepared.tiny
    # One run per experiment (and checkpoint) directory, held until this process ends.
    with run_locks(plan.experiment_dir, plan.checkpoint_dir):
        if tiny.missing:
            from vlmrl.driver.console import LOG_FILE
            from vlmrl.testing.resolvers import build_missing
            from vlmrl.validate import load_config

            build_missing(tiny, Path(plan.experiment_dir) / LOG_FILE)
            config = load_config(prepared.args, detect_cluster(), base=prepared.base)
        if own_session and _splits_session(hooks):
            return _run_in_own_session(config, plan)
        return _run(config, plan, hooks)


@dataclass(frozen=True)
class TrainResult:
    """What ``train`` returns."""

    experiment_dir: Path
    checkpoint_dir: Path
    steps: int
    """The last training step logged (0: none)."""
    metrics: dict[str, float]
    """That step's metrics, from the run's ``metrics.jsonl`` (empty without the file logger)."""


def train(
    config: str | os.PathLike | Mapping | None = None,
    overrides: Sequence[str] | Mapping[str, Any] = (),
    *,
    train_data: Any = None,
    val_data: Any = None,
    reward: Any = None,
    workflow: Any = None,
) -> TrainResult:
    """Train once from Python, in this process; returns where the run wrote and its last step's metrics.

    ``config``: a YAML path, or a config tree as a mapping (as a YAML file would hold it), or None for the
    defaults. ``overrides``: ``key=value`` strings as on the command line, or ``{dotted.key: value}``.
    ``train_data`` / ``val_data``: an HF ``datasets.Dataset`` or a list of row dicts (the columns a parquet row
    has; PIL images allowed), written as parquet under the experiment directory and read from there, so a bad
    row is named by file and row as any file's would be. ``reward``: a function, ``workflow``: a class, each
    defined at the top level of a Python file (the reward processes and the rollout workers load it by path).

    Everything is checked before Ray starts or a model is built: ``ConfigError`` lists every problem. The run
    uses the Ray cluster already up in this process (or the one ``RAY_ADDRESS`` names); otherwise it starts a
    local one on loopback for the run and shuts it down at the end.
    """
    args, base = _arguments(config, overrides, reward, workflow)
    if train_data is not None or val_data is not None:
        where = _experiment_dir(args, base) / "data"
        if train_data is not None:
            args.append(f"data.train_files={_write_rows(train_data, where / 'train.parquet')}")
        if val_data is not None:
            args.append(f"data.val_files={_write_rows(val_data, where / 'val.parquet')}")
    prepared = prepare(args, base)
    ray = sys.modules.get("ray")
    joined = bool(os.environ.get("RAY_ADDRESS")) or (ray is not None and ray.is_initialized())
    try:
        execute(prepared, own_session=False)
    finally:
        ray = sys.modules.get("ray")
        if not joined and ray is not None and ray.is_initialized():
            # The cluster this call started goes with it: its workers' output is routed to this run's run.log,
            # which a later run must not inherit.
            ray.shutdown()
    plan = prepared.plan
    return TrainResult(Path(plan.experiment_dir), Path(plan.checkpoint_dir), *_last_step(Path(plan.experiment_dir)))


def _arguments(config, overrides, reward, workflow) -> tuple[list[str], dict | None]:
    args: list[str] = []
    base = None
    if isinstance(config, Mapping):
        base = json.loads(json.dumps(dict(config), default=str))  # a plain tree, the caller's left untouched
    elif config is not None:
        path = Path(config)
        if not path.is_file():
            raise ConfigError([f"config={path}: no such file"])
        args.append(f"config={path}")
    if isinstance(overrides, Mapping):
        args += [f"{k}={v if isinstance(v, str) else json.dumps(v)}" for k, v in overrides.items()]
    elif isinstance(overrides, str):
        raise TypeError("train(overrides=...): a list of key=value strings or a mapping, not one string")
    else:
        args += list(overrides)
    if reward is not None:
        args.append(f"worker.reward.reward_function={_by_path(reward, 'reward', inspect.isfunction)}")
    if workflow is not None:
        args.append(f"worker.rollout.workflow={_by_path(workflow, 'workflow', inspect.isclass)}")
    return args, base


def _by_path(obj: Any, what: str, kind) -> str:
    """``file.py:name`` of a function or class defined at the top level of a Python file."""
    noun = "function" if what == "reward" else "class"
    name = getattr(obj, "__qualname__", "")
    try:
        file = inspect.getsourcefile(obj) if kind(obj) else None
    except TypeError:
        file = None
    if not kind(obj) or not file or "." in name or "<" in name or not Path(file).is_file():
        raise TypeError(
            f"train({what}=...): give a {noun} defined at the top level of a Python file (the workers load it by "
            f"path in their own processes); {obj!r} is not one (a lambda, a nested {noun}, an instance or one "
            f"defined in a notebook cell cannot be loaded there). Put it in a .py file and import it"
        )
    return f"{Path(file).resolve()}:{name}"


def _experiment_dir(args: list[str], base: dict | None) -> Path:
    config, problems = parse(args, base)
    if problems:
        raise ConfigError(problems)
    t = config.trainer
    return Path(t.output_dir) / t.project_name / t.experiment_name


def _write_rows(data: Any, path: Path) -> Path:
    """``data`` (an HF Dataset, or a list of row dicts with PIL images allowed) as a parquet file at ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if hasattr(data, "to_parquet"):
        data.to_parquet(str(path))
        return path
    if not isinstance(data, Sequence) or not all(isinstance(row, Mapping) for row in data):
        raise TypeError("train(train_data=... / val_data=...): an HF datasets.Dataset or a list of row dicts")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{k: _cell(v) for k, v in row.items()} for row in data]), path)
    return path


def _cell(value: Any) -> Any:
    """A PIL image as the parquet image cell EasyR1's data holds ({bytes: png, path: None}); lists of them too."""
    if isinstance(value, list):
        return [_cell(v) for v in value]
    if hasattr(value, "save") and hasattr(value, "mode"):  # a PIL image
        buffer = io.BytesIO()
        value.save(buffer, format="PNG")
        return {"bytes": buffer.getvalue(), "path": None}
    return value


def _last_step(experiment_dir: Path) -> tuple[int, dict[str, float]]:
    """The last step in ``metrics.jsonl`` and its metrics (its records merged: training and validation)."""
    path = experiment_dir / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    step = max((int(r.get("step", 0)) for r in records), default=0)
    merged: dict[str, float] = {}
    for r in records:
        if int(r.get("step", 0)) == step:
            merged.update(r)
    return step, merged


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
    started = _start_workers_early(config, plan)
    # Three threads: run, request_stop and take_console can each arrive while the others wait.
    runner = ray.remote(Runner).options(num_cpus=0, max_concurrency=3).remote()
    done = runner.run.remote(config, plan, hooks, started)
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
    finally:
        # The Runner owns the run's other actors and placement groups, and this process the workers it started;
        # they go with them. On a cluster that outlives the run (vlmrl.api.train, a joined cluster) they would
        # otherwise hold its CPUs and block the next run.
        ray.kill(runner)
        if started is not None:
            started.stop()
    return 0


EARLY_PLACEMENT_S = 5.0
"""How long the driver waits to place the workers itself before leaving it to the Runner (which waits longer)."""


def _start_workers_early(config, plan):
    """The workers' actors, created as soon as this process has joined Ray, or None where the Runner creates them.

    A worker's start (imports, models, engine) is most of a short run's, and the Runner's own start (its process,
    the step loop's imports, the data, the loggers) runs beside it instead of before it. Left to the Runner: a run
    that resumes (it checks the checkpoint, and whether any training is left, before any worker starts) and one
    whose workers the cluster cannot place at once (the Runner waits for them, and says why it cannot).
    """
    trainer = config.trainer
    checkpoints = Path(plan.checkpoint_dir)
    if trainer.load_checkpoint_path or (trainer.find_last_checkpoint and any(checkpoints.glob("global_step_*"))):
        return None
    from vlmrl.workers.group import PlacementTimeout, start_workers

    try:
        return start_workers(config, plan, placement_timeout_s=EARLY_PLACEMENT_S)
    except PlacementTimeout:
        return None


def _splits_session(hooks) -> bool:
    """Whether this run starts a local Ray cluster of its own, to be kept apart from the caller's signals."""
    ray = sys.modules.get("ray")
    joined = os.environ.get("RAY_ADDRESS") or (ray is not None and ray.is_initialized())
    # Test hooks run in this process's Runner; without prctl's parent-death signal (Linux only) a child left
    # behind by a killed parent would train on alone.
    return hooks is None and not joined and sys.platform.startswith("linux")


_CHILD = "import sys\nfrom vlmrl.launch import _session_child\nsys.exit(_session_child())"


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

    if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
        yield
        return
    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


