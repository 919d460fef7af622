"""``wandb``: Weights & Biases, used only when the wandb package is installed.

Settings (API key, WANDB_MODE=offline, entity, ...) come from wandb's own
environment variables. Local files go to <experiment dir>/wandb/.
"""

from __future__ import annotations

from typing import Any

from vlmrl.loggers.base import RunInfo, ValidationSample, image_strip


class WandbLogger:
    def __init__(self, run: RunInfo, resume: dict[str, Any] | None = None):
        import wandb

        self.wandb = wandb
        self.run = wandb.init(
            project=run.project,
            name=run.experiment,
            dir=run.experiment_dir,
            config={**run.config, "plan": run.plan},
            id=resume["run_id"] if resume else None,
            resume="must" if resume else None,
        )

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def log_samples(self, samples: list[ValidationSample], step: int) -> None:
        if not samples:
            return
        score_keys = sorted({k for s in samples for k in s.sub_scores})
        columns = ["step", "data_source", "prompt", "image", "response", "ground_truth", "reward", *score_keys]
        rows = []
        for s in samples:
            image = image_strip(s.images)
            rows.append(
                [s.step, s.data_source, s.prompt, self.wandb.Image(image) if image is not None else None,
                 s.response, s.ground_truth, s.reward, *(s.sub_scores.get(k) for k in score_keys)]
            )  # fmt: skip
        self.run.log({"val/samples": self.wandb.Table(columns=columns, data=rows)}, step=step)

    def state(self) -> dict[str, Any]:
        return {"run_id": self.run.id}

    def close(self, failed: bool = False) -> None:
        self.run.finish(exit_code=1 if failed else 0)
