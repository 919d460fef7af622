"""The test session's Ray worker processes start as forks of one process that has imported their modules already.

Why: a short test run trains for about a second; the rest is start-up, and most of that start-up is CPU spent
importing torch, transformers, vLLM, Ray and vlmrl again in every Ray worker process of every run (the Runner, the
trainer workers, the rollout servers, the reward actors): about 10-15 s of CPU per run on the 2-core machine, where
the runs are CPU-bound (docs/performance.md, the test suite). Forked from a process that holds those modules, a
worker starts with them imported; everything it then does (Ray's worker, vlmrl's actors, FSDP, the engine) is the
same code in a real process of its own.

How:
- The session's fork server (``serve``, started by ``tests/helpers/shared_cluster.py``) imports ``PRELOAD`` and
  waits on a Unix socket in a directory only its user can enter, for clients that know its token.
- The runs that join the session's cluster name this file as their workers' Python: ``runtime_env_hook`` (Ray's
  ``RAY_RUNTIME_ENV_HOOK``) sets ``py_executable``, so Ray starts ``python vlmrl_forkserver.py --connect <dir>
  <worker script and arguments>`` instead of ``python <worker script and arguments>``. The tests that start Ray in
  pytest's process give their jobs the same ``py_executable`` (``forked_runtime_env``).
- That process is a client (``client``): it sends its arguments, environment, working directory and its standard
  streams (the descriptors themselves) to the server, which forks. The child takes them on, and runs the worker
  script as ``python`` would have (``become``). The suite's ``python -m vlmrl.main`` runs that join the cluster
  start the same way (``tests/helpers/runs.py``), so their drivers start with torch imported too. The client stays as the process Ray started: it passes signals on to
  the child and exits as the child did; the server kills a child whose client died.
- A worker's own Python children that ``multiprocessing`` spawns (vLLM's tensor-parallel shards on a rollout
  server, which vLLM always spawns inside a Ray actor) start the same way: in a forked child, ``multiprocessing``'s
  executable is ``SHIM``, a script that runs this file's client. A spawned process finds its pipes by number
  (spawn's command line, and the pickled connections it is handed), so the client passes on every descriptor it
  holds and the child holds each at the same number. Where one of those numbers is taken in the child (by a module
  the server imported), the child starts cold instead (exec), as it does when the server is not single-threaded.
  Cold, each shard imported torch and vLLM again: about 12 s of a TP=2 server's start on the 2-core machine.
- The server forks only while it is single-threaded (a fork copies one thread, and the locks the others held); if
  anything it imported started a thread, it starts each worker with exec instead, which is merely slower.

What differs from a cold start, and why it does not matter here (the run the console tests read, the e2e run,
starts cold, so that what a cold start prints is still checked): the modules in ``PRELOAD`` are imported with the
server's environment, not the run's. The run's settings that those modules read at import are the same for every
test run (the suite's environment), and the per-run ones (the log file, OMP threads, vLLM's switches) are read
later. OpenMP read ``OMP_NUM_THREADS`` when torch loaded it, so the child sets torch's threads from its own.

Set ``VLMRL_TESTS_FORKSERVER=0`` to start every worker cold (to compare, or to rule the fork server out).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import sys

DIR_ENV = "VLMRL_FORKSERVER_DIR"
"""The driver's setting (from tests/helpers/shared_cluster.py): the server's directory, which holds its socket
(``SOCKET``) and its token (``TOKEN``), readable by this user alone. The workers get the directory on their
command line, not in their environment, so the token is in no environment a run logs."""
SOCKET, TOKEN, SHIM = "socket", "token", "python"
SKIPPED_FLAGS = {"-W": 2, "-X": 2}
"""Interpreter flags a spawn command may carry (``_args_from_interpreter_flags``) and how many arguments each
takes; the others take one (``-B``, ``-s``, ``-O``...). The child has them from the server's start instead."""

PRELOAD = (
    "torch",
    "torch.distributed.fsdp",
    "transformers",
    "transformers.models.auto.processing_auto",
    "transformers.models.qwen2_vl.image_processing_qwen2_vl",
    "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl",
    "vllm",
    "vllm.entrypoints.llm",
    "vllm.v1.engine.llm_engine",
    "vllm.v1.engine.core",
    "datasets",
)
"""What a run's Ray workers import, the costly part first. A module that fails to import is skipped.

Not Ray, nor vlmrl (whose modules import Ray): Ray's library, once loaded, keeps what it read of the process's
environment, so a worker forked from a process that had loaded it reads the server's job id, not its own, and Ray
stops it at start. So the server has Ray's import fail (``_NoRay``): vLLM, the one module here that tries it,
then records Ray as missing, and the child, with Ray importable again, has that module read again (``become``).
A child imports Ray and vlmrl itself, about 1.5 s of CPU."""

_RELOAD = ("vllm.v1.executor.ray_utils",)
"""The preloaded modules that tried to import Ray (``_NoRay``), read again in each child."""


class _NoRay:
    """A meta path finder that fails every import of Ray, in the server."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if name == "ray" or name.startswith("ray."):
            raise ImportError(f"{name} is not imported in the fork server")
        return None


_HEADER = struct.Struct("!I")
_PID = struct.Struct("!q")
_STATUS = struct.Struct("!i")


def runtime_env_hook(runtime_env: dict | None) -> dict:
    """Ray's ``RAY_RUNTIME_ENV_HOOK``, in the driver: the job's workers start through this file's client."""
    env = dict(runtime_env or {})
    where = os.environ.get(DIR_ENV)
    if where:
        env.setdefault("py_executable", f"{sys.executable} {os.path.abspath(__file__)} --connect {where}")
    return env


# The client: the process Ray starts.


def client(where: str, argv: list[str]) -> None:
    """Have the server in ``where`` fork this worker, then stand for it: pass signals on, and exit as it exits."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with open(os.path.join(where, TOKEN)) as file:
            token = file.read()
        conn.connect(os.path.join(where, SOCKET))
    except OSError:  # no server (the session is ending): be the python Ray asked for
        os.execv(sys.executable, [sys.executable, *argv])
    # A process multiprocessing spawned (``-c`` code): every descriptor it was handed, by number.
    passed = [fd for fd in _open_fds() if fd > 2 and fd != conn.fileno()] if _code(argv) is not None else []
    request = {"token": token, "argv": argv, "env": dict(os.environ), "cwd": os.getcwd(), "fds": passed}
    request = json.dumps(request).encode()
    socket.send_fds(conn, [_HEADER.pack(len(request)) + request], [0, 1, 2, *passed])
    child = _PID.unpack(_read(conn, _PID.size))[0]
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, lambda number, _frame: _forward(child, number))
    try:
        status = _STATUS.unpack(_read(conn, _STATUS.size))[0]
    except EOFError:  # the server is gone, and the child with it
        os._exit(1)
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        signal.signal(number, signal.SIG_DFL)
        os.kill(os.getpid(), number)
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)


def _code(argv: list[str]) -> str | None:
    """The ``-c`` code of a ``python`` command line, past its interpreter flags; None for a script or ``-m``."""
    i = 0
    while i < len(argv) and argv[i].startswith("-") and argv[i] not in ("-c", "-m"):
        i += SKIPPED_FLAGS.get(argv[i], 1)
    return argv[i + 1] if i + 1 < len(argv) and argv[i] == "-c" else None


def _open_fds() -> list[int]:
    """This process's open descriptors, in order."""
    listed = sorted(int(fd) for fd in os.listdir("/proc/self/fd"))
    return [fd for fd in listed if _is_open(fd)]  # not the listing's own, closed since


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def _forward(pid: int, number: int) -> None:
    try:
        os.kill(pid, number)
    except ProcessLookupError:
        pass


def _read(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return data


# The server: the session's template process.


def serve(where: str) -> tuple[dict, list[int]] | None:
    """Import ``PRELOAD``, then fork a child per client of the socket in ``where`` until stdin closes. Returns None
    in the server, and the request and its descriptors in each child, which then runs its worker (``become``)."""
    import gc
    import importlib
    import secrets
    import selectors
    import threading

    sys.meta_path.insert(0, _NoRay)
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception as error:  # noqa: BLE001 - a module this install lacks: its workers import it themselves
            print(f"forkserver: not preloaded: {name}: {error!r}", file=sys.stderr, flush=True)
    gc.collect()
    gc.freeze()  # the children's collections then leave the preloaded objects, and their pages, alone
    os.chmod(where, 0o700)
    token = secrets.token_hex(16)
    descriptor = os.open(os.path.join(where, TOKEN), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w") as file:
        file.write(token)
    shim = os.path.join(where, SHIM)
    with open(shim, "w") as file:
        file.write(f'#!/bin/sh\nexec "{sys.executable}" "{os.path.abspath(__file__)}" --connect "{where}" "$@"\n')
    os.chmod(shim, 0o700)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(os.path.join(where, SOCKET))
    listener.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "accept")
    selector.register(wake_r, selectors.EVENT_READ, "reap")
    selector.register(sys.stdin, selectors.EVENT_READ, "stdin")
    clients: dict[int, socket.socket] = {}  # child pid -> its client's connection
    # Python's threads only: the native pools of OpenBLAS and of pyarrow's jemalloc, which start at import, stop
    # and restart around a fork themselves (pthread_atfork).
    single = threading.active_count() == 1
    print(json.dumps({"forks": single}), flush=True)
    while True:
        for key, _ in selector.select():
            if key.data == "accept":
                conn, _ = listener.accept()
                try:
                    request, fds = _receive(conn)
                except (EOFError, ValueError, OSError):
                    conn.close()
                    continue
                if request.get("token") != token:
                    for fd in fds:
                        os.close(fd)
                    conn.close()
                    continue
                pid = os.fork()
                if pid == 0:  # the child: leave the server's state behind
                    os.setpgid(0, 0)  # a group of its own, as Ray gives each worker (and kills with it)
                    selector.close()
                    listener.close()
                    for other in [*clients.values(), conn]:
                        other.close()
                    os.close(wake_r)
                    os.close(wake_w)
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    if not single:
                        _exec(request, fds)
                    request["shim"] = shim
                    return request, fds
                for fd in fds:
                    os.close(fd)
                print(f"forkserver: {pid}: {' '.join(request['argv'])[:200]}", file=sys.stderr, flush=True)
                conn.sendall(_PID.pack(pid))
                clients[pid] = conn
                selector.register(conn, selectors.EVENT_READ, pid)
            elif key.data == "reap":
                while True:
                    try:
                        os.read(wake_r, 4096)
                    except BlockingIOError:
                        break
                _reap(clients, selector)
            elif key.data == "stdin":
                if not os.read(sys.stdin.fileno(), 4096):  # the session is over
                    return None
            else:  # a client's connection is readable: it closed, so its process died
                pid = key.data
                selector.unregister(key.fileobj)
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def _reap(clients: dict[int, socket.socket], selector) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = clients.pop(pid, None)
        if conn is None:
            continue
        try:
            selector.unregister(conn)
        except (KeyError, ValueError):
            pass
        try:
            conn.sendall(_STATUS.pack(status))
        except OSError:
            pass
        conn.close()


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    data, fds, _flags, _addr = socket.recv_fds(conn, 1 << 16, 64)
    try:
        while len(data) < _HEADER.size:
            data += _read(conn, _HEADER.size - len(data))
        (length,) = _HEADER.unpack(data[: _HEADER.size])
        body = data[_HEADER.size :]
        if len(body) < length:
            body += _read(conn, length - len(body))
        request = json.loads(body)
        if len(fds) != 3 + len(request.get("fds", [])):
            raise ValueError("a request carries the three standard streams and the descriptors it names")
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return request, fds


def _take_on(request: dict, fds: list[int]) -> bool:
    """The child becomes the process its client stands for: its streams, the descriptors it passed on (at the
    client's numbers), directory and environment. False where one of those numbers was taken here (by a module the
    server imported): the child then holds the client's descriptor there, and must start afresh (exec)."""
    import fcntl

    for target, fd in zip((0, 1, 2), fds):
        os.dup2(fd, target)
    for fd in fds[:3]:
        if fd > 2:
            os.close(fd)
    numbers = request.get("fds", [])
    # Out of the way of the numbers they take, first: above the highest of them.
    above = max(numbers, default=2) + 1
    received = []
    for fd in fds[3:]:
        received.append(fcntl.fcntl(fd, fcntl.F_DUPFD, above))
        os.close(fd)
    taken = {fd for fd in _open_fds() if fd not in received}
    clear = not taken & set(numbers)
    for number, fd in zip(numbers, received):
        os.dup2(fd, number)  # inheritable, as the client's were
        os.close(fd)
    os.chdir(request["cwd"])
    env = request["env"]
    os.environ.clear()
    os.environ.update(env)
    return clear


def _exec(request: dict, fds: list[int]) -> None:
    _take_on(request, fds)
    _exec_taken_on(request)


def _exec_taken_on(request: dict) -> None:
    os.execv(sys.executable, [sys.executable, *request["argv"]])


def become(request: dict, fds: list[int]) -> None:
    """In a forked child: run ``python <argv>`` (a script, ``-m module`` or ``-c code``) in this process."""
    import importlib
    import runpy

    if not _take_on(request, fds):
        _exec_taken_on(request)
    sys.meta_path.remove(_NoRay)
    for name in _RELOAD:
        if name in sys.modules:
            importlib.reload(sys.modules[name])
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads and threads.isdigit() and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(threads))
    # sys.path as python builds it: the script's directory (or the working directory), then PYTHONPATH's entries.
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    if request.get("shim"):  # this worker's spawned children start as forks too
        import multiprocessing

        multiprocessing.set_executable(request["shim"])
    argv = request["argv"]
    code = _code(argv)
    if code is not None:  # past the interpreter flags
        argv = ["-c", code, *argv[argv.index(code) + 1 :]]
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        sys.path[0:1] = [os.getcwd(), *extra]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    elif argv[0] == "-c":
        sys.argv = ["-c", *argv[2:]]
        sys.path[0:1] = ["", *extra]
        exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    else:
        sys.argv = list(argv)
        sys.path[0:1] = [os.path.dirname(os.path.abspath(argv[0])), *extra]
        runpy.run_path(argv[0], run_name="__main__")


def main() -> None:
    if len(sys.argv) >= 3 and sys.argv[1] == "--serve":
        job = serve(sys.argv[2])
        if job is not None:
            become(*job)
    elif len(sys.argv) >= 3 and sys.argv[1] == "--connect":
        client(sys.argv[2], sys.argv[3:])
    else:
        sys.exit("usage: vlmrl_forkserver.py --serve DIR | --connect DIR WORKER_ARGS...")


if __name__ == "__main__":
    main()
