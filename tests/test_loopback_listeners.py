"""What a one-machine run listens on: 127.0.0.1 alone (issue 47, item 22).

- The weight-transfer group's store (``WeightGroup.host_store``) and a process group's TCP rendezvous
  (``tcp_rendezvous``) listen on the address they are given, not on every interface as torch's ``TCPStore``
  does, and still serve their clients.
- A real run that starts its own Ray cluster (disaggregated, the weights pushed by the collective, two trainer
  workers: every store and server a one-machine run starts): every socket that any of its processes listens
  on, sampled through the run, is on loopback. Without ``vlmrl.driver.local_cluster`` Ray's daemons and every
  worker's gRPC server listen on ``::``, its runtime-env agent on the machine's address; without
  ``bound_store`` the weight-transfer store on ``::``.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
import subprocess
import time

import psutil
import pytest
import torch.distributed as dist
from helpers.runs import E2E_TRAINING, REPO, main_command

from vlmrl.weight_sync.bound_store import tcp_rendezvous
from vlmrl.weight_sync.collective import LOOPBACK, WeightGroup

TIMEOUT = datetime.timedelta(seconds=30)


def _listening(processes) -> list[tuple[str, str, int]]:
    """(process name, address, port) of every listening TCP socket of ``processes``."""
    found = []
    for p in processes:
        try:
            name = p.name()
            found += [(name, c.laddr.ip, c.laddr.port) for c in p.net_connections("inet") if c.status == "LISTEN"]
        except psutil.Error:  # gone meanwhile
            pass
    return found


def _loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%")[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        return sock.getsockname()[1]


def test_the_weight_transfer_store_listens_on_its_host_alone():
    store, address = WeightGroup.host_store(1, "gloo", LOOPBACK, timeout_s=30)
    ours = [(ip, port) for _, ip, port in _listening([psutil.Process()]) if port == address.port]
    assert ours == [(LOOPBACK, address.port)]  # torch's own: [("::", port)]
    # A receiver reaches it as WeightGroup's receivers do.
    receiver = dist.TCPStore(LOOPBACK, address.port, address.world_size, is_master=False, timeout=TIMEOUT)
    receiver.set("k", "v")
    assert store.get("k") == b"v"


def test_a_tcp_rendezvous_listens_on_its_host_alone_and_serves_the_other_ranks():
    port = _free_port()
    init = f"tcp://{LOOPBACK}:{port}"
    assert tcp_rendezvous("file:///tmp/x", 0, 2, TIMEOUT) is None  # a file rendezvous listens nowhere
    server = tcp_rendezvous(init, 0, 2, TIMEOUT)
    ours = [(ip, p) for _, ip, p in _listening([psutil.Process()]) if p == port]
    assert ours == [(LOOPBACK, port)]
    client = tcp_rendezvous(init, 1, 2, TIMEOUT)
    client.set("rank1", "here")
    assert server.get("rank1") == b"here"


@pytest.mark.e2e
def test_a_one_machine_run_listens_on_loopback_alone(quickstart_assets, tmp_path):
    overrides = [
        *E2E_TRAINING, "trainer.max_steps=1", "data.val_files=", "trainer.val_before_train=false",
        "trainer.logger=[console,file]", "trainer.n_gpus_per_node=2",
        "worker.rollout.async_rl.enable=true", "worker.rollout.async_rl.placement=disaggregated",
        "worker.rollout.async_rl.rollout_workers=1", "worker.actor.use_decoupled_loss=true",
        "worker.rollout.async_rl.weight_transfer=collective",
    ]  # fmt: skip
    log = tmp_path / "out.log"
    with log.open("w") as out:
        env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "RAY_ADDRESS")}
        command = main_command(tmp_path / "out", *overrides)
        proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    root = psutil.Process(proc.pid)
    seen: dict[tuple[str, str], int] = {}
    deadline = time.monotonic() + 600
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                processes = [root, *root.children(recursive=True)]
            except psutil.Error:
                break
            for name, ip, port in _listening(processes):
                # "ray::HybridWorker.update_actor", "ray::hybrid_worker_0_...:HybridWorker.__init__": HybridWorker
                seen[(name.rpartition(":")[2].partition(".")[0], ip)] = port
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    text = log.read_text()
    assert proc.returncode == 0, text[-4000:]
    assert "by collective" in text, text[-4000:]  # the weight-transfer store was up
    names = {name for name, _ in seen}
    assert {"gcs_server", "raylet", "HybridWorker", "RolloutServer"} <= names, seen  # sampled through
    assert [(name, ip) for name, ip in seen if not _loopback(ip)] == [], seen
