"""The driver's handle on the FSDP workers.

Each method visibly splits its input over the workers, calls ``.remote()`` on
each one and joins the results; there is no generated method and no dispatch
decorator. Worker ``i`` always gets the ``i``-th contiguous chunk, and results
come back in the same order, so the batch order is preserved.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import ray
import torch

from vlmrl.config import Config
from vlmrl.plan import Plan
from vlmrl.protocol import Batch, PromptSample
from vlmrl.workers.rollout import SamplingOverrides

if TYPE_CHECKING:
    from vlmrl.workers.actor import UpdateSettings
    from vlmrl.workers.critic import CriticSettings


def _rendezvous(nnodes: int) -> tuple[str, dict[str, str]]:
    """How the workers find each other, and the env that keeps them on loopback.

    On one node a file rendezvous needs no listening socket, and gloo is told
    to use the loopback interface.
    """
    # Config validation rejects nnodes > 1 until multi-node rendezvous exists.
    assert nnodes == 1, nnodes
    path = Path(tempfile.mkdtemp(prefix="vlmrl-rendezvous-")) / "store"
    return f"file://{path}", {"GLOO_SOCKET_IFNAME": "lo"}


def _chunks(items: list, parts: int) -> list[list]:
    if len(items) % parts:
        raise ValueError(f"{len(items)} items do not split evenly over {parts} workers")
    size = len(items) // parts
    return [items[i * size : (i + 1) * size] for i in range(parts)]


def _mean_metrics(results: list[dict[str, float]]) -> dict[str, float]:
    return {key: sum(r[key] for r in results) / len(results) for key in results[0]}


class WorkerGroup:
    def __init__(self, config: Config, plan: Plan):
        from vlmrl.workers.fsdp_worker import FSDPWorker

        self.world_size = plan.world_size
        init_method, rendezvous_env = _rendezvous(config.trainer.nnodes)
        # Ray sets OMP_NUM_THREADS to the actor's CPU count; the worker runs the
        # heavy passes while the other actors wait, so it gets its share of cores.
        threads = str(max(1, (os.cpu_count() or 1) // plan.world_size))
        env = {
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "OMP_NUM_THREADS": threads,
            "TOKENIZERS_PARALLELISM": "false",
            **rendezvous_env,
        }
        remote_cls = ray.remote(FSDPWorker)
        self.workers = [
            remote_cls.options(num_cpus=1, runtime_env={"env_vars": env}, name=f"fsdp_worker_{rank}").remote(
                config, plan, rank, init_method
            )
            for rank in range(plan.world_size)
        ]
        ray.get([w.__ray_ready__.remote() for w in self.workers])

    def _scatter(self, batch: Batch) -> list[Batch]:
        # The workers already hold the pixels (mm_inputs); the PIL images are only for logging.
        slim = dataclasses.replace(batch, images=[])
        return [slim.select(idx) for idx in _chunks(list(range(len(batch))), self.world_size)]

    def generate(self, prompts: list[PromptSample], group_ids: list[int], sampling: SamplingOverrides) -> Batch:
        prompt_parts, id_parts = _chunks(prompts, self.world_size), _chunks(group_ids, self.world_size)
        refs = [w.generate.remote(p, g, sampling) for w, p, g in zip(self.workers, prompt_parts, id_parts)]
        return Batch.concat(ray.get(refs))

    def compute_old_log_probs(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        refs = [w.compute_old_log_probs.remote(b) for w, b in zip(self.workers, self._scatter(batch))]
        results = ray.get(refs)
        return torch.cat([r[0] for r in results]), torch.cat([r[1] for r in results])

    def compute_ref_log_probs(self, batch: Batch) -> torch.Tensor:
        refs = [w.compute_ref_log_probs.remote(b) for w, b in zip(self.workers, self._scatter(batch))]
        return torch.cat(ray.get(refs))

    def compute_values(self, batch: Batch) -> torch.Tensor:
        refs = [w.compute_values.remote(b) for w, b in zip(self.workers, self._scatter(batch))]
        return torch.cat(ray.get(refs))

    def update_actor(self, batch: Batch, settings: UpdateSettings) -> dict[str, float]:
        refs = [w.update_actor.remote(b, settings) for w, b in zip(self.workers, self._scatter(batch))]
        return _mean_metrics(ray.get(refs))

    def update_critic(self, batch: Batch, settings: CriticSettings) -> dict[str, float]:
        refs = [w.update_critic.remote(b, settings) for w, b in zip(self.workers, self._scatter(batch))]
        return _mean_metrics(ray.get(refs))

    def sync_weights(self) -> float:
        return max(ray.get([w.sync_weights.remote() for w in self.workers]))

    def save_checkpoint(self, path: str, model_only: bool, hf_weights: bool) -> None:
        ray.get([w.save_checkpoint.remote(path, model_only, hf_weights) for w in self.workers])

    def load_checkpoint(self, path: str) -> bool:
        return all(ray.get([w.load_checkpoint.remote(path) for w in self.workers]))
