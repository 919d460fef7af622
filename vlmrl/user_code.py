"""Loading a user's object from ``path/to/file.py:name`` or ``package.module:name``.

Tools, environments and tool-call parsers are named by path, as reward
functions are. Loading happens twice: once at validation in the driver (so a
broken file is a config error before Ray starts) and once in each process
that runs the code. A file gets a stable module name, so an object pickled
by reference finds its module again on the other side.

Every user path (data, tools, agents, reward functions, templates) is read
relative to the current directory; ``resolved_from`` names that directory in
the error of a relative path that does not exist.

Imports nothing from vlmrl, so every layer may use it.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any


def resolved_from(path: str | Path) -> str:
    """What to append to "PATH does not exist": for a relative path, the directory it was resolved from."""
    if Path(path).is_absolute():
        return ""
    return f" in {Path.cwd()} (the current directory, which relative paths are read from)"


class UserCodeError(ValueError):
    """The object a key names cannot be loaded; the message names the key and the file."""


def load_object(spec: str, key: str) -> Any:
    """The object ``spec`` names. Every failure, an exception raised by the user's module while it is
    imported included, comes back as a UserCodeError naming ``key`` and ``spec``."""
    if not isinstance(spec, str) or ":" not in spec:
        raise UserCodeError(f"{key}={spec!r}: expected path/to/file.py:name or package.module:name")
    location, name = spec.rsplit(":", 1)
    if location.endswith(".py"):
        module = _load_file(Path(location), key)
    else:
        try:
            module = importlib.import_module(location)
        except ModuleNotFoundError as e:
            raise UserCodeError(f"{key}: cannot import module {location} ({e})") from e
        except BaseException as e:  # SystemExit from user code too: report it, do not exit
            raise UserCodeError(f"{key}: module {location} failed to load: {type(e).__name__}: {e}") from e
    if not hasattr(module, name):
        raise UserCodeError(f"{key}: {location} has no {name!r}")
    return getattr(module, name)


def _load_file(path: Path, key: str):
    if not path.is_file():
        raise UserCodeError(f"{key}: file {path} does not exist{resolved_from(path)}")
    module_name = "vlmrl_user_" + hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]
    if module_name in sys.modules:
        return sys.modules[module_name]
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module
    try:
        module_spec.loader.exec_module(module)
    except BaseException as e:
        del sys.modules[module_name]
        raise UserCodeError(f"{key}: {path} failed to load: {type(e).__name__}: {e}") from e
    return module
