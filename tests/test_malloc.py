"""vlmrl.malloc: a process keeps the memory it frees and reuses it, rather than faulting it in again."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import textwrap

import pytest

from vlmrl.driver.console import RUN_LOG_ENV

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the settings are glibc's malloc's")

# A pass in miniature: ten 8 MiB blocks (pages touched) allocated and freed, three times over, in a fresh process.
# With glibc's defaults the first round maps each block on its own; freeing one slides the mmap threshold up to
# 8 MiB and the trim threshold to 16 MiB, so later rounds take the blocks from the heap, but freeing all ten
# leaves 80 MiB free at its top, more than 16 MiB, and it is trimmed: the third round faults its 20,480 pages
# (80 MiB / 4 KiB) in again. Kept, the third round reuses them and faults almost none.
SCRIPT = textwrap.dedent(
    """
    import ctypes, json, resource, sys

    how = sys.argv[1]
    if how == "keep":
        from vlmrl.malloc import keep_freed_memory
        assert keep_freed_memory()
    elif how == "setup":
        from vlmrl.driver.console import process_setup
        process_setup()
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    size = 8 << 20
    faults = []
    for _ in range(3):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        blocks = [libc.malloc(size) for _ in range(10)]
        for b in blocks:
            ctypes.memset(b, 1, size)
        for b in blocks:
            libc.free(b)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    print(json.dumps(faults))
    """
)

PAGES = 10 * (8 << 20) // 4096  # 20,480


def _faults(how: str) -> list[int]:
    """Page faults of each round in a fresh process: ``none`` (glibc's defaults), ``keep`` (keep_freed_memory) or
    ``setup`` (the run's worker set-up, writing to no log: RUN_LOG_ENV unset)."""
    env = {k: v for k, v in os.environ.items() if k != RUN_LOG_ENV and not k.startswith("MALLOC_")}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, how], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_glibc_defaults_fault_a_pass_in_again():
    # The baseline the settings change: without it, the test below would pass for the wrong reason.
    assert _faults("none")[2] > PAGES // 2


def test_kept_memory_is_reused_without_faulting():
    assert _faults("keep")[2] < PAGES // 20


def test_the_runs_worker_processes_keep_freed_memory():
    # process_setup is the job's worker_process_setup_hook: every Ray worker process of a run runs it first.
    assert _faults("setup")[2] < PAGES // 20


def test_keep_freed_memory_says_it_took_effect():
    out = subprocess.run(
        [sys.executable, "-c", "from vlmrl.malloc import keep_freed_memory; print(keep_freed_memory())"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.stdout.strip() == "True", out.stderr
