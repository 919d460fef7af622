"""``python tests/helpers/full_disk_in_save.py STEP ARGS...``: ``python -m vlmrl.main ARGS`` whose disk fills mid-save.

Once step STEP's checkpoint files are written, and before the save is committed,
the ``checkpoint_written`` hook raises ``OSError(ENOSPC)``, as the last write of
a save onto a full disk does.
"""

from __future__ import annotations

import errno
import functools
import sys


def disk_full_at(step: int, at: int) -> None:
    if step == at:
        raise OSError(errno.ENOSPC, "No space left on device (injected)")


if __name__ == "__main__":
    from vlmrl.driver.hooks import RunHooks
    from vlmrl.main import main

    at = int(sys.argv[1])
    sys.exit(main(sys.argv[2:], hooks=RunHooks(checkpoint_written=functools.partial(disk_full_at, at=at))))
