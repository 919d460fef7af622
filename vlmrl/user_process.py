"""What the processes that run user code (reward functions, sync agents, tools) share with their parents.

Three things, each a promise the docs make (docs/architecture/trust.md, "User code"):

* **Results come back as data.** A child answers with ``send_data``: JSON, with
  bytes and PIL images in tagged objects. The parent reads it with
  ``recv_data``, which builds nothing but dicts, lists, strings, numbers,
  booleans, None, bytes and images of a bounded size: a value the user's code
  returns cannot run code in the parent, as an unpickled one could (its
  ``__reduce__``). The parent's messages to the child stay pickled: the child
  trusts its parent.
* **The process tree is bounded as a whole.** A child makes itself a child
  subreaper (``become_subreaper``), so a process its code starts stays its
  descendant even after ``setsid`` or a double fork. ``tree`` finds the
  descendants by their parent links, ``tree_usage`` sums their memory, and
  ``kill_tree`` kills all of them, and every process that still
  carries the child's marker in its environment (``MARKER``: one whose parent
  died first).
* **A cut-down environment in a scratch directory.** ``child_env`` passes an
  allowlist of the parent's variables and the user's own, nothing else, so API
  keys and tokens of the run do not reach user code unless the user passes them.

Nothing here isolates the file system, the network or other processes of the
same user: the code runs as the run's user, and a process written to escape
(one that clears its environment and its subreaper, say) can. It bounds code
that goes wrong, not code that attacks.

Imports nothing from vlmrl, so every layer may use it.
"""

from __future__ import annotations

import base64
import ctypes
import json
import numbers
import os
import re
import signal
import time
from collections.abc import Iterable, Mapping
from typing import Any

MARKER = "VLMRL_SANDBOX"
"""The environment variable that marks every process of one child's tree (its value is the child's token)."""

ENV_ALLOWLIST = (
    "PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "TZ", "TERM",
    "PYTHONPATH", "PYTHONHASHSEED", "PYTHONDONTWRITEBYTECODE", "VIRTUAL_ENV", "CONDA_PREFIX",
    "LD_LIBRARY_PATH",
    "HF_HOME", "HF_HUB_CACHE", "HF_DATASETS_CACHE", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE",
    "TRANSFORMERS_OFFLINE", "TRANSFORMERS_CACHE", "TORCH_HOME", "XDG_CACHE_HOME",
    "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "CUDA_VISIBLE_DEVICES",
    "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE",
    "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "no_proxy",
)  # fmt: skip
"""The parent's variables user code gets (with every ``LC_*``): paths, locale, caches, thread counts, proxies.
Not API keys, tokens or the run's ``VLMRL_*``, Ray, MLflow or cloud settings."""

ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

MAX_IMAGE_PIXELS = 178_956_970
"""The largest image a parent decodes from a child's answer (PIL's decompression-bomb bound, twice its warning)."""

_IMAGE_MODES = frozenset({"1", "L", "LA", "La", "P", "PA", "RGB", "RGBA", "RGBa", "RGBX", "CMYK", "YCbCr", "LAB",
                          "HSV", "I", "F", "I;16"})  # fmt: skip
_BYTES, _IMAGE, _PAIRS = "__vlmrl_bytes__", "__vlmrl_image__", "__vlmrl_pairs__"


# ----------------------------------------------------------------------------- results as data


class NotData(TypeError):
    """A value that has no place in a child's answer (a class instance, a function, a numpy array...)."""


def _encode(value: Any) -> Any:
    """json's ``default``: what is not a dict, list, tuple, str, int, float, bool or None."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return {_BYTES: base64.b64encode(bytes(value)).decode("ascii")}
    if type(value).__module__.startswith("PIL.") and hasattr(value, "tobytes") and hasattr(value, "mode"):
        image = value if value.mode in _IMAGE_MODES and value.mode not in ("P", "PA") else value.convert("RGBA")
        data = base64.b64encode(image.tobytes()).decode("ascii")
        return {_IMAGE: {"mode": image.mode, "size": list(image.size), "data": data}}
    item = getattr(value, "item", None)  # a numpy or torch scalar: its Python number
    if callable(item) and getattr(value, "ndim", None) == 0:
        plain = item()
        if isinstance(plain, (bool, int, float, str)):
            return plain
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):  # Fraction, Decimal
        return float(value)
    raise NotData(f"{type(value).__module__}.{type(value).__qualname__} is not plain data")


def _keys_kept(value: Any) -> Any:
    """``value`` with each dict whose keys are not all strings as a tagged list of pairs (JSON would make them strings)."""
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value):
            return {k: _keys_kept(v) for k, v in value.items()}
        return {_PAIRS: [[k, _keys_kept(v)] for k, v in value.items()]}
    if isinstance(value, (list, tuple)):
        return [_keys_kept(v) for v in value]
    return value


def encode_data(value: Any) -> bytes:
    """``value`` as JSON bytes; NotData (a TypeError) naming the first part that is not data."""
    try:
        value = _keys_kept(value)
        return json.dumps(value, default=_encode, allow_nan=True, separators=(",", ":")).encode()
    except NotData:
        raise
    except (TypeError, ValueError) as e:  # a key that is not a string or number, a circular reference
        raise NotData(str(e)) from e


def _decode_object(obj: dict) -> Any:
    if len(obj) != 1:
        return obj
    if _BYTES in obj and isinstance(obj[_BYTES], str):
        return base64.b64decode(obj[_BYTES], validate=True)
    if _IMAGE in obj and isinstance(obj[_IMAGE], dict):
        return _decode_image(obj[_IMAGE])
    if _PAIRS in obj and isinstance(obj[_PAIRS], list):
        pairs = [p for p in obj[_PAIRS] if isinstance(p, list) and len(p) == 2]
        return {(tuple(k) if isinstance(k, list) else k): v for k, v in pairs if not isinstance(k, dict)}
    return obj


def _decode_image(fields: dict) -> Any:
    from PIL import Image

    mode, size, data = fields.get("mode"), fields.get("size"), fields.get("data")
    if mode not in _IMAGE_MODES or not isinstance(data, str):
        raise ValueError(f"an image in the answer has mode {mode!r}, not one of {sorted(_IMAGE_MODES)}")
    if not (isinstance(size, list) and len(size) == 2 and all(type(s) is int and s > 0 for s in size)):
        raise ValueError(f"an image in the answer has size {size!r}, not two positive integers")
    if size[0] * size[1] > MAX_IMAGE_PIXELS:
        raise ValueError(f"an image in the answer has {size[0]}x{size[1]} pixels, more than {MAX_IMAGE_PIXELS}")
    return Image.frombytes(mode, tuple(size), base64.b64decode(data, validate=True))


def decode_data(raw: bytes) -> Any:
    """What ``encode_data`` wrote: plain data and images, never an object of another class; ValueError if malformed."""
    return json.loads(raw, object_hook=_decode_object)


def send_data(connection: Any, value: Any) -> None:
    """Send ``value`` as data over a ``multiprocessing.connection.Connection``; NotData before anything is sent."""
    connection.send_bytes(encode_data(value))


def recv_data(connection: Any) -> Any:
    """The next value ``send_data`` sent; EOFError when the pipe closed, ValueError when it is not data."""
    return decode_data(connection.recv_bytes())


# ----------------------------------------------------------------------------- the process tree


def become_subreaper() -> bool:
    """Make this process the one that inherits its orphaned descendants (PR_SET_CHILD_SUBREAPER); False if refused."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        return False


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of a live process, None for one that is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0].decode(), int(fields[1])


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def tree(root: int) -> list[int]:
    """``root`` (if alive) and its live descendants, parents before their children; zombies left out."""
    children: dict[int, list[int]] = {}
    states: dict[int, str] = {}
    for pid in _pids():
        stat = _stat(pid)
        if stat is not None:
            states[pid] = stat[0]
            children.setdefault(stat[1], []).append(pid)
    out, todo = [], [root] if root in states else []
    while todo:
        pid = todo.pop()
        if states.get(pid, "Z") not in ("Z", "X"):
            out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def marked(token: str) -> list[int]:
    """Live processes whose environment carries ``MARKER=token`` (those of this user: others' cannot be read)."""
    needle = f"{MARKER}={token}".encode() + b"\0"
    out = []
    for pid in _pids():
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if needle in f.read() + b"\0":
                    stat = _stat(pid)
                    if stat is not None and stat[0] not in ("Z", "X"):
                        out.append(pid)
        except OSError:
            continue
    return out


def tree_usage(root: int) -> tuple[int, int]:
    """(bytes of memory, processes) of ``root``'s tree: proportional set sizes, so pages a fork shares count once."""
    total, pids = 0, tree(root)
    for pid in pids:
        total += _memory(pid)
    return total, len(pids)


def _memory(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            for line in f:
                if line.startswith(b"Pss:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    try:
        with open(f"/proc/{pid}/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def kill_tree(root: int | None, token: str | None = None, spare: Iterable[int] = ()) -> list[int]:
    """SIGKILL ``root``'s tree and every process marked with ``token``, but not ``spare``; the pids killed.

    Looks again until a look finds none left: a process forked while the others were killed is the
    child of a killed one, so it carries the marker (or is reparented to a live subreaper of the tree).
    Never stops a process first: a stopped one whose killer died would stay, stopped, for good.
    """
    spare = set(spare)
    killed: list[int] = []
    for _ in range(100):
        found = [p for p in (tree(root) if root is not None else []) + (marked(token) if token else [])
                 if p not in spare]  # fmt: skip
        if not found:
            break
        for pid in found:
            _signal(pid, signal.SIGKILL)
        killed.extend(p for p in found if p not in killed)
        time.sleep(0.001)  # a killed process is gone from /proc (or a zombie) after the kernel reaps its threads
    return killed


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def has_children() -> bool:
    """Whether this process has a child, alive or not yet reaped (cheap: no scan of /proc)."""
    try:
        os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return False
    return True


def reap(pids: Iterable[int], timeout: float = 2.0) -> None:
    """Wait for those of ``pids`` that are this process's children (killed ones) to end, so none stays a zombie."""
    deadline = time.monotonic() + timeout
    for pid in pids:
        while True:
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                break
            if done or time.monotonic() > deadline:
                break
            time.sleep(0.01)


# ----------------------------------------------------------------------------- the environment


def child_env(extra: Mapping[str, str], environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The allowlisted variables of ``environ`` (this process's by default), then ``extra``, which wins."""
    environ = os.environ if environ is None else environ
    env = {k: v for k, v in environ.items() if k in ENV_ALLOWLIST or k.startswith("LC_")}
    env.update({str(k): str(v) for k, v in extra.items()})
    return env
