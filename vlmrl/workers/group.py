"""The driver's handle on the FSDP workers, and the Ray resources they run on.

``ResourcePool`` reserves one placement group per node: ``trainer.n_gpus_per_node``
bundles of one CPU (and one GPU on GPU nodes), packed onto that node. Worker
``rank`` runs in bundle ``rank % per_node`` of node ``rank // per_node``.

``WorkerGroup`` has one generic call (``call``: a method name and each
worker's arguments, ``.remote()`` on each, results in rank order) and one
``scatter`` / ``gather`` pair; each step's call is a few visible lines over
them, with no generated method and no dispatch decorator. Before a batch is
split it is balanced: the samples are dealt to the workers so that each gets
the same number of samples and nearly the same number of tokens
(``global_seqlen/*`` metrics), and the results are put back in the batch's
order. A worker is sent only what it does not hold (``vlmrl.workers.store``).
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import time
from pathlib import Path
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import ray
import torch
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from vlmrl.config import Config
from vlmrl.plan import Plan
from vlmrl.records import Batch, PromptSample, Trajectory
from vlmrl.train.actor import ActorUpdate
from vlmrl.train.partition import balanced_partition, seqlen_balance_metrics
from vlmrl.rollout.engine import Sampling
from vlmrl.workers.hybrid import HybridWorker
from vlmrl.workers.rollout_batch import rollout_batch, with_prompt_media
from vlmrl.workers.store import PassInput

T = TypeVar("T")

if TYPE_CHECKING:
    from vlmrl.workers.rollout_pool import RolloutPool
    from vlmrl.train.actor import UpdateSettings
    from vlmrl.train.critic import CriticSettings


def _node_address() -> tuple[str, int]:
    """This node's IP and a port free on it now (for the process-group store).

    The port is found by binding and closing, so another process may take it before rank 0's TCP store
    binds it (a known race, not closed here): rank 0 then fails at start-up with "address already in use"
    and the run can simply be started again. Ray's own port range (--min-worker-port / --max-worker-port)
    keeps Ray's workers off the ephemeral ports this draws from.
    """
    with socket.socket() as sock:
        sock.bind(("", 0))
        port = sock.getsockname()[1]
    return ray.util.get_node_ip_address(), port


PLACEMENT_TIMEOUT_S = 600.0
"""How long to wait for the cluster to place the workers' placement groups."""


def _cluster_summary() -> str:
    """Each alive node's CPUs and GPUs, total and free, as Ray sees them."""
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    free = ray.available_resources()
    parts = [
        f"{n.get('NodeManagerAddress')}: {n['Resources'].get('CPU', 0):g} CPU, {n['Resources'].get('GPU', 0):g} GPU"
        for n in nodes
    ]
    return f"{len(nodes)} node(s) ({'; '.join(parts)}), free now {free.get('CPU', 0):g} CPU, {free.get('GPU', 0):g} GPU"


class PlacementTimeout(RuntimeError):
    """The cluster did not place the workers' placement groups in time."""


class WorkerTimeout(RuntimeError):
    """A worker call ran past trainer.step_timeout_s."""


class ResourcePool:
    """One placement group per node, each of ``per_node`` bundles (1 CPU, plus 1 GPU on GPU nodes)."""

    def __init__(
        self, nnodes: int, per_node: int, device: str, run_name: str = "run", timeout_s: float | None = None
    ):
        """``timeout_s``: how long to wait for the placement (None: ``PLACEMENT_TIMEOUT_S``)."""
        timeout_s = PLACEMENT_TIMEOUT_S if timeout_s is None else timeout_s
        bundle = {"CPU": 1, "GPU": 1} if device == "cuda" else {"CPU": 1}
        self.per_node = per_node
        self.run_name = run_name
        self.scratch: Path | None = None
        """The file rendezvous' directory (one machine), removed by ``release``."""
        # STRICT_PACK keeps a node's bundles on one node, so its workers share that node's GPUs and loopback.
        self.groups: list[PlacementGroup] = [
            placement_group([dict(bundle)] * per_node, strategy="STRICT_PACK") for _ in range(nnodes)
        ]
        try:
            ray.get([g.ready() for g in self.groups], timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            for g in self.groups:  # a pending group would hold its resources' claim after the run has failed
                remove_placement_group(g)
            raise PlacementTimeout(
                f"the cluster cannot place the workers: asked for {nnodes} node(s) with {per_node} x {bundle} each "
                f"(trainer.nnodes x trainer.n_gpus_per_node, one worker per bundle, a node's bundles on one node), "
                f"waited {timeout_s:.0f} s; the cluster has {_cluster_summary()}. Lower trainer.nnodes or "
                "trainer.n_gpus_per_node, or add nodes (ray status shows what each has)"
            ) from None

    def strategy(self, rank: int) -> PlacementGroupSchedulingStrategy:
        return PlacementGroupSchedulingStrategy(self.groups[rank // self.per_node], rank % self.per_node)

    def rendezvous(self) -> tuple[str, dict[str, str]]:
        """How the workers find each other, and the env that keeps them on loopback where they share a machine.

        All on one machine: a file rendezvous (no listening socket) over the
        loopback interface. Across machines: a TCP store on rank 0's node,
        listening on that node's address alone (``tcp_rendezvous``, in the
        trainer worker), and the network interfaces gloo/NCCL pick themselves (set
        GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME in the cluster's env to choose).
        """
        # The file store lives on this process's disk: only for workers on this process's own node (one
        # node's worth of workers on a larger cluster may land on another node).
        if len(self.groups) == 1 and self.nodes()[0] == ray.get_runtime_context().get_node_id():
            # A directory of this run's own (its experiment name in it), removed when the run ends.
            self.scratch = Path(tempfile.mkdtemp(prefix=f"vlmrl-rendezvous-{self.run_name}-"))
            return f"file://{self.scratch / 'store'}", {"GLOO_SOCKET_IFNAME": "lo"}
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
        self.remove_scratch()

    def remove_scratch(self) -> None:
        """Remove the file rendezvous' directory (the workers' process groups no longer need it)."""
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)
            self.scratch = None


def per_tensor_parallel_group(items: list, world: int, tp: int) -> list[list]:
    """Each rank's share of ``items`` for a rollout: one even share per tensor-parallel group of ``tp``
    consecutive ranks, handed to every rank of the group (the ranks of an engine serve the same requests)."""
    shares = _chunks(items, world // tp)
    return [shares[rank // tp] for rank in range(world)]


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
    # A key only some workers report (rank 0's push to the rollout servers) joins over those that do.
    keys = dict.fromkeys(key for r in results for key in r)
    return {
        key: (max if key in _PEAK_METRICS else lambda v: sum(v) / len(v))([r[key] for r in results if key in r])
        for key in keys
    }


@dataclass(frozen=True)
class StartedWorkers:
    """The run's worker actors (and, disaggregated, its rollout servers): created, perhaps still loading."""

    pool: ResourcePool
    workers: list
    servers: list

    def stop(self) -> None:
        """Kill them and free their placement groups (what a finished or failed run leaves)."""
        for actor in self.workers + self.servers:
            ray.kill(actor)
        self.pool.release()


def start_workers(config: Config, plan: Plan, placement_timeout_s: float | None = None) -> StartedWorkers:
    """Place and create the workers (and rollout servers) without waiting for them to load.

    Their start-up (imports, the models, the engine) is most of a short run's, so the driver calls this as soon
    as it has joined Ray, and the Runner's own start runs beside it; ``WorkerGroup`` waits for them.
    """
    pool = ResourcePool(
        plan.nnodes, plan.workers_per_node, plan.device, config.trainer.experiment_name, placement_timeout_s
    )
    init_method, rendezvous_env = pool.rendezvous()
    env = {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        # Ray sets OMP_NUM_THREADS to the actor's CPU count; the worker runs the
        # heavy passes while the other actors wait, so it gets its share of the node's cores.
        "OMP_NUM_THREADS": str(plan.threads_per_worker),
        "TOKENIZERS_PARALLELISM": "false",
        **rendezvous_env,
    }
    # Disaggregated: the rollout servers start first, beside the workers, which build no engine and push
    # their weights to these handles.
    servers = []
    if plan.rollout_servers:
        from vlmrl.workers.rollout_pool import start_servers

        servers = start_servers(config, plan)
    remote_cls = ray.remote(HybridWorker)
    workers = [
        remote_cls.options(
            num_cpus=1,
            num_gpus=1 if plan.device == "cuda" else 0,
            scheduling_strategy=pool.strategy(rank),
            runtime_env={"env_vars": env},
            name=f"hybrid_worker_{rank}_{os.getpid()}_{id(pool)}",
        ).remote(config, plan, rank, init_method, servers or None)
        for rank in pool.ranks()
    ]
    return StartedWorkers(pool, workers, servers)


class WorkerGroup:
    """The driver's handle on the hybrid workers: one generic scatter / call / gather, and the step's calls on it."""

    def __init__(self, config: Config, plan: Plan, started: StartedWorkers | None = None):
        """``started``: the workers ``start_workers`` already created (the driver does, as soon as it joins Ray);
        without it they are created here."""
        # Light on purpose: the workers' class imports what its roles need in the worker processes, so the
        # driver starts them without first importing transformers, torchvision and SciPy itself (the Runner
        # imports those while the workers start; vlmrl.driver.runner).

        self.config = config
        self.world_size = plan.world_size
        self.call_timeout: float | None = config.trainer.step_timeout_s
        self.tensor_parallel_size = plan.tensor_parallel_size
        started = started or start_workers(config, plan)
        self.pool, self.workers, servers = started.pool, started.workers, started.servers
        self._wait_started(config, servers)
        if servers:  # the collective weight transfer's group of rank 0 and the servers (the object store needs none)
            ray.get(self.workers[0].open_weight_group.remote(), timeout=config.trainer.start_timeout_s)
        self.pad_token_id = ray.get(self.workers[0].pad_token_id.remote())
        self.rollout_pool: RolloutPool | None = None
        """Disaggregated: the rollout servers, which generate every rollout; None: the workers' own engines."""
        if servers:
            from vlmrl.workers.rollout_pool import RolloutPool

            self.rollout_pool = RolloutPool(servers, config, self.pad_token_id)
        self.holders: dict[str, tuple[Trajectory, set[int]]] = {}
        """Each row a worker holds this step: sample id -> (the trajectory the workers hold, their ranks).
        A batch that brings another trajectory under a held id sends it again, so no worker scores a stale row."""
        self.rollout_timings: dict[str, float] = {}
        """Seconds of the rollout calls' pieces since the last ``take_rollout_timings``."""
        self.rollout_counts: dict[str, float] = {}
        """The rollout kinds' counts (``RolloutStats.counts``) since the last ``take_rollout_counts``."""

    def _wait_started(self, config: Config, servers: list | None = None) -> None:
        """Wait for every worker's constructor (models loaded, engine started) and every rollout server's engine,
        at most trainer.start_timeout_s."""
        servers = list(servers or [])
        timeout = config.trainer.start_timeout_s
        try:
            started = [w.pad_token_id.remote() for w in self.workers] + [s.version.remote() for s in servers]
            ray.get(started, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            for worker in self.workers + servers:  # one still loading would hold its resources after the run failed
                ray.kill(worker)
            self.pool.release()
            raise RuntimeError(
                f"the {len(self.workers)} worker(s) did not finish starting (loading "
                f"{config.worker.actor.model.model_path} and starting vLLM) within trainer.start_timeout_s="
                f"{timeout:g} s; the cluster has {_cluster_summary()}. See the run's run.log for where they are; "
                "raise trainer.start_timeout_s for a model that loads slowly"
            ) from None

    def shutdown(self) -> None:
        """Stop the workers and free their placement groups (tests that build several groups call this)."""
        for w in self.workers:
            ray.kill(w)
        if self.rollout_pool is not None:
            self.rollout_pool.shutdown()
        self.pool.release()

    # ----------------------------------------------------------------- the generic call

    def call(self, method: Callable[..., T], per_worker: list[tuple]) -> list[T]:
        """``method(*per_worker[rank])`` on every worker at once; their results in rank order.

        ``method`` is the worker class's own function (``HybridWorker.update_actor``), not its name: a reader
        and a type checker follow it to the code that runs.

        With ``trainer.step_timeout_s`` a call that runs past it fails the run, naming the call, instead
        of waiting forever on a hung collective or a wedged engine.
        """
        name = method.__name__
        refs = [getattr(w, name).remote(*args) for w, args in zip(self.workers, per_worker, strict=True)]
        timeout = getattr(self, "call_timeout", None)
        try:
            return ray.get(refs, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
            late = [rank for rank, ref in enumerate(refs) if ref not in done]
            raise WorkerTimeout(
                f"the workers' {name} call ran past trainer.step_timeout_s={timeout:g} s (ranks still running: "
                f"{late}); a hung collective or engine looks like this. Raise trainer.step_timeout_s if steps are "
                "really this long"
            ) from None

    def call_all(self, method: Callable[..., T], *args) -> list[T]:
        """The same call on every worker (a collective when the method is one)."""
        return self.call(method, [args] * self.world_size)

    def _parts(self, batch: Batch) -> list[list[int]]:
        """Each worker's sample indices: equal counts, token sums balanced (one shard: all, in order).

        The workers of a Ulysses group (``worker.actor.ulysses_size`` consecutive ranks, ``vlmrl.train.ulysses``)
        get the same shard: they run its sequences together.
        """
        sp = self.config.worker.actor.ulysses_size
        shards = self.world_size // sp
        if shards == 1:
            parts = [list(range(len(batch)))]
        else:
            lengths = batch.attention_mask.sum(dim=1).tolist()
            parts = balanced_partition(lengths, shards, equal_size=True)
        return [part for part in parts for _ in range(sp)]

    def balance_metrics(self, batch: Batch) -> dict[str, float]:
        """``global_seqlen/*``: tokens per data shard with contiguous shares (before) and balanced shares."""
        lengths = batch.attention_mask.sum(dim=1).tolist()
        sp = self.config.worker.actor.ulysses_size
        shards = self.world_size // sp
        return seqlen_balance_metrics(lengths, _chunks(list(range(len(batch))), shards), self._parts(batch)[::sp])

    def scatter(self, batch: Batch, *fields: str) -> tuple[list[PassInput], list[list[int]]]:
        """Each worker's ``PassInput`` for ``batch``: its rows by id, the ones it does not hold in full, and the
        per-token ``fields``; and each worker's row indices, for ``gather``."""
        batch.require(*fields)
        parts = self._parts(batch)
        inputs = []
        for rank, rows in enumerate(parts):
            ids, new_rows = [], []
            for i in rows:
                t = batch.trajectories[i]
                ids.append(t.sample_id)
                held = self._held_by(t)
                if rank not in held:
                    new_rows.append(t)
                    held.add(rank)
            values = {name: getattr(batch, name) for name in fields}
            index = torch.tensor(rows, dtype=torch.long)
            inputs.append(PassInput(ids, new_rows, {k: v.index_select(0, index) for k, v in values.items()}))
        return inputs, parts

    def _held_by(self, trajectory: Trajectory) -> set[int]:
        """The ranks holding exactly this trajectory (none when its id is held for another one)."""
        held = self.holders.get(trajectory.sample_id)
        if held is None or held[0] is not trajectory:
            held = self.holders[trajectory.sample_id] = (trajectory, set())
        return held[1]

    @staticmethod
    def gather(results: list[torch.Tensor], parts: list[list[int]]) -> torch.Tensor:
        """Per-worker results back into the batch's row order (a row held by a Ulysses group: its workers' equal
        results, any one of them)."""
        order = torch.tensor([i for part in parts for i in part])
        values = torch.cat(results)
        out = values.new_empty((int(order.max()) + 1, *values.shape[1:]))
        out[order] = values
        return out

    # ----------------------------------------------------------------- rollout

    def generate(
        self, prompts: list[PromptSample], group_ids: list[int], sampling: Sampling, keep: bool = False
    ) -> Batch:
        """n samples per prompt; with ``keep`` (training) each worker keeps its rows for the step's passes.

        The workers return trajectories without pixels or media; the prompts' are put back here, so the
        driver's batch is complete without sending them twice. Disaggregated, the rollout servers generate
        (``keep`` is then refused: the trainers hold no rows until the passes send them).
        """
        if self.rollout_pool is not None:
            if keep:
                raise ValueError("generate(keep=True): the rollout servers' rows are not held by the trainer workers")
            return self.rollout_pool.generate(prompts, group_ids, sampling)
        tp = self.tensor_parallel_size
        prompt_parts = per_tensor_parallel_group(prompts, self.world_size, tp)
        id_parts = per_tensor_parallel_group(group_ids, self.world_size, tp)
        start = time.perf_counter()
        results = self.call(HybridWorker.generate, [(p, g, sampling, keep) for p, g in zip(prompt_parts, id_parts)])
        call_seconds = time.perf_counter() - start
        prompt_of = dict(zip(group_ids, prompts))
        trajectories = []
        # A tensor-parallel group's workers sampled the same trajectories as one engine: the first rank's
        # copy goes into the batch, and every rank of the group holds it (each kept its own, equal, copy).
        for leader in range(0, self.world_size, tp):
            part, _ = results[leader]
            for t in part:
                full = with_prompt_media(t, prompt_of[t.group_id])  # sent slim: the prompt's media go back on
                trajectories.append(full)
                if keep:
                    self._held_by(full).update(range(leader, leader + tp))
        # The kinds' counts (agent rollouts by status, calls, rows; workflow samples dropped) add up over workers.
        for _, stats in results:
            for key, value in stats.counts.items():
                self.rollout_counts[key] = self.rollout_counts.get(key, 0.0) + value
        if not trajectories:
            raise RuntimeError(
                f"the rollouts of {len(prompts)} prompt(s) made no row to train on; their counts: "
                f"{ {k: int(v) for k, v in self.rollout_counts.items()} } (see "
                "run.log for why each failed)"
            )
        batch = rollout_batch(trajectories, self.config, self.pad_token_id)
        # The slowest worker's pieces (the call waits for it), and the whole call as the driver saw it.
        for key in results[0][1].seconds:
            slowest = max(stats.seconds[key] for _, stats in results)
            self.rollout_timings[key] = self.rollout_timings.get(key, 0.0) + slowest
        self.rollout_timings["driver_call"] = self.rollout_timings.get("driver_call", 0.0) + call_seconds
        return batch

    def take_rollout_timings(self) -> dict[str, float]:
        """The rollout pieces' seconds since the last call (``requests``, ``engine``, ``outputs``, ...)."""
        timings, self.rollout_timings = self.rollout_timings, {}
        if self.rollout_pool is not None:
            timings.update(self.rollout_pool.take_timings())
        return timings

    def take_rollout_counts(self) -> dict[str, float]:
        """The rollout kinds' counts since the last call, summed over the workers (``agent/*``, ``trace/*``,
        ``workflow/*``)."""
        counts, self.rollout_counts = self.rollout_counts, {}
        if self.rollout_pool is not None:
            counts.update(self.rollout_pool.take_counts())
        return counts

    def release(self) -> None:
        """End of step: the workers drop the step's trajectories."""
        self.call_all(HybridWorker.release)
        self.holders.clear()

    # ----------------------------------------------------------------- trainer passes

    def compute_old_log_probs(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, parts = self.scatter(batch)
        results = self.call(HybridWorker.compute_old_log_probs, [(x,) for x in inputs])
        return self.gather([r[0] for r in results], parts), self.gather([r[1] for r in results], parts)

    def compute_ref_log_probs(self, batch: Batch) -> torch.Tensor:
        inputs, parts = self.scatter(batch)
        return self.gather(self.call(HybridWorker.compute_ref_log_probs, [(x,) for x in inputs]), parts)

    def compute_teacher_log_probs(self, batch: Batch) -> torch.Tensor:
        """The distillation teacher's log-probs of the sampled tokens, ``(B, R)`` in the batch's row order."""
        inputs, parts = self.scatter(batch)
        return self.gather(self.call(HybridWorker.compute_teacher_log_probs, [(x,) for x in inputs]), parts)

    def compute_values(self, batch: Batch) -> torch.Tensor:
        inputs, parts = self.scatter(batch)
        return self.gather(self.call(HybridWorker.compute_values, [(x,) for x in inputs]), parts)

    def update_actor(self, batch: Batch, settings: UpdateSettings, old_from_forward: bool) -> ActorUpdate:
        """The workers' metrics (means; peaks as the largest worker's), plus the batch's balance over them;
        for an on-policy update, also the log-probs and entropy of its forward, in the batch's row order."""
        fields = ["advantages"]
        if not old_from_forward:
            fields.append("old_log_probs")
        if settings.use_kl_loss:
            fields.append("ref_log_probs")
        inputs, parts = self.scatter(batch, *fields)
        results = self.call(HybridWorker.update_actor, [(x, settings, old_from_forward) for x in inputs])
        metrics = {**_join_metrics([r.metrics for r in results]), **self.balance_metrics(batch)}
        if results[0].log_probs is None:
            return ActorUpdate(metrics)
        log_probs = self.gather([r.log_probs for r in results], parts)
        return ActorUpdate(metrics, log_probs, self.gather([r.entropy for r in results], parts))

    def update_critic(self, batch: Batch, settings: CriticSettings) -> dict[str, float]:
        inputs, _ = self.scatter(batch, "values", "returns")
        return _join_metrics(self.call(HybridWorker.update_critic, [(x, settings) for x in inputs]))

    def full_weights(self) -> dict[str, torch.Tensor]:
        """The actor's full state dict (HF names), gathered from the shards; a collective over the workers."""
        return self.call_all(HybridWorker.full_weights)[0]

    def sync_weights(self) -> dict[str, float]:
        """Collective: every worker streams the actor's weights into its engine (disaggregated: rank 0 pushes them
        to the rollout servers); the slowest resync, largest bucket."""
        return _join_metrics(self.call_all(HybridWorker.sync_weights))

    def save_checkpoint(self, path: str, model_only: bool, hf_weights: bool) -> None:
        self.call_all(HybridWorker.save_checkpoint, path, model_only, hf_weights)

    def load_checkpoint(self, path: str, version: int = 1) -> bool:
        """Collective: every worker restores ``path``; its engine (or the rollout servers) then samples as policy
        ``version``."""
        return all(self.call_all(HybridWorker.load_checkpoint, path, version))
