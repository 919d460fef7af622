"""Progress and throughput: the step bar with its ETA, tokens per second, and an estimated MFU.

MFU (model FLOPs utilisation) here is an estimate, in the usual way: a
forward pass costs about 2 x parameters FLOPs per token and a training pass
(forward + backward) about 6 x, so one GRPO step costs

    N x T x (2 [rollout] + 2 [old log-probs] + 2 [reference, if used] + 6 x ppo_epochs [update])

for N parameters and T tokens (prompt + response, image tokens included, over
all samples of the step). Attention's own FLOPs, the vision tower's patches
before merging and the prefix caching of the rollout are left out.
``perf/mfu`` divides that by (seconds of the step x workers x peak FLOP/s of one
device); ``perf/mfu/actor`` does the same for the update pass alone.

The peak of a GPU comes from ``PEAK_FLOPS`` (dense bf16 tensor-core figures from
the vendors' datasheets); a GPU not in the table gets no MFU. On CPU the
"device" is one worker's share of the cores, and its peak is measured once at
start-up with a matmul benchmark in the actor's dtype.
"""

from __future__ import annotations

import json
import math
import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from vlmrl.config import Config
    from vlmrl.plan import Plan
    from vlmrl.records import Batch

PEAK_FLOPS: dict[str, float] = {
    # Dense bf16 tensor-core peak per device, FLOP/s (no sparsity).
    "H200": 989e12,
    "H100": 989e12,  # SXM
    "H100 PCIe": 756e12,
    "H100 NVL": 835e12,
    "H800": 989e12,
    "H20": 148e12,
    "A100": 312e12,
    "A800": 312e12,
    "L40S": 362e12,
    "L40": 181e12,
    "L20": 119.5e12,
    "RTX 4090": 165e12,
}


def peak_flops(device_name: str) -> float | None:
    """The table's peak for a device name as torch or Ray reports it; None if it is not in the table.

    The longest table key found in the name wins, so "H100 PCIe" is not read as "H100",
    and an "L40S" not as an "L40".

    >>> peak_flops("NVIDIA H100 80GB HBM3") == PEAK_FLOPS["H100"]
    True
    >>> peak_flops("NVIDIA L40S") == PEAK_FLOPS["L40S"]
    True
    >>> peak_flops("Tesla T4") is None
    True
    """
    name = device_name.upper().replace("-", " ")
    matches = [key for key in PEAK_FLOPS if key.upper() in name]
    return PEAK_FLOPS[max(matches, key=len)] if matches else None


def measure_cpu_peak_flops(
    threads: int, dtype: torch.dtype = torch.float32, size: int = 1024, seconds: float = 0.5
) -> float:
    """FLOP/s of the fastest of repeated ``size`` x ``size`` matmuls on ``threads`` threads.

    The best repetition, not the mean: the peak is what the cores can do, and
    other processes on the machine only ever make a repetition slower.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
        out = torch.mm(a, b)  # warm-up: thread pool, kernels
        best, reps, deadline = math.inf, 0, time.perf_counter() + seconds
        while reps < 3 or time.perf_counter() < deadline:
            start = time.perf_counter()
            torch.mm(a, b, out=out)
            best = min(best, time.perf_counter() - start)
            reps += 1
        return 2 * size**3 / best
    finally:
        torch.set_num_threads(previous)


def count_parameters(model_path: str | Path) -> int | None:
    """Parameters in a HF model directory, read from its safetensors headers (no weights are loaded)."""
    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        return None
    total = 0
    for file in files:
        with file.open("rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
        total += sum(math.prod(t["shape"]) for name, t in header.items() if name != "__metadata__")
    return total


def accelerator_name() -> str | None:
    """The GPU model the run uses, or None on CPU.

    The Runner may not see the GPUs itself (Ray hides them from an actor that
    asked for none), so Ray's record of the node's accelerator type is asked second.
    """
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    import ray

    if ray.is_initialized() and ray.cluster_resources().get("GPU", 0) > 0:
        for key in ray.cluster_resources():
            if key.startswith("accelerator_type:"):
                return key.split(":", 1)[1]
    return None


@dataclass(frozen=True)
class FlopsModel:
    num_params: int
    ppo_epochs: int
    use_reference: bool

    def step_flops(self, tokens: int) -> float:
        """Rollout, old log-probs, reference log-probs (if used) and the updates."""
        forward_passes = 3 if self.use_reference else 2
        return self.num_params * tokens * (2 * forward_passes + 6 * self.ppo_epochs)

    def update_flops(self, tokens: int) -> float:
        return 6 * self.num_params * tokens * self.ppo_epochs


class PerfMeter:
    """Turns a step's token count and phase timings into the ``perf/*`` metrics."""

    def __init__(self, world_size: int, peak: float | None, flops: FlopsModel | None):
        self.world_size, self.peak, self.flops = world_size, peak, flops

    @classmethod
    def for_run(cls, config: Config, plan: Plan) -> PerfMeter:
        """Look up (GPU) or measure (CPU) the device's peak, count the model's parameters, and say so."""
        model_path = config.worker.actor.model.model_path
        num_params = count_parameters(model_path)
        flops = None
        if num_params:
            flops = FlopsModel(num_params, config.worker.actor.ppo_epochs, plan.use_reference)
        gpu = accelerator_name()
        if gpu is not None:
            peak, device = peak_flops(gpu), gpu
            source = "from the table" if peak else "not in the table, so no MFU"
        else:
            # One worker's share of the cores, as the worker group gives it (OMP_NUM_THREADS).
            threads = max(1, (os.cpu_count() or 1) // plan.world_size)
            dtype = getattr(torch, plan.actor_dtype)
            peak = measure_cpu_peak_flops(threads, dtype)
            device, source = f"cpu ({threads} threads)", f"measured, {dtype}"
        shown = f"{peak / 1e9:.1f} GFLOP/s" if peak else "unknown"
        params = (
            f"{num_params / 1e6:.2f}M parameters" if num_params else "parameters unknown (no safetensors), so no MFU"
        )
        print(f"perf: device {device}, peak {shown} ({source}); model {params}", flush=True)
        return cls(plan.world_size, peak, flops)

    def metrics(self, batch: Batch, timings: dict[str, float]) -> dict[str, float]:
        tokens = int(batch.attention_mask.sum())
        seconds = timings["step"]
        metrics = {
            "perf/total_num_tokens": float(tokens),
            "perf/time_per_step": seconds,
            # EasyR1's name and a plain one for the same number: the step's tokens per second per worker device.
            "perf/throughput": tokens / (seconds * self.world_size),
            "perf/tokens_per_second_per_device": tokens / (seconds * self.world_size),
        }
        if self.flops is not None and self.peak:
            capacity = self.world_size * self.peak
            metrics["perf/mfu"] = self.flops.step_flops(tokens) / (seconds * capacity)
            if timings.get("update_actor"):
                metrics["perf/mfu/actor"] = self.flops.update_flops(tokens) / (timings["update_actor"] * capacity)
        return metrics


class ProgressBar:
    """The bar over the run's steps, with its ETA, drawn on the driver's terminal.

    Ray's ``tqdm_ray`` draws it: from inside an actor (the Runner) it sends the
    bar's state to the driver, which draws it and keeps the actors' log lines
    from tearing it. A resumed run's bar starts at the step it resumed from,
    out of the run's total.
    """

    def __init__(self, total_steps: int, start_step: int = 0):
        from ray.experimental.tqdm_ray import tqdm

        desc = f"training (resumed at step {start_step})" if start_step else "training"
        self.bar = tqdm(total=total_steps, desc=desc, unit="step", flush_interval_s=0)
        self.bar.n = start_step
        self.bar.refresh()

    def update(self, step: int) -> None:
        """The run has finished ``step``."""
        self.bar.n = step
        self.bar.refresh()

    def close(self) -> None:
        self.bar.close()
