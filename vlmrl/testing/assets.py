"""The shared tiny model + synthetic data used by tests, demos and the quickstart.

``ensure_tiny_assets()`` builds them once into a cache directory and reuses
them afterwards, also across processes: concurrent callers (pytest-xdist
workers, Ray actors, a CI job next to a developer's shell) serialise on an
``fcntl.flock``, the build goes to a temporary directory that is renamed into
place, and a marker file inside it says the build finished. The directory name
carries a hash of the builder sources and the transformers version, so a
change to either builds a fresh copy instead of reusing a stale one.

CLI: ``python -m vlmrl.testing.assets [--cache-dir D]`` prints the paths.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import importlib.metadata
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from vlmrl.testing import format_tune, synthetic, tiny_vlm

FAMILY = "qwen2_5_vl"
SEED = 0
N_TRAIN = 256
N_VAL = 64
# The quickstart's own task and sizes (examples/quickstart.yaml).
QUICKSTART_TASK = "shape_colour"
QUICKSTART_N_TRAIN = 1024
QUICKSTART_N_VAL = 128
_MARKER = "COMPLETE"


@dataclass(frozen=True)
class TinyAssets:
    model_dir: Path
    """The random-init tiny Qwen2.5-VL."""
    train_file: Path
    val_file: Path
    """The synthetic colour task (varied canvases), for tests."""
    quickstart_model_dir: Path
    """``model_dir`` format-tuned (``vlmrl.testing.format_tune``): answers with a random colour word."""
    quickstart_train_file: Path
    quickstart_val_file: Path
    """The quickstart's task: one large shape on a white canvas."""
    quickstart_blank_train_file: Path
    quickstart_blank_val_file: Path
    """The same rows with the shapes removed: the baseline of a policy that cannot see."""


def default_cache_dir() -> Path:
    if env := os.environ.get("VLMRL_CACHE_DIR"):
        return Path(env)
    return Path(__file__).resolve().parents[2] / ".cache" / "vlmrl"


def assets_version() -> str:
    """Hash of everything that decides the bytes of the built assets."""
    digest = hashlib.sha256()
    for module in (tiny_vlm, synthetic, format_tune):
        digest.update(Path(module.__file__).read_bytes())
    digest.update(f"{FAMILY}:{SEED}:{N_TRAIN}:{N_VAL}:{QUICKSTART_N_TRAIN}:{QUICKSTART_N_VAL}".encode())
    digest.update(importlib.metadata.version("transformers").encode())
    return digest.hexdigest()[:12]


def _layout(root: Path) -> TinyAssets:
    return TinyAssets(
        model_dir=root / f"tiny-{FAMILY}",
        train_file=root / "data" / "train.parquet",
        val_file=root / "data" / "val.parquet",
        quickstart_model_dir=root / f"tiny-{FAMILY}-format-tuned",
        quickstart_train_file=root / "quickstart" / "train.parquet",
        quickstart_val_file=root / "quickstart" / "val.parquet",
        quickstart_blank_train_file=root / "quickstart-blank" / "train.parquet",
        quickstart_blank_val_file=root / "quickstart-blank" / "val.parquet",
    )


def _build(root: Path) -> None:
    assets = _layout(root)
    tiny_vlm.build_tiny_vlm(assets.model_dir, family=FAMILY, seed=SEED)
    synthetic.write_synthetic_dataset(assets.train_file.parent, n_train=N_TRAIN, n_val=N_VAL, seed=SEED)
    for blank, train_file in ((False, assets.quickstart_train_file), (True, assets.quickstart_blank_train_file)):
        synthetic.write_synthetic_dataset(
            train_file.parent, QUICKSTART_N_TRAIN, QUICKSTART_N_VAL, SEED, task=QUICKSTART_TASK, blank_images=blank
        )
    format_tune.format_tune(assets.model_dir, assets.quickstart_model_dir, task=QUICKSTART_TASK, seed=SEED)
    # Written last: its presence means every file above is complete.
    (root / _MARKER).write_text(assets_version() + "\n")


def ensure_tiny_assets(cache_dir: Path | None = None) -> TinyAssets:
    """Return the tiny model and synthetic data, building them on first use."""
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = cache_dir / f"tiny-assets-{assets_version()}"
    if (final / _MARKER).is_file():
        return _layout(final)

    cache_dir.mkdir(parents=True, exist_ok=True)
    with open(cache_dir / f"{final.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not (final / _MARKER).is_file():  # another process may have built it meanwhile
            # A directory without the marker is debris from an interrupted manual copy.
            shutil.rmtree(final, ignore_errors=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=cache_dir))
            try:
                _build(tmp)
                tmp.chmod(0o755)  # mkdtemp makes it 0700; the cache may be shared
                os.rename(tmp, final)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
    return _layout(final)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Build (once) and print the tiny VLM and synthetic data paths.")
    parser.add_argument("--cache-dir", type=Path, default=None, help="default: $VLMRL_CACHE_DIR or <repo>/.cache/vlmrl")
    args = parser.parse_args(argv)
    assets = ensure_tiny_assets(args.cache_dir)
    for name, path in vars(assets).items():
        print(f"{name}={path}")


if __name__ == "__main__":
    main()
