"""Running ``python -m vlmrl.main`` on the tiny quickstart from a test, as a user would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from helpers.shared_cluster import FORKSERVER, FORKSERVER_DIR, join_env

REPO = Path(__file__).resolve().parents[2]

# A step of the quickstart cut down to seconds: 2 prompts x 2 samples x 8 tokens, no validation.
SMALL = [
    "data.rollout_batch_size=2",
    "data.max_response_length=8",
    "worker.actor.global_batch_size=2",
    "worker.actor.micro_batch_size_per_device_for_update=4",
    "worker.rollout.n=2",
    "data.val_files=",
    "trainer.val_before_train=false",
]


TEST_LOGGERS = "trainer.logger=[console,file]"
"""The loggers of a test run that names none: the quickstart's without MLflow, whose import and new store cost a
run seconds of CPU. The runs that check MLflow (the e2e run, the resume and SIGTERM runs) name it."""


def main_command(output_dir: Path, *overrides: str, experiment: str = "run") -> list[str]:
    return [
        sys.executable, "-m", "vlmrl.main", "config=examples/quickstart.yaml", TEST_LOGGERS,
        f"trainer.output_dir={output_dir}", f"trainer.experiment_name={experiment}", *overrides,
    ]  # fmt: skip


def run_main(
    output_dir: Path,
    *overrides: str,
    experiment: str = "run",
    env: dict | None = None,
    timeout: int = 600,
    crash_in_save_at: int | None = None,
    own_cluster: bool = False,
    forked: bool = True,
):
    """Run to completion; return the CompletedProcess (the caller checks returncode).

    A user's MLFLOW_TRACKING_URI is dropped: test runs use their embedded store.
    ``crash_in_save_at``: kill the run in the middle of saving that step (tests/helpers/crash_in_save.py).
    ``own_cluster``, ``forked``: see ``run_command``.
    """
    command = main_command(output_dir, *overrides, experiment=experiment)
    if crash_in_save_at is not None:
        command = [sys.executable, str(REPO / "tests" / "helpers" / "crash_in_save.py"), str(crash_in_save_at)]
        command += main_command(output_dir, *overrides, experiment=experiment)[3:]
    return run_command(command, env=env, timeout=timeout, own_cluster=own_cluster, forked=forked)


def run_command(
    command: list[str],
    env: dict | None = None,
    timeout: int = 600,
    own_cluster: bool = False,
    forked: bool = True,
    cwd: Path = REPO,
) -> subprocess.CompletedProcess:
    """Run ``command`` in the repository to completion, without a user's MLFLOW_TRACKING_URI (test runs use
    their embedded store); the caller checks returncode.

    The run joins the test session's Ray cluster (helpers/shared_cluster.py) unless ``own_cluster`` (or ``env``
    names a RAY_ADDRESS): a run whose test is about starting a cluster, or about signals, process groups and the
    driver's own session, which only a run that starts its own cluster has, must say ``own_cluster=True``.
    A run that joins starts its driver (a Python command) and its Ray workers as forks of the session's fork server
    (tests/forkserver), with torch, transformers and vLLM imported, unless ``forked`` is false: a run whose test reads
    what a cold start prints (the console's) says ``forked=False``.
    """
    command, full_env = joined(command, env, own_cluster=own_cluster, forked=forked)
    return subprocess.run(command, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)


def joined(
    command: list[str], env: dict | None = None, own_cluster: bool = False, forked: bool = True
) -> tuple[list[str], dict[str, str]]:
    """The command and full environment that ``run_command`` starts (see there), for a test that starts the run
    with ``subprocess.Popen`` to act on it while it runs."""
    base = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    if not own_cluster and "RAY_ADDRESS" not in (env or {}):
        base.update(join_env(forked))
        if FORKSERVER_DIR in base and command[0] == sys.executable:
            command = [sys.executable, str(FORKSERVER), "--connect", base[FORKSERVER_DIR], *command[1:]]
    return command, {**base, **(env or {})}


def experiment_dir(output_dir: Path, experiment: str = "run") -> Path:
    return output_dir / "vlmrl" / experiment


def read_metrics(output_dir: Path, experiment: str = "run") -> list[dict]:
    path = experiment_dir(output_dir, experiment) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def tail(proc: subprocess.CompletedProcess) -> str:
    return f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-8000:]}"


# Graded, not exact-match, so that a random policy's groups have reward variance
# and the update has a gradient from the first step. Every call is appended to
# log_path so tests can see what the function was given.
LOGGING_REWARD = textwrap.dedent(
    """
    import json

    def compute_score(reward_input, log_path, **quickstart_kwargs):
        with open(log_path, "a") as f:
            f.write(json.dumps({"response": reward_input["response"],
                                "ground_truth": reward_input["ground_truth"]}) + "\\n")
        response, truth = reward_input["response"].lower(), reward_input["ground_truth"].lower()
        overlap = len(set(response) & set(truth)) / len(set(truth))
        return {"overall": overlap, "overlap": overlap}
    """
)

E2E_STEPS = 4
E2E_PROMPTS = 4
E2E_N = 4
E2E_SAMPLES_LOGGED = 2
E2E_API_KEY = "sk-e2e-5f1c0ffee0ddba11"
"""The shared run's reward kwarg ``api_key``, from the environment: nothing the run writes may hold it."""
# The training settings of the shared run; a run that must repeat its training
# (the resume tests) uses exactly these.
E2E_TRAINING = [
    f"trainer.max_steps={E2E_STEPS}",
    f"data.rollout_batch_size={E2E_PROMPTS}",
    f"worker.actor.global_batch_size={E2E_PROMPTS}",
    "worker.actor.micro_batch_size_per_device_for_update=8",
    f"worker.rollout.n={E2E_N}",
    # vLLM's log-probs too, for the rollout-vs-actor mismatch metric and the logged generations.
    "worker.rollout.calculate_log_probs=true",
]


def logging_reward(tmp: Path) -> list[str]:
    """Overrides that plug in the logging reward, writing its calls to tmp/reward_calls.jsonl."""
    (tmp / "reward.py").write_text(LOGGING_REWARD)
    return [
        f"worker.reward.reward_function={tmp / 'reward.py'}:compute_score",
        f"worker.reward.reward_function_kwargs.log_path={tmp / 'reward_calls.jsonl'}",
    ]
