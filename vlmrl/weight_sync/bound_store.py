"""A ``TCPStore`` server that listens on the one address it is given.

torch's ``TCPStore`` server (torch 2.14) listens on every interface (``::``)
whatever host name it is given, and takes no password: anyone who reaches the
port can read and write the rendezvous, and so join or break the group. Here
the listening socket is bound to ``host`` alone (127.0.0.1 on one machine,
the node's address across machines) and handed to the store
(``master_listen_fd``, which the store then owns and closes).
"""

from __future__ import annotations

import datetime
import socket

import torch.distributed as dist


def bound_store(
    host: str, port: int, world_size: int, timeout: datetime.timedelta, wait_for_workers: bool = False
) -> dist.TCPStore:
    """The server side of a rendezvous, listening on ``host`` and ``port`` only (port 0: one the OS picks; the
    store's ``port`` says which). Clients connect with ``dist.TCPStore(host, port, is_master=False)``."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind((host, port))
        sock.listen(socket.SOMAXCONN)
        port = sock.getsockname()[1]
    except OSError:
        sock.close()
        raise
    # The store owns the descriptor from here (it closes it, even when it fails to start, so it is not closed
    # here: the number could by then be another file's).
    return dist.TCPStore(
        host, port, world_size, is_master=True, timeout=timeout, wait_for_workers=wait_for_workers,
        master_listen_fd=sock.detach(),
    )  # fmt: skip


def tcp_rendezvous(init_method: str, rank: int, world_size: int, timeout: datetime.timedelta) -> dist.Store | None:
    """For ``tcp://host:port``: the store of a process group's rendezvous, rank 0's listening on ``host`` alone
    (``init_process_group(init_method=...)`` would start one that listens on every interface); pass it as
    ``init_process_group(store=...)``. None for any other init method (a file rendezvous listens nowhere)."""
    if not init_method.startswith("tcp://"):
        return None
    host, _, port = init_method.removeprefix("tcp://").rpartition(":")
    host = host.strip("[]")
    if rank == 0:
        return bound_store(host, int(port), world_size, timeout)
    return dist.TCPStore(host, int(port), world_size, is_master=False, timeout=timeout)
