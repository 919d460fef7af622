"""Loading torch.distributed.checkpoint (DCP) directories without running code from them.

DCP's own ``FileSystemReader.read_metadata`` unpickles ``.metadata`` with the
plain ``pickle`` module, and its ``DefaultLoadPlanner`` reads every non-tensor
item with ``torch.load(weights_only=False)``: a checkpoint directory written by
someone else can run any command on every rank that resumes or exports it
(pytorch/pytorch#189308, seen on torch 2.14). Here:

- ``SafeReader`` unpickles ``.metadata`` with an allowlist: the dataclasses of
  ``torch.distributed.checkpoint.metadata``, DCP's ``_StorageInfo``, dtypes,
  layouts, ``torch.Size`` and paths. Anything else raises ``UnsafeCheckpoint``
  before it is constructed. It also refuses a storage entry whose file is not a
  plain name inside the checkpoint directory.
- ``SafePlanner`` reads byte items (optimizer hyper-parameters, for example)
  with ``torch.load(weights_only=True)``.
- ``check_private`` refuses a checkpoint that users other than the owner can
  write (world-writable, or writable by a group with other members), since
  whoever can write it decides what the run loads.

Written against torch 2.14's DCP (``FileSystemReader``, ``DefaultLoadPlanner``).
"""

from __future__ import annotations

import grp
import io
import os
import pathlib
import pickle
import pwd
import stat
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem


class UnsafeCheckpoint(RuntimeError):
    """A checkpoint that would run code, or that other users can change, when loaded."""


def _metadata_classes() -> dict[tuple[str, str], object]:
    allowed: dict[tuple[str, str], object] = {}
    for name, value in vars(dcp_metadata).items():
        # Only the module's own dataclasses and enums: it also imports names (e.g. typing helpers).
        if isinstance(value, type) and value.__module__ == dcp_metadata.__name__:
            allowed[(dcp_metadata.__name__, name)] = value
    allowed[(dcp_filesystem.__name__, "_StorageInfo")] = dcp_filesystem._StorageInfo
    allowed[("torch", "Size")] = torch.Size
    allowed[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    for cls in (pathlib.PosixPath, pathlib.PurePosixPath, pathlib.Path):
        allowed[("pathlib", cls.__name__)] = cls
    allowed[("collections", "OrderedDict")] = __import__("collections").OrderedDict
    for name in ("set", "frozenset", "slice"):
        allowed[("builtins", name)] = getattr(__import__("builtins"), name)
    return allowed


_ALLOWED = _metadata_classes()


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, source: str):
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str):
        found = _ALLOWED.get((module, name))
        if found is None and module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            found = getattr(torch, name)
        if found is None:
            raise UnsafeCheckpoint(
                f"{self.source}: refusing to load {module}.{name}, which DCP metadata never holds; "
                "the checkpoint may have been tampered with (it would run code when unpickled). "
                "Load only checkpoints you or your runs wrote."
            )
        return found


def read_metadata_safely(path: str | Path) -> dcp_metadata.Metadata:
    """A DCP directory's ``.metadata``, unpickled through the allowlist."""
    file = Path(path) / ".metadata"
    try:
        with open(file, "rb") as f:
            metadata = _MetadataUnpickler(f, str(file)).load()
    except UnsafeCheckpoint:
        raise
    except FileNotFoundError:
        raise
    except Exception as e:  # a truncated or garbled file: name it rather than a bare pickle error
        raise UnsafeCheckpoint(f"{file}: not a readable DCP metadata file ({type(e).__name__}: {e})") from e
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise UnsafeCheckpoint(f"{file}: holds a {type(metadata).__name__}, not DCP metadata")
    for info in (metadata.storage_data or {}).values():
        relative = getattr(info, "relative_path", None)
        if not isinstance(relative, str) or os.path.basename(relative) != relative or relative in ("", ".", ".."):
            raise UnsafeCheckpoint(f"{file}: a storage entry points outside the checkpoint directory ({relative!r})")
    return metadata


class SafeReader(dcp.FileSystemReader):
    """DCP's file reader with the restricted metadata unpickler."""

    def read_metadata(self, *args, **kwargs) -> dcp_metadata.Metadata:
        if kwargs.get("rank") is not None:
            raise UnsafeCheckpoint(f"{self.path}: per-rank DCP metadata is not supported")
        metadata = read_metadata_safely(self.path)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafePlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading byte items as weights only (tensors and plain containers)."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            raise UnsafeCheckpoint(
                f"checkpoint item {read_item.dest_index.fqn!r} holds more than tensors and plain values "
                f"(refused by torch.load(weights_only=True): {str(e).splitlines()[0]})"
            ) from e
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def load(state: dict, path: str | Path, no_dist: bool = False) -> None:
    """``dcp.load`` with the safe reader and planner."""
    try:
        dcp.load(state, storage_reader=SafeReader(str(path)), planner=SafePlanner(), no_dist=no_dist)
    except CheckpointException as e:
        # DCP wraps each rank's error (in a BaseException); a refusal is re-raised as itself.
        for exc, _trace in e.failures.values():
            if isinstance(exc, UnsafeCheckpoint):
                raise UnsafeCheckpoint(f"{path}: {exc}") from None
        raise


def _writers_besides_owner(st: os.stat_result) -> str | None:
    """Who else can write a file or directory with this stat; None when only its owner (or root) can."""
    mode = st.st_mode
    if stat.S_ISLNK(mode):
        return "it is a symbolic link"
    if mode & stat.S_IWOTH:
        return "every user can write it"
    if st.st_uid not in (os.getuid(), 0):
        return f"it belongs to user {_user_name(st.st_uid)}"
    if mode & stat.S_IWGRP:
        members = _group_members(st.st_gid)
        others = members - {_user_name(os.getuid())}
        if others:
            return f"group {_group_name(st.st_gid)} can write it ({', '.join(sorted(others))})"
    return None


def _user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _group_name(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


def _group_members(gid: int) -> set[str]:
    """The group's members, counting those whose primary group it is."""
    try:
        members = set(grp.getgrgid(gid).gr_mem)
    except KeyError:
        return {"<unknown>"}
    members |= {p.pw_name for p in pwd.getpwall() if p.pw_gid == gid}
    return members


def check_private(checkpoint: str | Path) -> None:
    """Refuse a checkpoint directory that users other than its owner can change.

    Checks the directory holding it (whoever can write there can swap it), the
    checkpoint directory itself, and everything inside it.
    """
    checkpoint = Path(checkpoint)
    paths = [checkpoint.resolve().parent, checkpoint]
    for dirpath, dirnames, filenames in os.walk(checkpoint):
        paths += [Path(dirpath) / name for name in dirnames + filenames]
    problems = []
    for path in paths:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        who = _writers_besides_owner(st)
        if who is not None and not (path == paths[0] and st.st_mode & stat.S_ISVTX and not stat.S_ISLNK(st.st_mode)):
            problems.append(f"{path} ({who})")
    if problems:
        shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        raise UnsafeCheckpoint(
            f"refusing to load {checkpoint}: other users can change it: {shown}. Loading a checkpoint trusts "
            "whoever can write it; make it yours alone (chmod -R go-w, chown) or copy it to a directory only you can write"
        )
