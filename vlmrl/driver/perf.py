"""Progress and throughput: the step bar with its ETA, tokens per second, and an estimated MFU.

MFU (model FLOPs utilisation) here is an estimate, in the usual way: a
forward pass costs about 2 x parameters FLOPs per token and a training pass
(forward + backward) about 6 x. A step counts only the passes that ran in it,
read from the step's timings (a phase is timed only when it runs), so one step
costs

    N x T x (2 [rollout, "gen"]
             + 2 [old log-probs, "old": not when the update's forward gives them]
             + 2 [reference log-probs, "ref": only with a reference model]
             + 6 x ppo_epochs [actor update, "update_actor": not during critic warm-up])
    + N_c x T x (2 [values, "values"] + 6 x critic ppo_epochs [critic update, "update_critic"])

for N actor parameters, N_c critic parameters (GAE only: the critic's
checkpoint less its LM head) and T tokens (prompt + response, image tokens
included, over all samples of the step's batch). Attention's own FLOPs, the
vision tower's patches before merging, the prefix caching of the rollout and
generation whose samples the batch does not keep (online filtering's dropped
groups, ReMax's greedy baseline) are left out, and so is the saving of
``worker.actor.share_prompts`` (a prompt's positions count once per sample).
``perf/mfu`` divides that by (seconds of the step x workers x peak FLOP/s of one
device); ``perf/mfu/actor`` and ``perf/mfu/critic`` do the same for the actor's
and the critic's update pass alone.

The peak of a GPU comes from ``PEAK_FLOPS`` (dense bf16 tensor-core figures from
the vendors' datasheets); a GPU not in the table gets no MFU. On CPU the
"device" is one worker's share of the cores, and its peak is measured once at
start-up with a matmul benchmark in the actor's dtype.
"""

from __future__ import annotations

import json
import math
import struct
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from vlmrl.driver.console import report_progress

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
    threads: int, dtype: torch.dtype = torch.float32, size: int = 1024, seconds: float = 0.1
) -> float:
    """FLOP/s of the fastest of repeated square matmuls on ``threads`` threads, in about ``seconds``.

    The best repetition, not the mean: the peak is what the cores can do, and
    other processes on the machine only ever make a repetition slower. The
    matrices grow from 256 up to ``size`` while one product takes under a
    fiftieth of ``seconds``. Where a dtype has no fast CPU kernel, a product
    of 1024 takes seconds (bfloat16 on the 2-core machine: 3 s at 0.7 GFLOP/s,
    where 256 ran at 2.5 GFLOP/s), and every run on CPU measures its peak
    before its first step.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        n = min(256, size)
        while True:
            a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
            out = torch.mm(a, b)  # warm-up: thread pool, kernels
            start = time.perf_counter()
            torch.mm(a, b, out=out)
            once = time.perf_counter() - start
            if n * 2 > size or once >= seconds / 50:
                break
            n *= 2
        best, reps, deadline = once, 1, time.perf_counter() + seconds
        while reps < 3 or time.perf_counter() < deadline:
            start = time.perf_counter()
            torch.mm(a, b, out=out)
            best = min(best, time.perf_counter() - start)
            reps += 1
        return 2 * n**3 / best
    finally:
        torch.set_num_threads(previous)


def count_parameters(model_path: str | Path, without_lm_head: bool = False) -> int | None:
    """Parameters in a HF model directory, read from its safetensors headers (no weights are loaded).

    ``without_lm_head`` leaves out the ``lm_head`` tensors: the critic loads the
    checkpoint without them (a value head in their place). A tied ``lm_head`` is
    not in the file, so there is nothing to leave out.
    """
    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        return None
    total = 0
    for file in files:
        with file.open("rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
        for name, tensor in header.items():
            if name == "__metadata__" or (without_lm_head and ".lm_head." in f".{name}"):
                continue
            total += math.prod(tensor["shape"])
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
    """Model FLOPs of the step's passes, from the parameter counts (see the module docstring)."""

    num_params: int
    """N: the actor's parameters (the reference model has the same architecture)."""
    ppo_epochs: int = 1
    """The actor update's passes over the batch."""
    critic_params: int = 0
    """N_c: the critic's parameters; 0 without a critic."""
    critic_ppo_epochs: int = 1

    def per_token(self) -> dict[str, float]:
        """FLOPs per token of each model pass, keyed by the name the step loop times it under."""
        n, n_c = self.num_params, self.critic_params
        return {
            "gen": 2 * n,
            "old": 2 * n,
            "ref": 2 * n,
            "values": 2 * n_c,
            "update_critic": 6 * n_c * self.critic_ppo_epochs,
            "update_actor": 6 * n * self.ppo_epochs,
        }

    def pass_flops(self, tokens: int, timings: Mapping[str, float]) -> dict[str, float]:
        """FLOPs of each model pass in ``timings``, by its name.

        The loop times a phase only when it runs, so a pass missing from
        ``timings`` did not run and costs nothing: the old-log-prob pass when
        the update's own forward gives the old log-probs, the actor update
        during critic warm-up. Phases that are not model passes (``reward``,
        ``adv``, ``update_weights``, ...) are not counted.
        """
        return {name: flops * tokens for name, flops in self.per_token().items() if name in timings}


class PerfMeter:
    """Turns a step's token count and phase timings into the ``perf/*`` metrics."""

    def __init__(self, world_size: int, peak: float | None, flops: FlopsModel | None):
        self.world_size, self.peak, self.flops = world_size, peak, flops

    @classmethod
    def for_run(cls, config: Config, plan: Plan) -> PerfMeter:
        """Look up (GPU) or measure (CPU) the device's peak, count the models' parameters, and say so."""
        num_params = count_parameters(plan.model_path)
        critic_params = count_parameters(plan.critic_model_path, without_lm_head=True) if plan.use_critic else 0
        flops = None
        # An unknown count (no safetensors) gives no MFU rather than one that leaves passes out.
        if num_params and (critic_params or not plan.use_critic):
            flops = FlopsModel(
                num_params,
                ppo_epochs=config.worker.actor.ppo_epochs,
                critic_params=critic_params,
                critic_ppo_epochs=config.worker.critic.ppo_epochs,
            )
        gpu = accelerator_name()
        if gpu is not None:
            peak, device = peak_flops(gpu), gpu
            source = "from the table" if peak else "not in the table, so no MFU"
        else:
            # One worker's share of the cores, as the worker group gives it (OMP_NUM_THREADS).
            threads = plan.threads_per_worker
            dtype = getattr(torch, plan.actor_dtype)
            peak = measure_cpu_peak_flops(threads, dtype)
            device, source = f"cpu ({threads} threads)", f"measured, {dtype}"
        shown = f"{peak / 1e9:.1f} GFLOP/s" if peak else "unknown"
        if flops is None:
            params = "parameters unknown (no safetensors), so no MFU"
        else:
            params = f"{num_params / 1e6:.2f}M parameters"
            if plan.use_critic:
                params += f", critic {critic_params / 1e6:.2f}M"
        print(f"perf: device {device}, peak {shown} ({source}); model {params}", flush=True)
        return cls(plan.world_size, peak, flops)

    def metrics(self, batch: Batch, timings: Mapping[str, float]) -> dict[str, float]:
        """The step's ``perf/*`` metrics; ``timings`` holds the seconds of each phase that ran, and ``step``."""
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
            passes = self.flops.pass_flops(tokens, timings)
            metrics["perf/mfu"] = sum(passes.values()) / (seconds * capacity)
            for name, key in (("update_actor", "perf/mfu/actor"), ("update_critic", "perf/mfu/critic")):
                if timings.get(name):  # ran, and took measurable time
                    metrics[key] = passes[name] / (timings[name] * capacity)
        return metrics


class ProgressBar:
    """The run's progress over its steps, for the bar (with its ETA) that the driver draws.

    The loop runs in the Runner actor; the bar is drawn by the driver
    (``vlmrl.driver.console``), which gets the progress from the Runner with
    its lines, so no other process writes into the bar. A resumed run's bar
    starts at the step it resumed from, out of the run's total.
    """

    def __init__(self, total_steps: int, start_step: int = 0):
        self.total, self.start = total_steps, start_step
        report_progress(start_step, total_steps, start_step)

    def update(self, step: int) -> None:
        """The run has finished ``step``."""
        report_progress(step, self.total, self.start)

    def close(self) -> None:
        pass
