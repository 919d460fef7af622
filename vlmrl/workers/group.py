"""The driver's handle on the FSDP workers, and the Ray resources they run on.

``ResourcePool`` reserves one placement group per node: ``trainer.n_gpus_per_node``
bundles of one CPU (and one GPU on GPU nodes), packed onto that node. Worker
``rank`` runs in bundle ``rank % per_node`` of node ``rank // per_node``.

Each ``WorkerGroup`` method visibly splits its input over the workers, calls
``.remote()`` on each one and joins the results; there is no generated method
and no dispatch decorator. Before a batch is split it is balanced: the samples
are dealt to the workers so that each gets the same number of samples and
nearly the same number of tokens (``global_seqlen/*`` metrics), and the results
are put back in the batch's order.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import ray
import torch
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from vlmrl.config import Config
from vlmrl.plan import Plan
from vlmrl.records import Batch, PromptSample
from vlmrl.train.actor import ActorUpdate
from vlmrl.train.partition import balanced_partition, seqlen_balance_metrics
from vlmrl.rollout.engine import Sampling

if TYPE_CHECKING:
    from vlmrl.train.actor import UpdateSettings
    from vlmrl.train.critic import CriticSettings


def _node_address() -> tuple[str, int]:
    """This node's IP and a port free on it now (for the process-group store)."""
    with socket.socket() as sock:
        sock.bind(("", 0))
        port = sock.getsockname()[1]
    return ray.util.get_node_ip_address(), port


class ResourcePool:
    """One placement group per node, each of ``per_node`` bundles (1 CPU, plus 1 GPU on GPU nodes)."""

    def __init__(self, nnodes: int, per_node: int, device: str):
        bundle = {"CPU": 1, "GPU": 1} if device == "cuda" else {"CPU": 1}
        self.per_node = per_node
        # STRICT_PACK keeps a node's bundles on one node, so its workers share that node's GPUs and loopback.
        self.groups: list[PlacementGroup] = [
            placement_group([dict(bundle)] * per_node, strategy="STRICT_PACK") for _ in range(nnodes)
        ]
        ray.get([g.ready() for g in self.groups], timeout=600)

    def strategy(self, rank: int) -> PlacementGroupSchedulingStrategy:
        return PlacementGroupSchedulingStrategy(self.groups[rank // self.per_node], rank % self.per_node)

    def rendezvous(self) -> tuple[str, dict[str, str]]:
        """How the workers find each other, and the env that keeps them on loopback where they share a machine.

        All on one machine: a file rendezvous (no listening socket) over the
        loopback interface. Across machines: a TCP store on rank 0's node,
        and the network interfaces gloo/NCCL pick themselves (set
        GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME in the cluster's env to choose).
        """
        if len(self.groups) == 1:
            path = Path(tempfile.mkdtemp(prefix="vlmrl-rendezvous-")) / "store"
            return f"file://{path}", {"GLOO_SOCKET_IFNAME": "lo"}
        probe = ray.remote(num_cpus=0)(_node_address)
        addresses = ray.get([probe.options(scheduling_strategy=self.strategy(r)).remote() for r in self.ranks()])
        ip, port = addresses[0]
        one_machine = len({a[0] for a in addresses}) == 1  # e.g. a simulated multi-node cluster
        return f"tcp://{ip}:{port}", {"GLOO_SOCKET_IFNAME": "lo"} if one_machine else {}

    def nodes(self) -> list[str]:
        """The Ray node id each placement group landed on."""
        return [ray.util.placement_group_table(g)["bundles_to_node_id"][0] for g in self.groups]

    def ranks(self) -> range:
        return range(len(self.groups) * self.per_node)

    def release(self) -> None:
        for g in self.groups:
            remove_placement_group(g)


def _chunks(items: list, parts: int) -> list[list]:
    if len(items) % parts:
        raise ValueError(f"{len(items)} items do not split evenly over {parts} workers")
    size = len(items) // parts
    return [items[i * size : (i + 1) * size] for i in range(parts)]


# Per-worker metrics where the largest worker matters, not the mean: peaks, and the slowest worker's resync.
_PEAK_METRICS = (
    "perf/max_memory_allocated_gb",
    "perf/cpu_memory_peak_gb",
    "perf/rollout/max_memory_allocated_gb",
    "perf/resync_bucket_peak_mb",
    "timing_s/resync_worker",
)


def _join_metrics(results: list[dict[str, float]]) -> dict[str, float]:
    return {
        key: (max if key in _PEAK_METRICS else lambda v: sum(v) / len(v))([r[key] for r in results])
        for key in results[0]
    }


class WorkerGroup:
    def __init__(self, config: Config, plan: Plan):
        from vlmrl.workers.hybrid import FSDPWorker

        self.world_size = plan.world_size
        self.pool = ResourcePool(plan.nnodes, plan.workers_per_node, plan.device)
        init_method, rendezvous_env = self.pool.rendezvous()
        # Ray sets OMP_NUM_THREADS to the actor's CPU count; the worker runs the
        # heavy passes while the other actors wait, so it gets its share of the node's cores.
        threads = str(max(1, (os.cpu_count() or 1) // plan.workers_per_node))
        env = {
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "OMP_NUM_THREADS": threads,
            "TOKENIZERS_PARALLELISM": "false",
            **rendezvous_env,
        }
        remote_cls = ray.remote(FSDPWorker)
        self.workers = [
            remote_cls.options(
                num_cpus=1,
                num_gpus=1 if plan.device == "cuda" else 0,
                scheduling_strategy=self.pool.strategy(rank),
                runtime_env={"env_vars": env},
                name=f"fsdp_worker_{rank}_{os.getpid()}_{id(self)}",
            ).remote(config, plan, rank, init_method)
            for rank in self.pool.ranks()
        ]
        ray.get([w.__ray_ready__.remote() for w in self.workers])

    def shutdown(self) -> None:
        """Stop the workers and free their placement groups (tests that build several groups call this)."""
        for w in self.workers:
            ray.kill(w)
        self.pool.release()

    def _parts(self, batch: Batch) -> list[list[int]]:
        """Each worker's sample indices: equal counts, token sums balanced (one worker: all, in order)."""
        if self.world_size == 1:
            return [list(range(len(batch)))]
        lengths = batch.attention_mask.sum(dim=1).tolist()
        return balanced_partition(lengths, self.world_size, equal_size=True)

    def balance_metrics(self, batch: Batch) -> dict[str, float]:
        """``global_seqlen/*``: tokens per worker with contiguous shares (before) and balanced shares."""
        lengths = batch.attention_mask.sum(dim=1).tolist()
        return seqlen_balance_metrics(lengths, _chunks(list(range(len(batch))), self.world_size), self._parts(batch))

    def _scatter_parts(self, batch: Batch) -> tuple[list[Batch], list[list[int]]]:
        parts = self._parts(batch)
        # The workers already hold the pixels (mm_inputs); the PIL images are only for logging.
        slim = dataclasses.replace(batch, images=[])
        return [slim.select(idx) for idx in parts], parts

    @staticmethod
    def _gather(results: list[torch.Tensor], parts: list[list[int]]) -> torch.Tensor:
        """Per-worker results back into the batch's row order."""
        order = torch.tensor([i for part in parts for i in part])
        out = torch.empty_like(torch.cat(results))
        out[order] = torch.cat(results)
        return out

    def generate(self, prompts: list[PromptSample], group_ids: list[int], sampling: Sampling) -> Batch:
        prompt_parts, id_parts = _chunks(prompts, self.world_size), _chunks(group_ids, self.world_size)
        t0 = time.perf_counter()
        refs = [w.generate.remote(p, g, sampling) for w, p, g in zip(self.workers, prompt_parts, id_parts)]
        parts = ray.get(refs)
        t1 = time.perf_counter()
        batch = Batch.concat(parts)
        if os.environ.get("VLMRL_PROFILE_ROLLOUT"):
            timings = {"driver_call": t1 - t0, "driver_concat": time.perf_counter() - t1}
            print(f"VLMRL_PROFILE_DRIVER {json.dumps(timings)}", flush=True)
        return batch

    def compute_old_log_probs(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        shards, parts = self._scatter_parts(batch)
        results = ray.get([w.compute_old_log_probs.remote(b) for w, b in zip(self.workers, shards)])
        return self._gather([r[0] for r in results], parts), self._gather([r[1] for r in results], parts)

    def compute_ref_log_probs(self, batch: Batch) -> torch.Tensor:
        shards, parts = self._scatter_parts(batch)
        return self._gather(ray.get([w.compute_ref_log_probs.remote(b) for w, b in zip(self.workers, shards)]), parts)

    def compute_values(self, batch: Batch) -> torch.Tensor:
        shards, parts = self._scatter_parts(batch)
        return self._gather(ray.get([w.compute_values.remote(b) for w, b in zip(self.workers, shards)]), parts)

    def update_actor(self, batch: Batch, settings: UpdateSettings, old_from_forward: bool) -> ActorUpdate:
        """The workers' metrics (means; peaks as the largest worker's), plus the batch's balance over them;
        for an on-policy update, also the log-probs and entropy of its forward, in the batch's row order."""
        shards, parts = self._scatter_parts(batch)
        results = ray.get([w.update_actor.remote(b, settings, old_from_forward) for w, b in zip(self.workers, shards)])
        metrics = {**_join_metrics([r.metrics for r in results]), **self.balance_metrics(batch)}
        if results[0].log_probs is None:
            return ActorUpdate(metrics)
        log_probs = self._gather([r.log_probs for r in results], parts)
        return ActorUpdate(metrics, log_probs, self._gather([r.entropy for r in results], parts))

    def update_critic(self, batch: Batch, settings: CriticSettings) -> dict[str, float]:
        shards, _ = self._scatter_parts(batch)
        return _join_metrics(ray.get([w.update_critic.remote(b, settings) for w, b in zip(self.workers, shards)]))

    def full_weights(self) -> dict[str, torch.Tensor]:
        """The actor's full state dict (HF names), gathered from the shards; a collective over the workers."""
        return ray.get([w.full_weights.remote() for w in self.workers])[0]

    def sync_weights(self) -> dict[str, float]:
        """Collective: every worker streams the actor's weights into its engine; the slowest resync, largest bucket."""
        return _join_metrics(ray.get([w.sync_weights.remote() for w in self.workers]))

    def save_checkpoint(self, path: str, model_only: bool, hf_weights: bool) -> None:
        ray.get([w.save_checkpoint.remote(path, model_only, hf_weights) for w in self.workers])

    def load_checkpoint(self, path: str) -> bool:
        return all(ray.get([w.load_checkpoint.remote(path) for w in self.workers]))
