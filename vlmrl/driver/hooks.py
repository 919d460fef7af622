"""Points where a caller can run its own code in a run, passed in rather than read from the environment.

Tests use them to inject faults (``tests/helpers/crash_in_save.py`` kills the
run between writing a checkpoint and committing it); production runs pass
none. Each hook runs in the process that drives the step loop (the Runner
actor), so it must pickle: a module-level function, or one defined in the
launching script (Ray pickles those by value).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class RunHooks:
    checkpoint_written: Callable[[int], None] | None = None
    """Called with the step once a checkpoint's files are all written, before it is committed."""
