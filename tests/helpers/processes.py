"""A run's own processes, found from its driver's pid (for the fault tests that kill one of them)."""

from __future__ import annotations

from pathlib import Path


def alive(pid: int) -> bool:
    """Whether ``pid`` runs: it exists and is not a zombie (which has ended)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def descendants(root: int) -> list[int]:
    """Every process below ``root``, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _started(pid: int) -> int:
    """When ``pid`` started, in clock ticks since boot (field 22 of /proc/PID/stat); -1 once it is gone."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except OSError:
        return -1


def process_of(driver: int, *names: str) -> int | None:
    """The pid of the first process of the run started as ``driver`` whose command starts with one of ``names``
    (Ray names an actor's process ``ray::<Class>``), or None.

    The run's processes are those below ``driver`` and, for a run that joined the session's cluster with forked
    workers (helpers.runs.joined), the fork server's children started after ``driver``: tests run one at a time,
    so those are this run's."""
    from helpers.shared_cluster import forkserver_pid

    server, since = forkserver_pid(), _started(driver)
    forked = [p for p in descendants(server) if _started(p) >= since >= 0] if server is not None else []
    for pid in [*descendants(driver), *forked]:
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
        except OSError:
            continue
        if command.startswith(names):
            return pid
    return None
