"""One run per experiment directory and per checkpoint directory.

Two runs in one directory rename over and delete each other's checkpoints and
write into one ``metrics.jsonl`` and ``mlflow.db``. A run therefore holds
``<dir>/.vlmrl.lock`` for its whole life: a file created with ``O_EXCL``
holding the holder's pid, host and start time. A second run fails and names
the holder. A lock whose holder is gone is taken over, with a line naming it:

- on this host (a run killed with SIGKILL, or a host that rebooted): when its
  pid is dead or now belongs to another process, as ``/proc`` tells for certain;
- from another host (a job rescheduled onto another node): when its heartbeat
  stopped. The holder touches the lock file every ``HEARTBEAT_S`` seconds from
  a thread; a lock not touched for ``STALE_AFTER_S`` seconds is taken over. A
  run that finds a fresh remote lock watches it for up to that long: a beat
  means the holder is alive (the run fails at once), silence means it is gone.
  Ages are measured on the filesystem's clock (the lock file's mtime against a
  guard file touched just before), so clocks that differ between nodes do not
  matter. A lock written by an older vlmrl, which does not beat, is never
  taken over from another host; the message says how to remove it.

``O_EXCL`` is atomic on local filesystems and on NFSv3+; taking over a stale
lock is serialised with ``fcntl.flock`` on a guard file beside it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import threading
import time
from pathlib import Path

LOCK_FILE = ".vlmrl.lock"
HEARTBEAT_S = 10.0
"""How often the holder touches its lock file."""
STALE_AFTER_S = 60.0
"""A lock from another host not touched for this long is taken over."""


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


def _me(heartbeat_s: float) -> dict:
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "boot_id": _boot_id(),
        "start_time": _start_time(os.getpid()),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "heartbeat_s": heartbeat_s,
    }


def _same_holder(a: dict, b: dict) -> bool:
    return all(a.get(k) == b.get(k) for k in ("pid", "host", "start_time"))


def _holder_is_gone(holder: dict) -> bool:
    """On this host: True only when the holder is certainly not running (its process is not alive)."""
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


def _beats(holder: dict) -> bool:
    """A holder on another host that refreshes its lock (an older vlmrl's lock does not, and is never taken over)."""
    return holder.get("host") != socket.gethostname() and isinstance(holder.get("heartbeat_s"), (int, float))


class RunLock:
    """The exclusive lock of one directory; ``acquire`` / ``release``, or use as a context manager."""

    def __init__(
        self, directory: str | Path, what: str, heartbeat_s: float = HEARTBEAT_S, stale_after_s: float = STALE_AFTER_S
    ):
        self.directory = Path(directory)
        self.what = what
        self.path = self.directory / LOCK_FILE
        self.heartbeat_s = heartbeat_s
        self.stale_after_s = stale_after_s
        self.held = False
        self._stop = threading.Event()
        self._beating: threading.Thread | None = None

    def acquire(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        if self._create():
            return
        first_beat = None
        while True:
            with self._guard() as now:
                holder, beat = self._read_with_mtime()
                if holder is None or _holder_is_gone(holder):
                    self._take_over(f"a run that is gone ({_describe(holder or {})})")
                    return
                if not _beats(holder):
                    raise self._locked(holder, "If that run is gone (its host is down), remove the lock file.")
                age = now - beat
                if age > self.stale_after_s:
                    self._take_over(f"{_describe(holder)}, whose heartbeat stopped {age:.0f} s ago")
                    return
                if first_beat is None:
                    first_beat = beat
                    print(
                        f"run lock: {self.path} is held by {_describe(holder)}, last heartbeat {age:.0f} s ago; "
                        f"waiting up to {self.stale_after_s - age:.0f} s to see whether it is still alive",
                        flush=True,
                    )
                elif beat != first_beat:
                    raise self._locked(holder, f"It is alive: its heartbeat goes on (every {holder['heartbeat_s']} s).")
            time.sleep(min(1.0, self.heartbeat_s))

    def _locked(self, holder: dict, why: str) -> RunLocked:
        return RunLocked(
            f"{self.what} {self.directory} is in use by another vlmrl run ({_describe(holder)}; lock file "
            f"{self.path}). Wait for it to finish, stop it, or give this run another "
            f"trainer.experiment_name / trainer.save_checkpoint_path. {why}"
        )

    def _take_over(self, whose: str) -> None:
        print(f"run lock: taking over {self.path} from {whose}", flush=True)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        if not self._create():
            raise RunLocked(f"{self.what} {self.directory}: another run took the lock {self.path} at the same moment")

    def _create(self) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        self.me = _me(self.heartbeat_s)
        with os.fdopen(fd, "w") as f:
            json.dump(self.me, f)
            f.write("\n")
        self.held = True
        self._stop.clear()
        self._beating = threading.Thread(target=self._beat, name="vlmrl-run-lock", daemon=True)
        self._beating.start()
        return True

    def _beat(self) -> None:
        """Touch the lock file every ``heartbeat_s`` while it is ours; say so once if another run took it."""
        while not self._stop.wait(self.heartbeat_s):
            holder = self._read()
            if holder is None or not _same_holder(holder, self.me):
                now = _describe(holder or {})
                print(f"run lock: WARNING: {self.path} is no longer this run's (now {now})", flush=True)
                return
            with contextlib.suppress(OSError):  # a filesystem hiccup: the next beat tries again
                os.utime(self.path)

    def _read(self) -> dict | None:
        return self._read_with_mtime()[0]

    def _read_with_mtime(self) -> tuple[dict | None, float]:
        """The holder and the lock file's mtime, read through one open file (fresh attributes on NFS too)."""
        try:
            with open(self.path) as f:
                mtime = os.fstat(f.fileno()).st_mtime
                text = f.read()
        except FileNotFoundError:
            return None, 0.0
        except OSError:
            return {"pid": None, "host": None, "started": "(unreadable lock file)"}, 0.0
        try:
            holder = json.loads(text)
        except ValueError:
            holder = None
        if not isinstance(holder, dict):
            holder = {"pid": None, "host": None, "started": "(unreadable lock file)"}
        return holder, mtime

    @contextlib.contextmanager
    def _guard(self):
        """Hold the guard file's flock; yields the filesystem's time now (the guard touched and read back)."""
        with open(self.directory / (LOCK_FILE + ".guard"), "a") as guard:
            fcntl.flock(guard, fcntl.LOCK_EX)
            try:
                os.utime(guard.fileno())
                yield os.fstat(guard.fileno()).st_mtime
            finally:
                fcntl.flock(guard, fcntl.LOCK_UN)

    def release(self) -> None:
        if not self.held:
            return
        self._stop.set()
        if self._beating is not None:
            self._beating.join()
            self._beating = None
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
