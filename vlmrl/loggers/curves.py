"""The run's curves as one PNG: reward (train and validation), KL, response length, entropy.

Drawn with matplotlib's object API (no pyplot state, no display needed).
"""

from __future__ import annotations

from pathlib import Path

# (panel title, [(metric key, legend label, draw with markers)])
PANELS = (
    ("reward", [("reward/overall", "train", False), ("val/reward/overall", "validation", True)]),
    ("KL to reference", [("actor/reference_kl", "train", False)]),
    ("response length (tokens)", [("response_length/mean", "mean", False)]),
    ("entropy", [("actor/entropy", "actor", False)]),
)
CURVE_KEYS = tuple(key for _, lines in PANELS for key, _, _ in lines)


def plot_curves(history: dict[str, list[tuple[int, float]]], path: str | Path, title: str = "") -> Path:
    """Write the curves of ``history`` ({metric key: [(step, value), ...]}) to a PNG at ``path``."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(8, 5.5), dpi=100, layout="constrained")
    axes = fig.subplots(2, 2).flatten()
    for ax, (panel, lines) in zip(axes, PANELS):
        ax.set_title(panel, fontsize=10)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        drawn = 0
        for key, label, markers in lines:
            points = sorted(history.get(key, []))
            if not points:
                continue
            steps, values = zip(*points)
            # A curve of one point is invisible without a marker.
            marker = "o" if markers or len(points) == 1 else None
            ax.plot(steps, values, marker=marker, markersize=4, label=label)
            drawn += 1
        if drawn == 0:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="gray")
        elif len(lines) > 1:
            ax.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=11)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path
