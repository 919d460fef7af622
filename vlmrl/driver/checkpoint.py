"""Driver side of checkpoints: atomic directories, finding the last complete one,
the trainer's own state, and ``save_limit``.

A save writes everything into a hidden temporary directory next to the final
one, writes ``MANIFEST.json`` (every file with its size, and the SHA-256 of the
small ones) and the ``COMPLETE`` marker into it, fsyncs it, and only then
renames it to ``global_step_<k>``. A crash at any point leaves either the
previous checkpoints untouched plus debris that is never mistaken for a
checkpoint, or a complete one. A save that fails with an error (a full disk)
removes its own temporary directory; a save is marked complete only once every
rank's shard files are there (``verify_shards``); saving a step again swaps the
new copy in with one atomic exchange, over a complete copy or over an unmarked
leftover of an older save; a directory that ``save_limit`` cannot delete is
reported.

A resume trusts a directory only when its files match its manifest
(``check_manifest``): a marked directory with files missing, cut short or
changed (an interrupted copy) is skipped with a warning for the newest one that
matches. At start, under the run lock, the temporary directories of saves that
were killed are removed (``remove_stale_temporaries``); other debris is
reported and left for the user.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import os
import re
import shutil
import uuid
from pathlib import Path

import torch

from vlmrl.train.safe_checkpoint import read_metadata_safely

MARKER = "COMPLETE"
MANIFEST = "MANIFEST.json"
HASHED_BELOW = 1 << 20
"""Files smaller than this (1 MiB: configs, trainer state, RNG states, DCP metadata) are hashed in the
manifest; larger ones (the weight and optimizer shards) are checked by size, which a resume can afford."""
_STEP_DIR = re.compile(r"^global_step_(\d+)$")
_TEMPORARY = re.compile(r"^\.global_step_(\d+)\.(?:tmp|old)-[0-9a-f]+$")


class CheckpointError(RuntimeError):
    pass


def _fsync_tree(root: Path) -> None:
    for dirpath, _dirnames, filenames in os.walk(root):
        for name in filenames:
            with open(os.path.join(dirpath, name), "rb") as f:
                os.fsync(f.fileno())
        _fsync_dir(Path(dirpath))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def is_complete(path: Path) -> bool:
    return (path / MARKER).is_file()


def step_of(path: Path) -> int:
    match = _STEP_DIR.match(path.name)
    if not match:
        raise CheckpointError(f"{path}: not a checkpoint directory (expected global_step_<k>)")
    return int(match.group(1))


class CheckpointManager:
    def __init__(self, root: str, save_limit: int | None = None):
        self.root = Path(root)
        self.save_limit = save_limit

    def complete(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        if not self.root.is_dir():
            return []
        found = [p for p in self.root.iterdir() if _STEP_DIR.match(p.name) and is_complete(p)]
        return sorted(found, key=step_of)

    def incomplete(self) -> list[Path]:
        """Directories a crashed save left behind: temporary ones, and step directories without the marker."""
        if not self.root.is_dir():
            return []
        return sorted(
            p
            for p in self.root.iterdir()
            if p.is_dir() and ((p.name.startswith(".global_step_") and (".tmp-" in p.name or ".old-" in p.name)) or (_STEP_DIR.match(p.name) and not is_complete(p)))
        )

    def find_last(self) -> Path | None:
        """The newest complete checkpoint whose files match its manifest; the others are reported and skipped."""
        for path in self.incomplete():
            print(f"checkpoint: ignoring incomplete {path} (left by an interrupted save; remove it when you like)", flush=True)
        for path in reversed(self.complete()):
            problem = check_manifest(path)
            if problem is None:
                return path
            print(
                f"checkpoint: WARNING: skipping {path}: {problem}. Resuming from the newest checkpoint before it "
                f"instead; to start from it anyway, set trainer.load_checkpoint_path={path}",
                flush=True,
            )
        return None

    def remove_stale_temporaries(self) -> list[Path]:
        """Remove the temporary directories that killed saves left; call once at start, under the run lock.

        The run lock makes this run the only one saving into the directory, so no temporary
        directory here belongs to a live save. Removed: an unmarked ``.tmp-`` directory (a save
        that never finished), and a marked ``.tmp-`` or ``.old-`` one whose step has a complete
        ``global_step_<k>`` beside it (a second copy). A marked one without a complete step
        directory may be that step's only whole copy: it is reported by ``find_last`` and kept.
        """
        removed = []
        for path in self.incomplete():
            match = _TEMPORARY.match(path.name)
            if match is None:
                continue
            final = self.root / f"global_step_{match.group(1)}"
            if not is_complete(path) or is_complete(final):
                print(f"checkpoint: removing {path}, left by a save that was killed", flush=True)
                self._remove(path)
                removed.append(path)
        return removed

    def resume_path(self, load_checkpoint_path: str | None, find_last_checkpoint: bool) -> Path | None:
        """The checkpoint a run starts from: the named one, else the newest complete one if asked, else none."""
        if load_checkpoint_path:
            return Path(load_checkpoint_path)
        return self.find_last() if find_last_checkpoint else None

    def begin(self, step: int) -> Path:
        """A fresh temporary directory for the save of ``step``."""
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".global_step_{step}.tmp-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        return tmp

    def commit(self, tmp: Path, step: int) -> Path:
        """Make the save in ``tmp`` the checkpoint of ``step``; then apply save_limit.

        The manifest and the marker are written into ``tmp`` before it gets its final name, so a
        ``global_step_<k>`` directory is never seen unmarked by a kill of this vlmrl.
        """
        final = self.root / f"global_step_{step}"
        try:
            write_manifest(tmp)
            _fsync_tree(tmp)
            _write_marker(tmp, step)
        except OSError:  # a disk that fills at the last write: no full-size temporary directory is left
            self.discard(tmp)
            raise
        if final.exists():
            # Saving a step twice (val_only after a resume, or a step whose earlier copy a resume skipped):
            # the new copy, marked complete, is swapped in with one atomic exchange, so there is always a
            # complete checkpoint of this step. An unmarked leftover (an older vlmrl killed between its rename
            # and its marker; a resume never loads it) is replaced the same way.
            if not is_complete(final):
                print(f"checkpoint: replacing {final}, an unmarked leftover of an interrupted save", flush=True)
            old = self.root / f".global_step_{step}.old-{uuid.uuid4().hex[:8]}"
            if _exchange(tmp, final):
                os.rename(tmp, old)  # tmp now holds the old copy
            else:  # no RENAME_EXCHANGE here: a crash between the renames leaves both copies, named
                os.rename(final, old)
                os.rename(tmp, final)
            _fsync_dir(self.root)
            self._remove(old)
        else:
            os.rename(tmp, final)
            _fsync_dir(self.root)
        self._apply_limit()
        return final

    def discard(self, tmp: Path) -> None:
        """Remove the temporary directory of a save that failed (a full disk, a worker error)."""
        print(f"checkpoint: the save failed; removing its temporary directory {tmp}", flush=True)
        self._remove(tmp)

    def _apply_limit(self) -> None:
        if not self.save_limit or self.save_limit < 1:
            return
        for path in self.complete()[: -self.save_limit]:
            # Unmark first: a crash mid-delete leaves an incomplete directory, never a broken "complete" one.
            (path / MARKER).unlink()
            self._remove(path)

    @staticmethod
    def _remove(path: Path) -> None:
        """Delete a directory; a failure (a busy NFS file, a permission) is reported, not fatal: the save is done."""
        try:
            shutil.rmtree(path)
        except OSError as e:
            print(f"checkpoint: could not remove {path} ({e}); remove it yourself", flush=True)


def _sha256(file: Path) -> str:
    digest = hashlib.sha256()
    with open(file, "rb") as f:
        for block in iter(lambda: f.read(1 << 16), b""):
            digest.update(block)
    return digest.hexdigest()


def _files(directory: Path) -> list[Path]:
    """Every file under ``directory`` but the manifest and the marker, in a stable order."""
    return sorted(
        p for p in directory.rglob("*") if p.is_file() and p.relative_to(directory).as_posix() not in (MANIFEST, MARKER)
    )


def write_manifest(directory: Path) -> None:
    """``MANIFEST.json``: each file's relative path, its size, and the SHA-256 of those under ``HASHED_BELOW``."""
    entries = {}
    for file in _files(directory):
        size = file.stat().st_size
        entry = {"size": size, "sha256": _sha256(file)} if size < HASHED_BELOW else {"size": size}
        entries[file.relative_to(directory).as_posix()] = entry
    (directory / MANIFEST).write_text(json.dumps({"files": entries}, indent=1) + "\n")


def check_manifest(directory: Path) -> str | None:
    """What is wrong with a checkpoint's files against its manifest, or None when they match.

    A directory without a manifest is refused too: a copy that stopped before the end, or a
    ``COMPLETE`` written by hand, looks exactly like that, so an automatic resume cannot tell it from
    a checkpoint of an older vlmrl (which wrote none). Naming it in ``trainer.load_checkpoint_path``
    loads it on purpose (``vlmrl.driver.resume.check_resume``).
    """
    try:
        entries = json.loads((directory / MANIFEST).read_text())["files"]
    except FileNotFoundError:
        return f"it has no {MANIFEST} (an interrupted copy, or a checkpoint written by an older vlmrl)"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"its {MANIFEST} cannot be read ({e})"
    problems = []
    for name, entry in sorted(entries.items()):
        file = directory / name
        if not file.is_file():
            problems.append(f"{name} is missing")
        elif file.stat().st_size != entry.get("size"):
            problems.append(f"{name} has {file.stat().st_size} bytes, not {entry.get('size')}")
        elif "sha256" in entry and _sha256(file) != entry["sha256"]:
            problems.append(f"{name} has changed (SHA-256)")
    if not problems:
        return None
    more = f"; and {len(problems) - 4} more" if len(problems) > 4 else ""
    return f"its files do not match its {MANIFEST}: {'; '.join(problems[:4])}{more}"


def _write_marker(directory: Path, step: int) -> None:
    with open(directory / MARKER, "w") as f:
        f.write(f"{step}\n")
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(directory)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one atomic step (Linux renameat2 with RENAME_EXCHANGE); False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):  # a filesystem or kernel without it
        return False
    raise OSError(err, os.strerror(err), f"{a} <-> {b}")


def verify_shards(tmp: Path, world_size: int) -> None:
    """Before a save is marked complete: every rank's files of every sharded role are there, at full size.

    On nodes without a shared filesystem the other ranks' shards land on their own disks; this
    refuses such a save instead of marking a checkpoint complete that no node can resume from.
    """
    problems = []
    for role in ("actor", "critic"):
        directory = tmp / role
        if not directory.is_dir():
            continue
        if not (directory / ".metadata").is_file():
            problems.append(f"{role}/.metadata is missing")
            continue
        needed: dict[str, int] = {}
        for info in (read_metadata_safely(directory).storage_data or {}).values():
            needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
        for name, size in sorted(needed.items()):
            file = directory / name
            if not file.is_file():
                problems.append(f"{role}/{name} is missing")
            elif file.stat().st_size < size:
                problems.append(f"{role}/{name} is cut short ({file.stat().st_size} of {size} bytes)")
        problems += [f"{role}/rng_rank{r}.pt is missing" for r in range(world_size) if not (directory / f"rng_rank{r}.pt").is_file()]
    if problems:
        raise CheckpointError(
            f"{tmp}: the save is not whole, so it is not marked complete: {'; '.join(problems[:8])}"
            + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
            + ". With several nodes the checkpoint directory must be on a filesystem every node shares."
        )


def save_trainer_state(path: Path, state: dict) -> None:
    torch.save(state, path / "trainer_state.pt")


def load_trainer_state(path: Path) -> dict:
    return torch.load(path / "trainer_state.pt", weights_only=True)


def _model_config_file(model_path: str) -> Path | None:
    """The config.json of a local model directory, or of a hub id (through the Hugging Face cache or hub)."""
    local = Path(model_path) / "config.json"
    if local.is_file():
        return local
    if Path(model_path).exists():
        return None
    try:
        from transformers.utils import cached_file

        found = cached_file(model_path, "config.json")
    except Exception:  # offline and not cached, or no such id: the workers' model load reports it
        return None
    return Path(found) if found else None


def check_model_matches(checkpoint: Path, model_path: str) -> None:
    """Fail before any worker starts when the checkpoint holds another architecture than the configured model."""
    saved_file = checkpoint / "actor" / "huggingface" / "config.json"
    current_file = _model_config_file(model_path)
    if not saved_file.is_file() or current_file is None:
        return
    saved, current = json.loads(saved_file.read_text()), json.loads(current_file.read_text())
    keys = ("architectures", "model_type", "hidden_size", "num_hidden_layers", "vocab_size")

    def pick(cfg: dict) -> dict:
        text = cfg.get("text_config", {})
        return {k: cfg.get(k, text.get(k)) for k in keys}

    if pick(saved) != pick(current):
        differing = {k: (pick(saved)[k], pick(current)[k]) for k in keys if pick(saved)[k] != pick(current)[k]}
        raise CheckpointError(
            f"checkpoint {checkpoint} was saved from a different model than "
            f"worker.actor.model.model_path={model_path}: {differing} (checkpoint, configured). "
            "Point model_path at the model the run started from, or start a new run."
        )
