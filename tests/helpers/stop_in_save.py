"""``python tests/helpers/stop_in_save.py STEP ARGS...``: ``python -m vlmrl.main ARGS`` sent SIGTERM during a save.

Once step STEP's checkpoint files are written (the ``checkpoint_written`` hook,
in the Runner), the driver process gets SIGTERM, as from a scheduler; the hook
then waits until the stop request has reached the Runner, so that it arrives
before the save is committed.
"""

from __future__ import annotations

import functools
import os
import signal
import sys
import time


def sigterm_at(step: int, at: int, driver_pid: int) -> None:
    if step == at:
        os.kill(driver_pid, signal.SIGTERM)
        time.sleep(3)  # the driver's handler sends request_stop to the Runner's other thread meanwhile


if __name__ == "__main__":
    from vlmrl.driver.hooks import RunHooks
    from vlmrl.main import main

    hook = functools.partial(sigterm_at, at=int(sys.argv[1]), driver_pid=os.getpid())
    sys.exit(main(sys.argv[2:], hooks=RunHooks(checkpoint_written=hook)))
