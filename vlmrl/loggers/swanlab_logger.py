"""``swanlab``: SwanLab, used only when the swanlab package is installed.

Settings (API key, SWANLAB_MODE, workspace, ...) come from swanlab's own
environment variables. Local files go to <experiment dir>/swanlog/.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vlmrl.loggers.base import RunInfo, ValidationSample, image_strip


class SwanlabLogger:
    def __init__(self, run: RunInfo, resume: dict[str, Any] | None = None):
        import swanlab

        self.swanlab = swanlab
        self.run = swanlab.init(
            project=run.project,
            experiment_name=run.experiment,
            config={**run.config, "plan": run.plan},
            logdir=str(Path(run.experiment_dir) / "swanlog"),
            id=resume["run_id"] if resume else None,
            resume="must" if resume else None,
        )

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def log_samples(self, samples: list[ValidationSample], step: int) -> None:
        images, texts = [], []
        for s in samples:
            caption = f"[{s.data_source}] reward {s.reward:.3g} | answer: {s.response} | truth: {s.ground_truth}"
            image = image_strip(s.images)
            if image is not None:
                images.append(self.swanlab.Image(image, caption=caption))
            texts.append(self.swanlab.Text(f"{s.prompt}\n---\n{caption}"))
        data = {"val/samples": texts, **({"val/sample_images": images} if images else {})}
        if samples:
            self.run.log(data, step=step)

    def state(self) -> dict[str, Any]:
        return {"run_id": self.run.id}

    def close(self, failed: bool = False) -> None:
        if failed:
            self.swanlab.finish(state="crashed", error="the vlmrl run failed; see its log")
        else:
            self.swanlab.finish()
