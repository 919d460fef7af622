"""The shared tiny model + synthetic data used by tests, demos and the quickstart.

``ensure_tiny_assets()`` (the random model and the test data) and
``ensure_quickstart_assets()`` (the quickstart's format-tuned model and data)
build them once into a cache directory and reuses
them afterwards, also across processes: concurrent callers (pytest-xdist
workers, Ray actors, a CI job next to a developer's shell) serialise on an
``fcntl.flock``, the build goes to a temporary directory that is renamed into
place, and a marker file inside it says the build finished. The directory name
carries a hash of the builder sources and the transformers version, so a
change to either builds a fresh copy instead of reusing a stale one.

CLI: ``python -m vlmrl.testing.assets [--cache-dir D] [--quickstart]`` prints the paths;
``--build GROUP ...`` also builds those ``${tiny:...}`` groups (``vlmrl.testing.resolvers.GROUPS``), in that order.
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

from vlmrl.testing import format_tune, sft, synthetic, text_format_tune, tiny_text, tiny_vlm

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
    """The random-init tiny Qwen2.5-VL and the synthetic colour task (varied canvases), for tests."""

    model_dir: Path
    train_file: Path
    val_file: Path


@dataclass(frozen=True)
class QuickstartAssets:
    """What examples/quickstart.yaml trains on, built from ``TinyAssets.model_dir`` on first use."""

    model_dir: Path
    """The tiny model format-tuned to answer with a random colour word (``vlmrl.testing.format_tune``)."""
    train_file: Path
    val_file: Path
    """The quickstart's task: one large shape on a white canvas."""
    blank_train_file: Path
    blank_val_file: Path
    """The same rows with the shapes removed: the baseline of a policy that cannot see."""


@dataclass(frozen=True)
class TextAssets:
    """Tiny random-init text-only LMs (Qwen2 and Qwen3 dense) and a text math task in math12k's columns."""

    model_dir: Path
    """Qwen2 (``Qwen2ForCausalLM``), a tokenizer and no processor."""
    qwen3_model_dir: Path
    """Qwen3 (``Qwen3ForCausalLM``)."""
    qwen3_tuned_model_dir: Path
    """The Qwen3 format-tuned to answer the math prompt in EasyR1's format about half the time (0.58 of 64 samples at temperature 1 in vLLM; 80 tuning steps gave mostly garbled text)
    (``vlmrl.testing.text_format_tune``), so that the math reward differs within a group."""
    math_train_file: Path
    math_val_file: Path
    """Arithmetic problems: ``problem``, ``answer`` (``vlmrl.testing.tiny_text.write_math_dataset``)."""


def default_cache_dir() -> Path:
    if env := os.environ.get("VLMRL_CACHE_DIR"):
        return Path(env)
    return Path(__file__).resolve().parents[2] / ".cache" / "vlmrl"


def _version(modules: tuple, settings: str) -> str:
    digest = hashlib.sha256()
    for module in modules:
        digest.update(Path(module.__file__).read_bytes())
    digest.update(settings.encode())
    digest.update(importlib.metadata.version("transformers").encode())
    return digest.hexdigest()[:12]


def assets_version() -> str:
    """Hash of everything that decides the bytes of the built tiny assets."""
    return _version((tiny_vlm, synthetic), f"{FAMILY}:{SEED}:{N_TRAIN}:{N_VAL}")


def quickstart_version() -> str:
    """Hash of everything that decides the bytes of the quickstart assets (the tiny model's included)."""
    settings = f"{assets_version()}:{QUICKSTART_TASK}:{QUICKSTART_N_TRAIN}:{QUICKSTART_N_VAL}"
    return _version((synthetic, format_tune), settings)


def text_assets_version() -> str:
    """Hash of everything that decides the bytes of the text assets."""
    settings = f"text:{SEED}:{N_TRAIN}:{N_VAL}:{text_format_tune.MATH_PROMPT.read_text()}"
    return _version((tiny_vlm, tiny_text, text_format_tune, sft), settings)


def _text_layout(root: Path) -> TextAssets:
    return TextAssets(
        model_dir=root / "tiny-qwen2-text",
        qwen3_model_dir=root / "tiny-qwen3-text",
        qwen3_tuned_model_dir=root / "tiny-qwen3-text-format-tuned",
        math_train_file=root / "math" / "train.parquet",
        math_val_file=root / "math" / "val.parquet",
    )


def _build_text(root: Path) -> None:
    assets = _text_layout(root)
    tiny_text.build_tiny_text_lm(assets.model_dir, family="qwen2", seed=SEED)
    tiny_text.build_tiny_text_lm(assets.qwen3_model_dir, family="qwen3", seed=SEED)
    tiny_text.write_math_dataset(assets.math_train_file.parent, n_train=N_TRAIN, n_val=N_VAL, seed=SEED)
    text_format_tune.format_tune_math(assets.qwen3_model_dir, assets.qwen3_tuned_model_dir, assets.math_train_file)


def _layout(root: Path) -> TinyAssets:
    return TinyAssets(
        model_dir=root / f"tiny-{FAMILY}",
        train_file=root / "data" / "train.parquet",
        val_file=root / "data" / "val.parquet",
    )


def _quickstart_layout(root: Path) -> QuickstartAssets:
    return QuickstartAssets(
        model_dir=root / f"tiny-{FAMILY}-format-tuned",
        train_file=root / "data" / "train.parquet",
        val_file=root / "data" / "val.parquet",
        blank_train_file=root / "blank" / "train.parquet",
        blank_val_file=root / "blank" / "val.parquet",
    )


def _build(root: Path) -> None:
    assets = _layout(root)
    tiny_vlm.build_tiny_vlm(assets.model_dir, family=FAMILY, seed=SEED)
    synthetic.write_synthetic_dataset(assets.train_file.parent, n_train=N_TRAIN, n_val=N_VAL, seed=SEED)


def _build_quickstart(root: Path, base: TinyAssets) -> None:
    assets = _quickstart_layout(root)
    for blank, train_file in ((False, assets.train_file), (True, assets.blank_train_file)):
        synthetic.write_synthetic_dataset(
            train_file.parent, QUICKSTART_N_TRAIN, QUICKSTART_N_VAL, SEED, task=QUICKSTART_TASK, blank_images=blank
        )
    format_tune.format_tune(base.model_dir, assets.model_dir, task=QUICKSTART_TASK, seed=SEED)


def _ensure(cache_dir: Path, final: Path, version: str, build) -> None:
    """Build into ``final`` once (``build(tmp_dir)``), safely across processes."""
    if (final / _MARKER).is_file():
        return
    cache_dir.mkdir(parents=True, exist_ok=True)
    with open(cache_dir / f"{final.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if (final / _MARKER).is_file():  # another process built it meanwhile
            return
        # A directory without the marker is debris from an interrupted manual copy.
        shutil.rmtree(final, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=cache_dir))
        try:
            build(tmp)
            # Written last: its presence means every file is complete.
            (tmp / _MARKER).write_text(version + "\n")
            tmp.chmod(0o755)  # mkdtemp makes it 0700; the cache may be shared
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


def ensure_tiny_assets(cache_dir: Path | None = None) -> TinyAssets:
    """Return the tiny model and synthetic data, building them on first use."""
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    version = assets_version()
    final = cache_dir / f"tiny-assets-{version}"
    _ensure(cache_dir, final, version, _build)
    return _layout(final)


def ensure_quickstart_assets(cache_dir: Path | None = None) -> QuickstartAssets:
    """Return the quickstart's format-tuned model and data, building them (and the tiny assets) on first use."""
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    base = ensure_tiny_assets(cache_dir)
    version = quickstart_version()
    final = cache_dir / f"quickstart-assets-{version}"
    _ensure(cache_dir, final, version, lambda tmp: _build_quickstart(tmp, base))
    return _quickstart_layout(final)


def ensure_text_assets(cache_dir: Path | None = None) -> TextAssets:
    """Return the tiny text LMs and the math data, building them on first use."""
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    version = text_assets_version()
    final = cache_dir / f"text-assets-{version}"
    _ensure(cache_dir, final, version, _build_text)
    return _text_layout(final)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Build (once) and print the tiny VLM and synthetic data paths.")
    parser.add_argument("--cache-dir", type=Path, default=None, help="default: $VLMRL_CACHE_DIR or <repo>/.cache/vlmrl")
    parser.add_argument("--quickstart", action="store_true", help="also the quickstart's format-tuned model and data")
    parser.add_argument(
        "--build", nargs="+", default=[], metavar="GROUP",
        help="also build these ${tiny:...} asset groups, in this order (e.g. agent judge)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    groups = {}
    if args.build:
        # The resolvers import this module: imported here, only when asked for, to keep the import one-way.
        from vlmrl.testing.resolvers import GROUPS as groups

        unknown = [name for name in args.build if name not in groups]
        if unknown:  # before anything is built
            parser.error(f"--build {' '.join(unknown)}: unknown group; choose from {', '.join(groups)}")
    for name, path in vars(ensure_tiny_assets(args.cache_dir)).items():
        print(f"{name}={path}")
    if args.quickstart:
        for name, path in vars(ensure_quickstart_assets(args.cache_dir)).items():
            print(f"quickstart_{name}={path}")
    cache = args.cache_dir if args.cache_dir is not None else default_cache_dir()
    for name in args.build:
        groups[name].ensure(cache)
        print(f"built {name}: {groups[name].root(cache)}", flush=True)


if __name__ == "__main__":
    main()
