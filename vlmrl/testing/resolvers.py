"""The ``${tiny:...}`` OmegaConf resolver: a YAML names the locally built tiny model and data by asset name.

Registering it is explicit (``register_resolvers``): ``vlmrl.main`` does it
before it loads a config, and so do the tests' conftest and any script that
loads a YAML using ``${tiny:...}`` (examples/quickstart.yaml does). The config
package knows nothing of it; without it such a YAML fails to load with
OmegaConf's "Unsupported interpolation type tiny".
"""

from __future__ import annotations

import dataclasses

from omegaconf import OmegaConf

from vlmrl.config import ConfigError
from vlmrl.testing.agent_assets import AgentAssets, ensure_agent_assets
from vlmrl.testing.judge_assets import JudgeAssets, ensure_judge_assets
from vlmrl.testing.assets import (
    QuickstartAssets,
    TextAssets,
    TinyAssets,
    ensure_quickstart_assets,
    ensure_text_assets,
    ensure_tiny_assets,
)

__all__ = ["register_resolvers", "tiny_asset"]


def tiny_asset(name: str) -> str:
    """``${tiny:model_dir}``, ``${tiny:quickstart_model_dir}``, the data files and the tiny reward models
    (``${tiny:judge_dir}``, ``${tiny:score_dir}``), in a YAML.

    Builds the tiny random Qwen2.5-VL and its synthetic data (or the
    quickstart's format-tuned model and data) on first use, into
    $VLMRL_CACHE_DIR or <repo>/.cache/vlmrl, so the CPU quickstart runs on a
    machine with no model hub.
    """
    tiny = [f.name for f in dataclasses.fields(TinyAssets)]
    quickstart = [f"quickstart_{f.name}" for f in dataclasses.fields(QuickstartAssets)]
    text = [f"text_{f.name}" for f in dataclasses.fields(TextAssets)]
    agent = [f"agent_{f.name}" for f in dataclasses.fields(AgentAssets)]
    judge = [f.name for f in dataclasses.fields(JudgeAssets)]  # judge_dir, score_dir
    if name in tiny:
        return str(getattr(ensure_tiny_assets(), name))
    if name in quickstart:
        return str(getattr(ensure_quickstart_assets(), name.removeprefix("quickstart_")))
    if name in text:
        return str(getattr(ensure_text_assets(), name.removeprefix("text_")))
    if name in agent:
        return str(getattr(ensure_agent_assets(), name.removeprefix("agent_")))
    if name in judge:
        return str(getattr(ensure_judge_assets(), name))
    # Loading turns a ConfigError raised inside a resolver into the config's own problem list.
    raise ConfigError([f"${{tiny:{name}}}: unknown tiny asset; choose one of: {', '.join(tiny + quickstart + text + agent + judge)}"])


def register_resolvers() -> None:
    """Register ``${tiny:...}`` with OmegaConf for this process; calling it again is harmless."""
    OmegaConf.register_resolver("tiny", tiny_asset, replace=True)
