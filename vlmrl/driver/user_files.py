"""The user's code and templates a run loaded, by hash, so that a resume can say which of them changed.

The schema marks the keys whose values name user files (field metadata
``vlmrl.config.schema.USER_CODE`` and ``USER_TEMPLATE``: the reward function,
tools, environment, tool-call parser, agent and its hooks, the prompt format
and the judge's template). ``user_files`` hashes each file at the start of a
run, when the workers load them, and every checkpoint stores the hashes; a
resume compares them with the files as they are now and warns, naming the key
and the file, for each one that changed (``changed_user_files``). It does not
refuse: fixing a bug in a reward function and resuming is what users do. Only
the file a key names is hashed, not the modules it imports.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.machinery
import sys
import sysconfig
import typing
from pathlib import Path
from typing import Any

from vlmrl.config import Config
from vlmrl.config.redact import mask_text

__all__ = ["changed_user_files", "user_file_keys", "user_files"]


def user_file_keys(cls: type = Config, prefix: str = "") -> dict[str, str]:
    """``dotted key: kind`` ("object" or "template") of every schema field marked as naming user files."""
    out: dict[str, str] = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out.update(user_file_keys(hints[f.name], f"{prefix}{f.name}."))
        elif "user_file" in f.metadata:
            out[f"{prefix}{f.name}"] = f.metadata["user_file"]
    return out


def _module_file(module: str) -> Path | None:
    """The file of ``package.module`` found on sys.path without importing it (nor its packages)."""
    path = None
    spec = None
    for part in module.split("."):
        spec = importlib.machinery.PathFinder.find_spec(part, path)
        if spec is None:
            return None
        path = spec.submodule_search_locations
    if spec is None or not spec.origin or not spec.has_location:
        return None
    return Path(spec.origin)


def _file_of(value: str, kind: str) -> Path | None:
    """The file a key's value names, or None for a value that names no file of the user's (a built-in parser,
    a template given as text, a module that is not found)."""
    if not value:
        return None
    if kind == "template":
        if "\n" in value or len(value) >= 4096:
            return None
        path = Path(value)
        return path if path.is_file() else None
    if ":" not in value:
        return None  # qwen, a built-in tool-call format
    location = value.rsplit(":", 1)[0]
    if location.endswith(".py"):
        path = Path(location)
        return path if path.is_file() else None
    if location.split(".")[0] in sys.builtin_module_names:
        return None
    found = _module_file(location)
    if found is None or not found.is_file():
        return None
    installed = {Path(p).resolve() for k, p in sysconfig.get_paths().items() if k in _INSTALLED}
    installed.add(Path(__file__).resolve().parents[1])  # vlmrl's own modules
    if any(found.resolve().is_relative_to(root) for root in installed):
        return None  # the standard library's, an installed package's or vlmrl's: versioned by its package
    return found


_INSTALLED = ("stdlib", "platstdlib", "purelib", "platlib")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _lookup(config: Config, key: str) -> Any:
    node: Any = config
    for part in key.split("."):
        node = getattr(node, part)
    return node


def user_files(config: Config) -> dict[str, dict[str, str]]:
    """``key: {"file": absolute path, "sha256": hex}`` for every user file the config names (a list's entries
    as ``key[i]``)."""
    out: dict[str, dict[str, str]] = {}
    for key, kind in user_file_keys().items():
        value = _lookup(config, key)
        named = [(f"{key}[{i}]", v) for i, v in enumerate(value)] if isinstance(value, list) else [(key, value)]
        for name, item in named:
            path = _file_of(item, kind) if isinstance(item, str) else None
            if path is not None:
                # A path built from ${oc.env:...} is shown as *** (vlmrl.config.redact), as the config is.
                out[name] = {"file": mask_text(str(path.resolve())), "sha256": _sha256(path)}
    return out


def changed_user_files(saved: dict[str, dict[str, str]], current: dict[str, dict[str, str]]) -> list[str]:
    """One line for each key whose file's contents differ between a checkpoint and this run."""
    lines = []
    for key in sorted(saved.keys() & current.keys()):
        before, now = saved[key], current[key]
        if before.get("sha256") == now["sha256"]:
            continue
        where = now["file"] if before.get("file") == now["file"] else f"{before.get('file')} -> {now['file']}"
        lines.append(f"{key}: {where} (sha256 {str(before.get('sha256'))[:12]} -> {now['sha256'][:12]})")
    return lines
