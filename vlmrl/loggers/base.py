"""What every logger is given, and the helpers they share."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class RunInfo:
    """The run a tracker reports on."""

    project: str
    """trainer.project_name: the MLflow experiment, the W&B / SwanLab project."""
    experiment: str
    """trainer.experiment_name: the run's name."""
    experiment_dir: str
    """<output_dir>/<project>/<experiment>: where local stores and files go."""
    config: dict[str, Any]
    """The resolved config as plain data (``vlmrl.config.to_dict``)."""
    plan: dict[str, Any] = field(default_factory=dict)
    """The derived values (``Plan.as_dict``)."""
    resumed_step: int | None = None
    """The step of the checkpoint a training run resumes from (None for a fresh run or a val_only one)."""

    def params(self) -> dict[str, str]:
        """The config and the plan flattened to dotted keys, for hyper-parameter tables."""
        return {**flatten(self.config), **flatten(self.plan, "plan.")}


@dataclass
class ValidationSample:
    """One validation response with what it answered and how it scored."""

    step: int
    data_source: str
    prompt: str
    images: list[Any]
    """The prompt's images as PIL images (empty for a text-only prompt)."""
    response: str
    ground_truth: str
    scores: dict[str, float]
    """``overall`` (the reward) and the reward function's sub-scores."""

    @property
    def reward(self) -> float:
        return self.scores["overall"]

    @property
    def sub_scores(self) -> dict[str, float]:
        return {k: v for k, v in self.scores.items() if k != "overall"}


class Logger(Protocol):
    def log(self, metrics: dict[str, float], step: int) -> None:
        """Scalars of one step."""

    def log_samples(self, samples: list[ValidationSample], step: int) -> None:
        """Validation responses of one validation, with their images."""

    def state(self) -> dict[str, Any]:
        """What a resumed run needs to continue this logger's run (empty if nothing)."""

    def close(self, failed: bool = False) -> None: ...


def flatten(value: Any, prefix: str = "") -> dict[str, str]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": "1"}``; lists and empty mappings as JSON text.

    >>> flatten({"data": {"seed": 1, "files": "x.parquet"}, "betas": [0.9, 0.99], "kw": {}})
    {'data.seed': '1', 'data.files': 'x.parquet', 'betas': '[0.9, 0.99]', 'kw': '{}'}
    """
    if isinstance(value, dict) and value:
        out: dict[str, str] = {}
        for key, inner in value.items():
            out.update(flatten(inner, f"{prefix}{key}."))
        return out
    key = prefix.removesuffix(".")
    if isinstance(value, (dict, list, tuple)):
        return {key: json.dumps(value)}
    return {key: "" if value is None else str(value)}


def image_strip(images: list[Any]):
    """The prompt's images side by side in one PIL image (a table cell holds one image); None if none.

    Images keep their pixels; shorter ones are padded at the bottom, in white.
    """
    if not images:
        return None
    from PIL import Image

    images = [im.convert("RGB") for im in images]
    if len(images) == 1:
        return images[0]
    height = max(im.height for im in images)
    gap = 4
    width = sum(im.width for im in images) + gap * (len(images) - 1)
    strip = Image.new("RGB", (width, height), "white")
    x = 0
    for im in images:
        strip.paste(im, (x, 0))
        x += im.width + gap
    return strip


def placeholder_image():
    """What a text-only prompt shows in an image column (an image column cannot hold blanks)."""
    from PIL import Image

    return Image.new("RGB", (28, 28), (235, 235, 235))
