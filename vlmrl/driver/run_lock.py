"""One run per experiment directory and per checkpoint directory.

Two runs in one directory rename over and delete each other's checkpoints and
write into one ``metrics.jsonl`` and ``mlflow.db``. A run therefore holds
``<dir>/.vlmrl.lock`` for its whole life: a file created with ``O_EXCL``
holding the holder's pid, host and start time. A second run fails at once and
names the holder. A lock whose holder is gone (a run killed with SIGKILL, or a
host that rebooted) is taken over when that can be told for certain: the
holder was on this host and its pid is dead or now belongs to another process.
A lock held from another host is never taken over; the message says how to
remove it once that run is known to be gone.

``O_EXCL`` is atomic on local filesystems and on NFSv3+; taking over a stale
lock is serialised with ``fcntl.flock`` on a guard file beside it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from pathlib import Path

LOCK_FILE = ".vlmrl.lock"


class RunLocked(RuntimeError):
    """Another live run holds the directory."""


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux), to tell a reused pid apart."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses; the fields after it are plain.
    return stat.rsplit(")", 1)[1].split()[19]


def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def _me() -> dict:
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "boot_id": _boot_id(),
        "start_time": _start_time(os.getpid()),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


def _holder_is_gone(holder: dict) -> bool:
    """True only when the holder is certainly not running: same host, and its process is not alive."""
    if holder.get("host") != socket.gethostname():
        return False
    if holder.get("boot_id") and _boot_id() and holder["boot_id"] != _boot_id():
        return True  # the host rebooted since
    pid = holder.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass  # alive, another user's
    started = holder.get("start_time")
    return started is not None and _start_time(pid) not in (None, started)  # the pid was reused


def _describe(holder: dict) -> str:
    return f"pid {holder.get('pid')} on host {holder.get('host')}, started {holder.get('started')}"


class RunLock:
    """The exclusive lock of one directory; ``acquire`` / ``release``, or use as a context manager."""

    def __init__(self, directory: str | Path, what: str):
        self.directory = Path(directory)
        self.what = what
        self.path = self.directory / LOCK_FILE
        self.held = False

    def acquire(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        if self._create():
            return
        with self._guard():
            holder = self._read()
            if holder is not None and not _holder_is_gone(holder):
                raise RunLocked(
                    f"{self.what} {self.directory} is in use by another vlmrl run ({_describe(holder)}; lock file "
                    f"{self.path}). Wait for it to finish, stop it, or give this run another "
                    "trainer.experiment_name / trainer.save_checkpoint_path. If that run is gone (its host is down), "
                    "remove the lock file."
                )
            print(f"run lock: taking over {self.path} from a run that is gone ({_describe(holder or {})})", flush=True)
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
            if not self._create():
                raise RunLocked(f"{self.what} {self.directory}: another run took the lock {self.path} at the same moment")

    def _create(self) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            json.dump(_me(), f)
            f.write("\n")
        self.held = True
        return True

    def _read(self) -> dict | None:
        try:
            return json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {"pid": None, "host": None, "started": "(unreadable lock file)"}

    @contextlib.contextmanager
    def _guard(self):
        with open(self.directory / (LOCK_FILE + ".guard"), "a") as guard:
            fcntl.flock(guard, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(guard, fcntl.LOCK_UN)

    def release(self) -> None:
        if not self.held:
            return
        holder = self._read()
        if holder is not None and holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
        self.held = False

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


@contextlib.contextmanager
def run_locks(experiment_dir: str | Path, checkpoint_dir: str | Path):
    """Hold the experiment directory's lock, and the checkpoint directory's when it lies elsewhere."""
    experiment_dir, checkpoint_dir = Path(experiment_dir).resolve(), Path(checkpoint_dir).resolve()
    with contextlib.ExitStack() as stack:
        stack.enter_context(RunLock(experiment_dir, "experiment directory"))
        if not checkpoint_dir.is_relative_to(experiment_dir):
            stack.enter_context(RunLock(checkpoint_dir, "checkpoint directory"))
        yield
