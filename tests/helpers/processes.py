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


def process_of(driver: int, *names: str) -> int | None:
    """The pid of the first process below ``driver`` whose command starts with one of ``names`` (Ray names an
    actor's process ``ray::<Class>``), or None."""
    for pid in descendants(driver):
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
        except OSError:
            continue
        if command.startswith(names):
            return pid
    return None
