"""A new user's first runs: what the console shows, and the small traps around it (issue 23).

The console of a real CLI run of the quickstart (the session's shared run, tests/conftest.py's ``e2e_run``:
4 steps, validating before and after), then the same command again on a copy of its directory, which has
nothing left to train. The rest are unit tests of the pieces: the reward kwargs checked at validation,
``key=null`` / ``key={}`` replacing a YAML mapping, the usage line, ``--help KEY_PREFIX``, the console feed and
the filter on vLLM's reload warning. (That the rendezvous dir goes when a run ends: tests/test_lr_schedule_run.py,
whose runs have names of their own.)
"""

from __future__ import annotations

import io
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.runs import E2E_API_KEY, E2E_STEPS, REPO, experiment_dir, run_command, tail

from vlmrl.config import ConfigError
from vlmrl.config.help import help_text
from vlmrl.config.loading import parse
from vlmrl.driver.console import ConsoleFeed, ConsoleView, Progress, report_progress
from vlmrl.driver.runner import _finished_line
from vlmrl.rollout.engine.vllm import _weightless_reload_warning
from vlmrl.validate import load_config

QUICKSTART = "config=examples/quickstart.yaml"

# What the console showed before (issue 23): engine loaders, vLLM's per-step INFO lines,
# torch deprecations, torchdata's set_vital, HF progress bars, and Ray's worker prefixes.
NOISE = [
    "Failed to load weights",
    "Loading weights",
    "Reloading and processing weights",
    "Successfully reset prefix cache",
    "Loading safetensors checkpoint shards",
    "is deprecated",
    "set_vital",
    "Generating train split",
    "pid=",  # Ray's "(HybridWorker pid=...)" prefix
    "INFO ",
]


@pytest.fixture(scope="module")
def quickstart_run(e2e_run, tmp_path_factory):
    """The shared quickstart run, and its command run again on a copy of its directory."""
    out = tmp_path_factory.mktemp("console") / "outputs"
    shutil.copytree(e2e_run.dir, experiment_dir(out, "e2e"))
    args = [a for a in e2e_run.args if not a.startswith("trainer.output_dir=")] + [f"trainer.output_dir={out}"]
    # The key the run's config was fingerprinted with, so that its checkpoint is this command's to resume.
    again = run_command([sys.executable, "-m", "vlmrl.main", *args], env={"VLMRL_E2E_API_KEY": E2E_API_KEY})
    return e2e_run, again


def test_the_console_shows_the_run_and_not_the_engines(quickstart_run):
    run, _ = quickstart_run
    console = run.log
    for noise in NOISE:
        assert noise not in console, f"{noise!r} on the console:\n{console}"
    lines = console.splitlines()
    assert any(line.startswith("plan:") for line in lines), console
    assert "data: 1024 training prompts, 256 steps per epoch of 4; 128 validation prompts" in lines, console
    assert any(line.startswith("step 1 | reward ") for line in lines), console
    assert any(line.startswith(f"step {E2E_STEPS} | reward ") for line in lines), console
    assert any(line.startswith("checkpoint: saved ") for line in lines), console
    assert any(line.startswith(f"run summary: {E2E_STEPS} steps in ") for line in lines), console
    # The run's validation metrics from before training to the end (the e2e run's reward reports "overall").
    assert any(line.startswith("  val overall: ") and "(step 0) ->" in line for line in lines), console
    # Not a terminal: no bar, one line for the training's start instead.
    assert f"training: steps 1 to {E2E_STEPS}" in lines, console
    assert len(lines) < 40, console  # was about 470 for the full quickstart


def test_the_engines_logs_are_kept_in_full_in_the_experiment_dir(quickstart_run):
    run, _ = quickstart_run
    log = (run.dir / "run.log").read_text()
    # vLLM's start-up and per-resync lines, torch's warnings and the Runner's own lines are all there.
    assert "Initializing a V1 LLM engine" in log
    assert "Reloading and processing weights" in log
    assert "step 1 | reward " in log
    # ... but not vLLM's warning about its weightless layers (see vlmrl/rollout/engine/vllm.py).
    assert "Failed to load weights" not in log


def test_a_finished_checkpoint_says_there_is_nothing_to_train(quickstart_run):
    _, again = quickstart_run
    assert again.returncode == 0, tail(again)
    console = again.stdout + again.stderr
    line = (
        f"nothing to train: the checkpoint at step {E2E_STEPS} is at max_steps={E2E_STEPS}; remove it or pick "
        "another experiment_name"
    )
    assert line in console, console
    assert "run summary" not in console and "step 1 |" not in console and "perf:" not in console, console


def test_finished_line_names_the_limit_the_checkpoint_is_past():
    config = load_config([QUICKSTART, "trainer.max_steps=2"])
    assert _finished_line(1, 64, config) is None
    assert _finished_line(64, 64, config) == (
        "nothing to train: the checkpoint at step 64 is past max_steps=2; remove it or pick another "
        "experiment_name (or raise trainer.max_steps to train further)"
    )
    epochs = load_config([QUICKSTART])
    assert _finished_line(63, 64, epochs) is None
    assert _finished_line(64, 64, epochs).startswith(
        "nothing to train: the checkpoint at step 64 is at the 64 steps of total_epochs=1;"
    )


# ------------------------------------------------------------------ reward kwargs


def _reward_file(tmp_path: Path) -> str:
    (tmp_path / "plain.py").write_text("def compute_score(reward_input):\n    return {'overall': 0.0}\n")
    return f"worker.reward.reward_function={tmp_path / 'plain.py'}:compute_score"


def test_reward_kwargs_that_do_not_fit_the_function_fail_validation_with_the_fix(tmp_path):
    # The quickstart's format_weight: 0.0 follows a swapped-in function that takes no such argument.
    with pytest.raises(ConfigError) as e:
        load_config([QUICKSTART, _reward_file(tmp_path)])
    (problem,) = [p for p in e.value.problems if "reward_function_kwargs" in p]
    assert "{'format_weight': 0.0} do not fit" in problem and "compute_score(reward_input)" in problem
    assert "unexpected keyword argument 'format_weight'" in problem
    assert "worker.reward.reward_function_kwargs=null" in problem


@pytest.mark.parametrize("empty", ["null", "{}"])
def test_null_or_empty_mapping_on_the_command_line_replaces_the_yaml_kwargs(tmp_path, empty):
    config = load_config([QUICKSTART, _reward_file(tmp_path), f"worker.reward.reward_function_kwargs={empty}"])
    assert config.worker.reward.reward_function_kwargs == {}


def test_a_mapping_on_the_command_line_still_merges_into_the_yaml():
    config, problems = parse([QUICKSTART, "worker.reward.reward_function_kwargs={extra: 1}"])
    assert problems == []
    assert config.worker.reward.reward_function_kwargs == {"format_weight": 0.0, "extra": 1}


def test_a_non_mapping_value_names_the_way_to_empty_it():
    _, problems = parse([QUICKSTART, "worker.reward.reward_function_kwargs=5"])
    assert problems == [
        "worker.reward.reward_function_kwargs: expected a mapping, got 5; to drop the YAML's entries, pass "
        "worker.reward.reward_function_kwargs=null (or worker.reward.reward_function_kwargs={}) on the command line"
    ]


# ------------------------------------------------------------------ usage and --help


def _main(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "vlmrl.main", *args], cwd=REPO, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("args", [[], ["config=examples/no_such.yaml"]])
def test_no_arguments_or_a_missing_config_print_the_usage_and_the_two_commands(args):
    proc = _main(*args)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.splitlines()[-4].startswith("usage: python -m vlmrl.main config=<yaml>")
    assert "python -m vlmrl.main config=examples/quickstart.yaml" in proc.stderr
    assert "bash scripts/test.sh" in proc.stderr
    if args:
        assert proc.stderr.startswith("vlmrl: config=examples/no_such.yaml: no such file\n")


def test_help_with_a_prefix_shows_only_that_section():
    text = help_text("worker.rollout")
    keys = [line.split()[0] for line in text.splitlines() if line.startswith(("  worker.", "  trainer.", "  data."))]
    assert keys and all(k.startswith("worker.rollout.") for k in keys)
    assert "worker.rollout.temperature" in keys
    assert len(text) < len(help_text()) / 3
    assert help_text("worker.rollout.temperature").count("\n  worker.") == 1  # one key
    assert "sections:" in help_text("worker.rollot") and "worker.rollout" in help_text("worker.rollot")
    assert _main("--help", "trainer.save").stdout.count("\n  trainer.save") >= 3


# ------------------------------------------------------------------ the pieces of the console


def test_the_feed_queues_printed_lines_logger_records_and_progress(monkeypatch):
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    root = logging.getLogger("vlmrl")
    before = (list(root.handlers), root.level, root.propagate)
    feed = ConsoleFeed.install()
    try:
        print("step 1 | reward 0.5")
        print(":actor_name:Runner")  # Ray's marker, not a line of the run
        logging.getLogger("vlmrl.data.dataset").warning("data: skipped bad row (1 so far): %s", "row 7")
        logging.getLogger("vlmrl.data.dataset").debug("not shown")
        report_progress(3, 64, 2)
        report_progress(4, 64, 2)
        lines, progress = feed.take()
        # The loop's start comes in order with the lines; later progress only as the latest.
        assert lines == ["step 1 | reward 0.5", "warning: data: skipped bad row (1 so far): row 7", Progress(3, 64, 2)]
        assert progress == Progress(4, 64, 2)
        assert feed.take() == ([], Progress(4, 64, 2))
        assert "step 1 | reward 0.5\n" in sys.stdout.through.getvalue()  # the log file gets the lines too
    finally:
        root.handlers[:], root.level, root.propagate = before


def test_the_view_without_a_terminal_prints_the_lines_and_one_line_for_the_start(capsys):
    view = ConsoleView(verbose=False, stream=io.StringIO())
    view.show(["plan: ..."], None)
    view.show([Progress(2, 64, 2), "step 3 | reward 0.1"], Progress(3, 64, 2))
    view.show([], Progress(4, 64, 2))
    view.close()
    assert capsys.readouterr().out == "plan: ...\ntraining (resumed at step 2): steps 3 to 64\nstep 3 | reward 0.1\n"


def _record(msg: str, *args) -> logging.LogRecord:
    name = "vllm.model_executor.model_loader.reload.layerwise"
    return logging.LogRecord(name, logging.WARNING, "", 0, msg, args, None)


def test_only_vllms_failed_to_load_warning_for_weightless_layers_is_dropped():
    for layer in ("RotaryEmbedding", "MRotaryEmbedding", "FusedMMInputNorm"):
        assert not _weightless_reload_warning(_record("%s: Failed to load weights", layer))
    # A layer with real weights that got none is news, and so is every other warning.
    assert _weightless_reload_warning(_record("%s: Failed to load weights", "QKVParallelLinear"))
    assert _weightless_reload_warning(_record("Allocating %.1f MB of device memory", 3.0))



_SETUP = """
import logging, os, sys
from vlmrl.driver.console import process_setup
process_setup()
print("python print", flush=True)
os.write(1, b"c-level write\\n")
logging.getLogger("vlmrl.reward.manager").warning("reward: 1 sample(s) of 2 scored 0")
logging.getLogger("vlmrl.x").info("info line")
"""


@pytest.mark.parametrize("verbose", [False, True])
def test_process_setup_sends_a_process_output_to_the_log_and_vlmrl_warnings_to_the_terminal(tmp_path, verbose):
    """What Ray runs first in each worker process: its output to run.log; verbose, to the terminal too."""
    log = tmp_path / "run.log"
    env = {**os.environ, "VLMRL_RUN_LOG": str(log), "VLMRL_VERBOSE": "1" if verbose else "0"}
    proc = subprocess.run([sys.executable, "-c", _SETUP], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    written = log.read_text()
    for line in ("python print", "c-level write", "reward: 1 sample(s) of 2 scored 0", "info line"):
        assert line in written
    terminal = proc.stdout + proc.stderr
    if verbose:
        assert "python print" in proc.stdout and "c-level write" in proc.stdout and "info line" in terminal
    else:
        # Only vlmrl's warning reaches the stream Ray forwards to the driver.
        assert proc.stdout == ""
        assert proc.stderr == "vlmrl WARNING: reward: 1 sample(s) of 2 scored 0\n"


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_view_on_a_terminal_draws_a_bar_with_its_eta_below_the_lines(capsys):
    terminal = _Terminal()
    view = ConsoleView(verbose=False, stream=terminal)
    view.show([Progress(0, 4, 0)], Progress(0, 4, 0))
    for step in range(1, 5):
        view.show([f"step {step} | reward 0.5"], Progress(step, 4, 0))
    view.close()
    assert capsys.readouterr().out.splitlines() == [f"step {s} | reward 0.5" for s in range(1, 5)]
    assert re.search(r"training: 100%.*4/4 \[\d\d:\d\d<00:00", terminal.getvalue())  # the bar's last state, with its ETA
    assert ConsoleView(verbose=True, stream=_Terminal()).draw_bar is False  # verbose: Ray's lines would tear it
