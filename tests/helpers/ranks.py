"""Starting a test's own gloo ranks as processes, as quickly as this pytest process allows.

A fork starts a rank at once, and is safe while this process holds no process group and no thread besides the
main one (as in a run of one test file). Otherwise (Ray, vLLM or a manager has left threads behind, as in a
run of the whole suite) a rank starts as a fork of multiprocessing's fork server, a process of its own started
once per session with torch, transformers and the trainer's modules imported (``PRELOAD``). A spawned rank
imports them again, and the ranks start one after the other, each after the last one's imports (spawn sends
a rank its arguments through a pipe, which blocks until the rank has imported what unpickling them needs):
4 spawned ranks took about 20 s before the last one joined the process group.

The fork server's ranks have the environment this process had when the server started: a test that sets
environment variables for its ranks passes them in the rank's arguments instead.
"""

from __future__ import annotations

import multiprocessing
import threading

import torch.distributed as dist

PRELOAD = [
    "torch",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "transformers",
    "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl",
    "vlmrl.data.dataset",
    "vlmrl.train.actor",
    "vlmrl.train.checkpoint",
    "vlmrl.train.critic",
    "vlmrl.train.fsdp_options",
    "vlmrl.weight_sync.gather",
]
"""What the fork server imports once, so that a rank started from it need not (the trainer's usual imports)."""


def start_method() -> str:
    """``fork`` when this process is quiet (no process group, no other thread), else ``forkserver``."""
    if not dist.is_initialized() and threading.active_count() == 1:
        return "fork"
    multiprocessing.set_forkserver_preload(PRELOAD)  # read when the server starts, the first time it is used
    return "forkserver"


def start_ranks(fn, args: tuple, nprocs: int) -> None:
    """``fn(rank, *args)`` in ``nprocs`` processes, joined; a rank's exception is raised here."""
    import torch.multiprocessing as mp

    mp.start_processes(fn, args=args, nprocs=nprocs, start_method=start_method())
