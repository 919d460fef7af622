"""``python tests/helpers/crash_in_save.py STEP ARGS...``: ``python -m vlmrl.main ARGS`` that dies mid-save.

The run is killed as SIGKILL would kill it once step STEP's checkpoint files
are all written and before the checkpoint is committed, through the
``checkpoint_written`` hook (defined here, so Ray pickles it by value into the
Runner, where the loop calls it).
"""

from __future__ import annotations

import functools
import os
import signal
import sys


def kill_at(step: int, at: int) -> None:
    if step == at:
        os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    from vlmrl.driver.hooks import RunHooks
    from vlmrl.main import main

    at = int(sys.argv[1])
    sys.exit(main(sys.argv[2:], hooks=RunHooks(checkpoint_written=functools.partial(kill_at, at=at))))
