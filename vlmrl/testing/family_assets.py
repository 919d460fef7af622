"""The tiny random model of every other family, by name: ``${tiny:glm4v_model_dir}``, ``${tiny:qwen3_vl_model_dir}``.

``${tiny:model_dir}`` is the tiny Qwen2.5-VL the suite and the quickstart
start from; the other families' tiny builders (``tiny_vlm.FAMILIES``) are
reachable the same way, so that a user can try a family on CPU by pointing
``worker.actor.model.model_path`` at one. A family added to ``FAMILIES`` is
an asset here with no further line.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from vlmrl.testing import tiny_vlm

DEFAULT = "qwen2_5_vl"
"""The family of ``${tiny:model_dir}`` (vlmrl.testing.assets), not repeated here."""
SEED = 0


def families() -> tuple[str, ...]:
    return tuple(f for f in tiny_vlm.FAMILIES if f != DEFAULT)


def names() -> tuple[str, ...]:
    """The asset names: ``<family>_model_dir`` for each family but the default."""
    return tuple(f"{f}_model_dir" for f in families())


def family_layout(root: Path) -> SimpleNamespace:
    return SimpleNamespace(**{f"{f}_model_dir": root / f"tiny-{f}" for f in families()})


def family_version() -> str:
    """Hash of everything that decides the bytes of the tiny models: the builders' modules (``tiny_*.py``; a
    family's builder may import its own module lazily)."""
    from vlmrl.testing import assets

    builders = sorted(Path(tiny_vlm.__file__).parent.glob("tiny_*.py"))
    return assets._version(tuple(SimpleNamespace(__file__=p) for p in builders), f"{','.join(families())}:{SEED}")


def ensure_family_assets(cache_dir: Path | None = None) -> SimpleNamespace:
    """Every other family's tiny model, built (seconds each) on first use."""
    from vlmrl.testing import assets

    cache_dir = Path(cache_dir) if cache_dir is not None else assets.default_cache_dir()
    version = family_version()
    final = cache_dir / f"family-assets-{version}"

    def build(tmp: Path) -> None:
        for family, model_dir in zip(families(), vars(family_layout(tmp)).values()):
            tiny_vlm.build_tiny_vlm(model_dir, family=family, seed=SEED)

    assets._ensure(cache_dir, final, version, build)
    return family_layout(final)
