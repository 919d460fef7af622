from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers.runs import (
    E2E_API_KEY,
    E2E_SAMPLES_LOGGED,
    E2E_TRAINING,
    experiment_dir,
    logging_reward,
    main_command,
    run_main,
    tail,
)
from helpers.shared_cluster import forked_runtime_env, stop as stop_shared_cluster
from helpers.sigterm_run import SigtermRun, sigterm_run as _sigterm_run

from vlmrl.heap import pause_full_collections, started
from vlmrl.testing.assets import QuickstartAssets, TinyAssets, ensure_quickstart_assets, ensure_tiny_assets
from vlmrl.testing.resolvers import register_resolvers

# The tests' configs (examples/quickstart.yaml among them) name the tiny assets as ${tiny:...};
# registered here, before any test module is collected, since some load a config at import.
register_resolvers()


@pytest.fixture(scope="session")
def tiny_assets() -> TinyAssets:
    """The shared tiny Qwen2.5-VL and synthetic colour data (built once, cached on disk)."""
    return ensure_tiny_assets()


@pytest.fixture(scope="session")
def quickstart_assets() -> QuickstartAssets:
    """The quickstart's format-tuned tiny model and its data (built once, cached on disk)."""
    return ensure_quickstart_assets()


@dataclass(frozen=True)
class E2ERun:
    assets: QuickstartAssets
    """What examples/quickstart.yaml trains on: the run's initial weights and its data."""
    output_dir: Path
    dir: Path
    args: list[str]
    log: str
    reward_log: Path


@pytest.fixture(scope="session")
def e2e_run(quickstart_assets, tmp_path_factory) -> E2ERun:
    """One real run of ``python -m vlmrl.main`` that many tests inspect, so CI pays for it once.

    The tiny quickstart for 4 steps of 4 prompts x 4 samples, validating before
    training and at the end (2 samples logged), to every logger that needs no
    extra package, saving every 2 steps and keeping only the newest checkpoint.
    """
    tmp = tmp_path_factory.mktemp("e2e")
    output_dir = tmp / "outputs"
    overrides = [
        *E2E_TRAINING,
        *logging_reward(tmp),
        "trainer.val_before_train=true",
        f"trainer.val_generations_to_log={E2E_SAMPLES_LOGGED}",
        "trainer.logger=[console,file,mlflow,tensorboard]",
        "trainer.save_freq=2",
        "trainer.save_limit=1",
        # A secret from the environment, which nothing the run writes may hold (tests/test_e2e.py); the
        # logging reward takes it in its **kwargs. The default lets a test reload these args without it.
        "worker.reward.reward_function_kwargs.api_key=${oc.env:VLMRL_E2E_API_KEY,unset}",
    ]
    # Cold (no fork server): tests/test_console.py reads what a cold start prints.
    proc = run_main(
        output_dir, *overrides, experiment="e2e", env={"VLMRL_E2E_API_KEY": E2E_API_KEY}, timeout=900, forked=False
    )
    assert proc.returncode == 0, f"vlmrl.main failed:\n{tail(proc)}"
    args = main_command(output_dir, *overrides, experiment="e2e")[3:]  # from config=... on
    return E2ERun(
        quickstart_assets, output_dir, experiment_dir(output_dir, "e2e"), args, proc.stdout + proc.stderr,
        tmp / "reward_calls.jsonl",
    )  # fmt: skip


@pytest.fixture(scope="session")
def sigterm_run(quickstart_assets, tmp_path_factory) -> SigtermRun:
    """The quickstart run stopped by SIGTERM after its first step (tests/helpers/sigterm_run.py), made once for
    tests/test_resume.py and tests/faults/test_sigterm_through_launch_script.py."""
    return _sigterm_run(quickstart_assets, tmp_path_factory.mktemp("sigterm"))


def _fresh_local_ray():
    """A fresh 2-CPU local Ray cluster in this process (any cluster an earlier test left is shut down first)."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    # Its workers start as forks of the session's fork server (tests/forkserver), with torch and vLLM imported.
    ray.init(address="local", num_cpus=2, include_dashboard=False, runtime_env=forked_runtime_env())
    return ray


@pytest.fixture
def local_ray():
    """A fresh 2-CPU local Ray cluster for one test."""
    ray = _fresh_local_ray()
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def module_local_ray():
    """One fresh 2-CPU local Ray cluster for a module's tests (starting one costs seconds)."""
    ray = _fresh_local_ray()
    yield ray
    ray.shutdown()


@pytest.fixture
def manager():
    """Build managers that are closed (their reward processes stopped) after the test."""
    built = []

    def build(cls, spec, kwargs=None, **options):
        m = cls(spec, kwargs, **options)
        built.append(m)
        return m

    yield build
    for m in built:
        m.close()


# ------------------------------------------------------------------ shared in-process vLLM engines
#
# tests/test_engine.py and tests/test_engine_interrupt.py build the very same tiny in-process engine; the
# fixture below builds it once for both. It is torn down as soon as the next test to run does not use it
# (after that test's own module fixtures are finalized), so it is never up while another module builds its
# own engine, as when each module built one; a later user would build it again. The tests that share it
# leave it idle, on the weights it started on, as they already did between the tests of one module.


class SharedEngine:
    """An engine built on first use from a context manager, closed by ``close`` (and built again if asked)."""

    def __init__(self, build):
        self._build, self._context, self._engine = build, None, None

    def get(self):
        if self._context is None:
            context = self._build()
            self._engine = context.__enter__()
            self._context = context
        return self._engine

    def close(self) -> None:
        context, self._context, self._engine = self._context, None, None
        if context is not None:
            context.__exit__(None, None, None)


_SHARED_ENGINES: dict[str, SharedEngine] = {}  # fixture name -> its engine


@pytest.fixture(scope="session")
def engine_tests_engine(tiny_assets) -> SharedEngine:
    """The engine of tests/test_engine.py and tests/test_engine_interrupt.py: the tiny model in float32, seed 3,
    max_model_len 512 (tests/helpers/agent_endpoint.py's tiny_engine)."""
    from helpers.agent_endpoint import tiny_engine
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(tiny_assets.model_dir)
    shared = _SHARED_ENGINES["engine_tests_engine"] = SharedEngine(
        lambda: tiny_engine(tiny_assets.model_dir, processor, 512, seed=3)
    )
    yield shared
    shared.close()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield  # the test's own fixtures (a module's fixtures over the engine among them) are finalized first
    for name, shared in _SHARED_ENGINES.items():
        if nextitem is None or name not in getattr(nextitem, "fixturenames", ()):
            shared.close()


def pytest_configure(config):
    # Collecting imports torch, transformers and vlmrl's modules: no full collection walks them while they grow.
    pause_full_collections()


def pytest_sessionfinish(session, exitstatus):
    # The Ray cluster the CLI runs joined (helpers/shared_cluster.py), if one was started.
    stop_shared_cluster()


SHARED_SESSION_FIXTURES = ("e2e_run", "sigterm_run", "engine_tests_engine")
"""Session fixtures that cost a real run or an engine each time they are built: the files that use one run on
one xdist worker, so that it is built once (scripts/test.sh runs the suite on two workers)."""


def pytest_collection_modifyitems(config, items):
    # scripts/test.sh runs ``--dist loadgroup``: an item goes to the worker of its group. A group is a file (so a
    # module fixture, often a whole CLI run, is built on one worker) joined with every other file that uses one of
    # the same SHARED_SESSION_FIXTURES. Without xdist the marks are inert.
    group_of = {}  # file -> its group's name (a union-find over files, rooted at a file)

    def root(path):
        while group_of.setdefault(path, path) != path:
            path = group_of[path]
        return path

    user_of: dict[str, str] = {}  # shared fixture -> the first file that uses it
    for item in items:
        path = item.nodeid.split("::")[0]
        for name in SHARED_SESSION_FIXTURES:
            if name in getattr(item, "fixturenames", ()):
                first = user_of.setdefault(name, path)
                group_of[root(path)] = root(first)
    for item in items:
        item.add_marker(pytest.mark.xdist_group(root(item.nodeid.split("::")[0])))


def pytest_collection_finish(session):
    # What collecting imported lives as long as pytest: frozen, the full collections the tests trigger do not
    # walk it again and again (vlmrl.heap).
    started()
