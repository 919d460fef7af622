"""What the terminal shows during a run: vlmrl's own lines and a progress bar; the engines' logs go to a file.

A run has several processes (the driver, the Runner, the workers with their
vLLM engines, the reward actors), and Ray forwards every line any of them
writes to the driver's terminal, each prefixed with its process. Most of those
lines are vLLM's, torch's, transformers' and datasets' start-up and per-step
chatter. So, unless ``trainer.verbose`` is set:

* Every Ray worker process of the run starts with its stdout and stderr (file
  descriptors 1 and 2, so C-level writes too) pointing at
  ``<experiment dir>/run.log`` (``process_setup``, which Ray runs in each
  worker process before anything is imported there, as the job's
  ``worker_process_setup_hook``). The file keeps the engines' logs in full.
* The Runner's own lines (logger ``vlmrl``: the plan, the data, each step,
  validations, checkpoints, the summary) are queued by a ``ConsoleFeed``; the
  driver fetches them twice a second (``Runner.take_console``) and prints them
  above a progress bar it draws itself (``ConsoleView``), so no other process
  writes between the bar's redraws.
* Warnings and errors of vlmrl's loggers in the other processes (a reward
  function that timed out, say) are written to the stream Ray forwards, so
  they still reach the terminal, with Ray's process prefix.

With ``trainer.verbose=true`` each process writes to the log file and to its
own stream, so Ray shows everything on the terminal as it used to; the bar is
then left out, since Ray's lines would tear it.
"""

from __future__ import annotations

import atexit
import io
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass

from vlmrl.heap import pause_full_collections
from vlmrl.malloc import keep_freed_memory

LOG_FILE = "run.log"
"""The engines' logs, in the experiment dir."""

_FORWARD_HANDLER = "vlmrl-forward"

RUN_LOG_ENV, VERBOSE_ENV, RUN_DIR_ENV = "VLMRL_RUN_LOG", "VLMRL_VERBOSE", "VLMRL_RUN_DIR"
"""How the driver tells each worker process (through the job's runtime_env) where to log, how, and which directory
the run's relative paths are read from."""


def runtime_env(log_path: str, verbose: bool) -> dict:
    """The job's runtime_env: every worker process runs ``process_setup`` first, with these settings."""
    return {
        "worker_process_setup_hook": f"{__name__}.process_setup",
        "env_vars": {RUN_LOG_ENV: log_path, VERBOSE_ENV: "1" if verbose else "0", RUN_DIR_ENV: os.getcwd()},
    }


def quiet_ray_notices() -> None:
    """In the driver: drop Ray's notice that the local cluster it starts uses token authentication.

    Ray 2.60 logs it as a warning at every ``ray.init`` that starts a cluster;
    it reports the safe default (docs: the trust boundary), not a problem. Ray's
    other warnings still show.
    """
    logging.getLogger("ray._private.authentication.authentication_token_setup").addFilter(
        lambda record: not record.getMessage().startswith("Token authentication is enabled")
    )


def process_setup() -> None:
    """Point this process's stdout and stderr at the run's log file (and, verbose, at their old targets too),
    pause full garbage collections while it starts, and keep freed memory for reuse.

    Runs in each Ray worker process of the run (``worker_process_setup_hook``),
    before the process imports torch or vLLM, so their import-time warnings
    land in the file as well.
    """
    # Before the process imports torch, vLLM and the models: see vlmrl.heap. The heavy actors end the pause
    # when they have started (``started``), the others after ``PAUSE_S``.
    pause_full_collections()
    # Before the first large allocation: the passes' freed activations are reused, not faulted in again (vlmrl.malloc).
    keep_freed_memory()
    # Ray starts a worker in the directory its raylet was started in: for a cluster that ``ray start`` made
    # elsewhere, not the driver's. The run's relative paths (data, tools, templates, reward files) are the driver's.
    run_dir = os.environ.get(RUN_DIR_ENV)
    if run_dir and os.path.isdir(run_dir):  # a node without the directory keeps Ray's
        os.chdir(run_dir)
    log_path, verbose = os.environ.get(RUN_LOG_ENV), os.environ.get(VERBOSE_ENV) == "1"
    if not log_path:
        return
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    forwarded = os.dup(2)  # the stream Ray forwards to the driver
    for target in (1, 2):
        if verbose:
            _tee(target, fd)
        else:
            os.dup2(fd, target)
    os.write(fd, f"==== process {os.getpid()} started {time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode())
    # vlmrl's own records: all of them to the file; warnings and errors to the terminal too.
    root = logging.getLogger("vlmrl")
    root.setLevel(logging.INFO)
    to_file = logging.StreamHandler(sys.stderr)
    to_file.setFormatter(logging.Formatter("%(asctime)s vlmrl %(levelname)s %(name)s: %(message)s"))
    root.addHandler(to_file)
    if not verbose:  # verbose: the file handler's lines reach the terminal through the tee already
        forward = logging.StreamHandler(os.fdopen(forwarded, "w", buffering=1, closefd=False))
        forward.set_name(_FORWARD_HANDLER)
        forward.setLevel(logging.WARNING)
        forward.setFormatter(logging.Formatter("vlmrl %(levelname)s: %(message)s"))
        root.addHandler(forward)
    root.propagate = False


def _tee(target: int, fd: int) -> None:
    """Send what is written to ``target`` to ``fd`` and to where ``target`` pointed before."""
    original = os.dup(target)
    read_end, write_end = os.pipe()
    os.dup2(write_end, target)
    os.close(write_end)

    def pump() -> None:
        while chunk := os.read(read_end, 65536):
            os.write(fd, chunk)
            os.write(original, chunk)

    thread = threading.Thread(target=pump, name=f"vlmrl-tee-{target}", daemon=True)
    thread.start()

    def drain() -> None:
        # At exit: put the old target back, which closes this process's write end, and let the pump finish.
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os.dup2(original, target)
        thread.join(timeout=2.0)

    atexit.register(drain)


@dataclass(frozen=True)
class Progress:
    """Where the step loop stands: ``done`` of ``total`` steps, having started at ``start``."""

    done: int
    total: int
    start: int


class ConsoleFeed(logging.Handler):
    """In the Runner: queues vlmrl's lines and the loop's progress for the driver to print.

    vlmrl's lines are what the Runner prints (the step lines, checkpoints, the
    summary, ...) and the records of logger ``vlmrl`` at INFO and up. Both are
    also written to the log file, so it holds the whole run.
    """

    def __init__(self):
        super().__init__(logging.INFO)
        self.setFormatter(logging.Formatter("%(message)s"))
        self.lines: list[str | Progress] = []
        """The lines not yet taken, and the loop's first progress where it came among them."""
        self.progress: Progress | None = None
        self.guard = threading.Lock()

    @classmethod
    def install(cls) -> ConsoleFeed:
        """Take over this process's ``sys.stdout`` and logger ``vlmrl`` (no longer forwarded by Ray)."""
        feed = cls()
        root = logging.getLogger("vlmrl")
        root.setLevel(logging.INFO)
        for handler in list(root.handlers):
            if handler.get_name() == _FORWARD_HANDLER:
                root.removeHandler(handler)
        root.addHandler(feed)
        root.propagate = False
        sys.stdout = _LineStream(feed, sys.stdout)
        return feed

    def emit(self, record: logging.LogRecord) -> None:
        progress = getattr(record, "vlmrl_progress", None)
        if progress is not None:
            with self.guard:
                if self.progress is None:  # the loop's start, in order with the lines around it
                    self.lines.append(progress)
                self.progress = progress
            return
        text = self.format(record)
        if record.levelno >= logging.WARNING:
            text = f"{record.levelname.lower()}: {text}"
        self.add(text)

    def add(self, line: str) -> None:
        with self.guard:
            self.lines.append(line)

    def take(self) -> tuple[list[str | Progress], Progress | None]:
        """The lines since the last call (with the loop's start among them), and the latest progress."""
        with self.guard:
            lines, self.lines = self.lines, []
            return lines, self.progress


class _LineStream(io.TextIOBase):
    """A ``sys.stdout`` that hands each complete line to the feed and writes everything on to ``through``."""

    def __init__(self, feed: ConsoleFeed, through):
        self.feed, self.through, self.partial = feed, through, ""

    def write(self, text: str) -> int:
        self.through.write(text)
        *lines, self.partial = (self.partial + text).split("\n")
        for line in lines:
            if not line.startswith(_RAY_MARKERS):
                self.feed.add(line)
        return len(text)

    def flush(self) -> None:
        self.through.flush()

    def isatty(self) -> bool:
        return False


# Ray writes these to a worker's output at each task to name it in the forwarded logs.
_RAY_MARKERS = (":actor_name:", ":task_name:", ":job_id:")


def report_progress(done: int, total: int, start: int) -> None:
    """Tell the console the loop has finished ``done`` of ``total`` steps (it started at ``start``)."""
    # A record of logger vlmrl (INFO, so it passes the level the Runner sets): the feed keeps it as the progress.
    logging.getLogger("vlmrl.progress").info(
        "training: %d of %d steps done", done, total, extra={"vlmrl_progress": Progress(done, total, start)}
    )


class ConsoleView:
    """In the driver: prints the Runner's lines and draws the progress bar below them.

    The bar (with its ETA) is drawn only on a terminal and not in verbose mode;
    otherwise the run's start is one line and the step lines say the rest.
    """

    def __init__(self, verbose: bool, stream=None):
        self.stream = stream or sys.stderr
        self.draw_bar = not verbose and self.stream.isatty()
        self.bar = None

    def show(self, lines: list[str | Progress], progress: Progress | None) -> None:
        for line in lines:
            if isinstance(line, Progress):
                self._start(line)
            elif self.bar is not None:
                self.bar.write(line, file=sys.stdout)
            else:
                print(line, flush=True)
        if progress is not None and self.bar is not None and progress.done > self.bar.n:
            self.bar.update(progress.done - self.bar.n)

    def _start(self, progress: Progress) -> None:
        resumed = f" (resumed at step {progress.start})" if progress.start else ""
        if self.draw_bar:
            from tqdm import tqdm

            self.bar = tqdm(
                total=progress.total, initial=progress.start, desc=f"training{resumed}",
                unit="step", file=self.stream, dynamic_ncols=True,
            )  # fmt: skip
        else:
            print(f"training{resumed}: steps {progress.start + 1} to {progress.total}", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
