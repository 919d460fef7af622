"""``tensorboard``: event files in <experiment dir>/tensorboard/.

    tensorboard --logdir <experiment dir>/tensorboard --host 127.0.0.1

Scalars under their metric names; each validation's samples as one markdown
text entry (``val/samples``) and their images (``val/sample_<i>``). A resumed
run writes a new event file into the same directory, which TensorBoard reads
as the same run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vlmrl.loggers.base import RunInfo, ValidationSample, image_strip


def _cell(text: str) -> str:
    """Text that fits in one markdown table cell."""
    return text.replace("|", "\\|").replace("\n", "<br>")


class TensorBoardLogger:
    def __init__(self, run: RunInfo, resume: dict[str, Any] | None = None):
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = Path(run.experiment_dir) / "tensorboard"
        self.writer = SummaryWriter(log_dir=str(self.log_dir))
        if not resume:
            self.writer.add_text("config", "```yaml\n" + _yaml(run.config) + "\n```", 0)

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def log_samples(self, samples: list[ValidationSample], step: int) -> None:
        if not samples:
            return
        import numpy as np

        score_keys = sorted({k for s in samples for k in s.sub_scores})
        header = ["#", "source", "response", "ground truth", "reward", *score_keys]
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for i, s in enumerate(samples):
            row = [str(i), s.data_source, s.response, s.ground_truth, f"{s.reward:.4g}"]
            row += [f"{s.sub_scores[k]:.4g}" if k in s.sub_scores else "" for k in score_keys]
            lines.append("| " + " | ".join(_cell(c) for c in row) + " |")
            image = image_strip(s.images)
            if image is not None:
                self.writer.add_image(f"val/sample_{i}", np.asarray(image), step, dataformats="HWC")
        self.writer.add_text("val/samples", "\n".join(lines), step)
        self.writer.flush()

    def state(self) -> dict[str, Any]:
        return {}

    def close(self, failed: bool = False) -> None:
        self.writer.close()


def _yaml(config: dict) -> str:
    import yaml

    return yaml.safe_dump(config, sort_keys=False)
