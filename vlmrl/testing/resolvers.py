"""The ``${tiny:...}`` OmegaConf resolver: a YAML names the locally built tiny model and data by asset name.

Registering it is explicit (``register_resolvers``): ``vlmrl.main`` does it
before it loads a config, and so do the tests' conftest and any script that
loads a YAML using ``${tiny:...}`` (examples/quickstart.yaml does). The config
package knows nothing of it; without it such a YAML fails to load with
OmegaConf's "Unsupported interpolation type tiny".

Registered with ``build=False`` (what ``vlmrl.main`` does first), the resolver
only says where each asset will be and builds nothing: the config is then
validated in full at once, every path the run will build counted as there
(``TinyResolver.pending``), so a mistyped key fails in seconds on an empty
cache, and ``--dry-run`` never trains a tiny model. ``build_missing`` builds
them afterwards, saying on one console line what and why, with the builders'
progress bars in the run's log.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf

from vlmrl.config import ConfigError
from vlmrl.testing import agent_assets, assets, distill_assets, family_assets, judge_assets, tiny_qwen3_5

__all__ = ["TinyResolver", "build_missing", "register_resolvers", "tiny_asset"]


@dataclass(frozen=True)
class AssetGroup:
    """Assets built together into one cache directory, and the groups they are built from."""

    prefix: str
    """What the asset names start with (``quickstart_`` for ``${tiny:quickstart_model_dir}``)."""
    names: tuple[str, ...]
    """The fields of the group's layout."""
    what: str
    """What building it makes, for the console line."""
    root: Callable[[Path], Path]
    """The group's directory in a cache directory."""
    layout: Callable[[Path], object]
    """The group's paths, given its directory."""
    ensure: Callable[[Path], object]
    """Build it (and what it needs) into a cache directory, once."""
    needs: tuple[str, ...] = ()


def _fields(cls) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


GROUPS = {
    "tiny": AssetGroup(
        "", _fields(assets.TinyAssets), "the tiny random Qwen2.5-VL and its synthetic data (seconds)",
        lambda cache: cache / f"tiny-assets-{assets.assets_version()}", assets._layout, assets.ensure_tiny_assets,
    ),
    "quickstart": AssetGroup(
        "quickstart_", _fields(assets.QuickstartAssets), "the quickstart's format-tuned tiny model and data (minutes)",
        lambda cache: cache / f"quickstart-assets-{assets.quickstart_version()}", assets._quickstart_layout,
        assets.ensure_quickstart_assets, ("tiny",),
    ),
    "text": AssetGroup(
        "text_", _fields(assets.TextAssets), "the tiny text LMs and the math data (a minute or two)",
        lambda cache: cache / f"text-assets-{assets.text_assets_version()}", assets._text_layout,
        assets.ensure_text_assets,
    ),
    "agent": AssetGroup(
        "agent_", _fields(agent_assets.AgentAssets), "the agent quickstart's tool-call-tuned tiny model and data (minutes)",
        lambda cache: cache / f"agent-assets-{agent_assets.agent_version()}", agent_assets.agent_layout,
        agent_assets.ensure_agent_assets, ("tiny",),
    ),
    "distill": AssetGroup(
        "distill_", _fields(distill_assets.DistillAssets), "the distillation example's colour teacher (seconds)",
        lambda cache: cache / f"distill-assets-{distill_assets.distill_version()}", distill_assets.distill_layout,
        distill_assets.ensure_distill_assets, ("tiny", "quickstart"),
    ),
    "families": AssetGroup(
        "", family_assets.names(), "the tiny random models of the other families (seconds)",
        lambda cache: cache / f"family-assets-{family_assets.family_version()}", family_assets.family_layout,
        family_assets.ensure_family_assets,
    ),
    "qwen3_5": AssetGroup(
        "", tiny_qwen3_5.names(), "the tiny random Qwen3.5 (seconds)",
        lambda cache: cache / f"qwen3_5-assets-{tiny_qwen3_5.qwen3_5_version()}", tiny_qwen3_5.qwen3_5_layout,
        tiny_qwen3_5.ensure_qwen3_5_assets,
    ),
    "judge": AssetGroup(
        "", _fields(judge_assets.JudgeAssets), "the tiny judge and score models (minutes)",
        lambda cache: cache / f"judge-assets-{judge_assets.judge_version()}", judge_assets.judge_layout,
        judge_assets.ensure_judge_assets, ("tiny", "text"),
    ),
}  # fmt: skip
"""Every ``${tiny:...}`` asset, by the group that builds it."""


def _group_of(name: str) -> tuple[str, str]:
    """(group, field) of asset ``name``; a ConfigError listing the assets when there is none."""
    for key, group in GROUPS.items():
        if name.startswith(group.prefix) and name.removeprefix(group.prefix) in group.names:
            return key, name.removeprefix(group.prefix)
    every = [g.prefix + n for g in GROUPS.values() for n in g.names]
    # Loading turns a ConfigError raised inside a resolver into the config's own problem list.
    raise ConfigError([f"${{tiny:{name}}}: unknown tiny asset; choose one of: {', '.join(every)}"])


def _built(root: Path) -> bool:
    return (root / assets._MARKER).is_file()


class TinyResolver:
    """``${tiny:NAME}``: the asset's path, built on first use (``build=True``) or only planned (``build=False``).

    Planned, it records each group it was asked for that is not built yet, with
    the groups it is built from (``missing``), and builds nothing.
    """

    def __init__(self, build: bool = True, cache_dir: Path | None = None):
        self.build, self.cache_dir = build, cache_dir
        self.missing: list[str] = []
        """The groups to build, dependencies first."""
        self.names: list[str] = []
        """The asset names resolved, in order."""

    def cache(self) -> Path:
        return Path(self.cache_dir) if self.cache_dir is not None else assets.default_cache_dir()

    def __call__(self, name: str) -> str:
        key, field = _group_of(name)
        group, cache = GROUPS[key], self.cache()
        if self.build:
            return str(getattr(group.ensure(cache), field))
        if name not in self.names:
            self.names.append(name)
        for k in (*group.needs, key):
            if k not in self.missing and not _built(GROUPS[k].root(cache)):
                self.missing.append(k)
        return str(getattr(group.layout(group.root(cache)), field))

    def pending(self) -> tuple[str, ...]:
        """The directories of the groups not built yet: paths under them are not to be read before they are."""
        return tuple(str(GROUPS[k].root(self.cache())) for k in self.missing)

    def describe_missing(self) -> str:
        """What building the missing groups makes, and why: the assets the config names."""
        named = ", ".join(f"${{tiny:{name}}}" for name in self.names)
        return f"{'; '.join(GROUPS[k].what for k in self.missing)} (the config names {named})"


def tiny_asset(name: str) -> str:
    """``${tiny:model_dir}``, ``${tiny:quickstart_model_dir}``, the data files and the tiny reward models
    (``${tiny:judge_dir}``, ``${tiny:score_dir}``), in a YAML.

    Builds the tiny random Qwen2.5-VL and its synthetic data (or the
    quickstart's format-tuned model and data) on first use, into
    $VLMRL_CACHE_DIR or <repo>/.cache/vlmrl, so the CPU quickstart runs on a
    machine with no model hub.
    """
    return TinyResolver(build=True)(name)


def register_resolvers(build: bool = True) -> TinyResolver:
    """Register ``${tiny:...}`` with OmegaConf for this process, replacing an earlier one; returns it.

    ``build=False``: resolving says where each asset will be and builds nothing (see ``TinyResolver``).
    """
    resolver = TinyResolver(build=build)
    OmegaConf.register_resolver("tiny", resolver, replace=True)
    return resolver


def build_missing(resolver: TinyResolver, log_path: Path) -> None:
    """Build what ``resolver`` found missing: one console line says what and why, the rest goes to ``log_path``.

    The builders' own output (transformers' progress bars, the tuning's lines) is
    written to file descriptors 1 and 2, so both point at the log while they run.
    """
    if not resolver.missing:
        return
    print(
        f"vlmrl: building {resolver.describe_missing()} into {resolver.cache()}, once for later runs too "
        f"(progress in {log_path})",
        flush=True,
    )
    log_path.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with _output_to(log_path):
        for key in resolver.missing:
            GROUPS[key].ensure(resolver.cache())
        print(f"vlmrl: tiny assets built in {time.perf_counter() - start:.0f} s", flush=True)


@contextlib.contextmanager
def _output_to(log_path: Path):
    """Python's ``sys.stdout`` and ``sys.stderr``, and file descriptors 1 and 2 (C libraries' output), appended to
    ``log_path``."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        with open(log_path, "a", buffering=1) as text:
            os.dup2(log, 1)
            os.dup2(log, 2)
            with contextlib.redirect_stdout(text), contextlib.redirect_stderr(text):
                yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, log):
            os.close(fd)
