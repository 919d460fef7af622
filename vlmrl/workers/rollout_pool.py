"""The driver's handle on the rollout servers (asynchronous training, disaggregated placement).

``start_servers`` launches ``plan.rollout_servers`` ``RolloutServer`` actors (``tensor_parallel_size`` GPUs each,
or 1 CPU on CPU), apart from the trainer workers' placement groups. ``RolloutPool`` submits a generation call without
waiting for it (``submit``: the prompts split evenly over the servers, one Ray call each, returned as
references), tells whether it is in (``done``), and turns a finished call into the ``Batch`` that
``WorkerGroup.generate`` would have built (``collect``), so generation runs while the trainer trains. The
trainers push the weights to the same handles (``HybridWorker.sync_weights``).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import ray

from vlmrl.config import Config
from vlmrl.plan import Plan
from vlmrl.records import Batch, PromptSample
from vlmrl.rollout.engine import Sampling
from vlmrl.workers.rollout_batch import rollout_batch, with_prompt_media
from vlmrl.workers.rollout_server import start_rollout_server


def start_servers(config: Config, plan: Plan) -> list:
    """The rollout servers' actor handles, starting (``RolloutPool.wait_started`` waits for them).

    Each keeps one Ray call thread per generate call in flight: at most one per admitted group, plus a
    validation call and a weight load.
    """
    a = config.worker.rollout.async_rl
    groups = a.max_concurrent_rollouts or (a.max_head_offpolicyness + 1) * config.data.rollout_batch_size
    return [
        start_rollout_server(
            config, plan, rank, max_concurrency=groups + 2, num_cpus=1,
            # A tensor-parallel server's shards are processes vLLM starts in the actor, on the actor's GPUs.
            num_gpus=plan.tensor_parallel_size if plan.device == "cuda" else 0,
        )
        for rank in range(plan.rollout_servers)
    ]


@dataclass
class PendingCall:
    """A generation call submitted to the servers: each server's share of the prompts and its result's reference."""

    prompts: list[PromptSample]
    group_ids: list[int]
    refs: list[ray.ObjectRef]
    submitted: float


class RolloutServerDied(RuntimeError):
    """A rollout server's actor is gone (killed, out of memory, its node lost): the run cannot go on."""


class RolloutPool:
    def __init__(self, servers: list, config: Config, pad_token_id: int):
        self.servers = servers
        self.config = config
        self.pad_token_id = pad_token_id
        self.rollout_timings: dict[str, float] = {}
        """Seconds of the collected calls' pieces (the slowest server's) since ``WorkerGroup.take_rollout_timings``."""
        self.rollout_counts: dict[str, float] = {}
        """The rollout kinds' counts of the collected calls since ``WorkerGroup.take_rollout_counts``."""
        self._next_server = 0
        self._busy_mark: tuple[float, float] | None = None
        """(wall clock, the servers' summed engine seconds) when ``idle_share`` last looked."""

    def wait_started(self, timeout: float | None) -> None:
        """Wait until every server's engine is up (raises Ray's ``GetTimeoutError`` past ``timeout``)."""
        ray.get([s.version.remote() for s in self.servers], timeout=timeout)

    def submit(self, prompts: list[PromptSample], group_ids: list[int], sampling: Sampling) -> PendingCall:
        """Start generating n samples per prompt, the prompts split in contiguous shares over the servers."""
        share = math.ceil(len(prompts) / len(self.servers))
        # Calls smaller than the servers (a group at a time) start at the next server each time, round-robin.
        first, self._next_server = self._next_server, (self._next_server + 1) % len(self.servers)
        servers = self.servers[first:] + self.servers[:first]
        refs = [
            server.generate.remote(prompts[i : i + share], group_ids[i : i + share], sampling)
            for server, i in zip(servers, range(0, len(prompts), share))
        ]
        return PendingCall(prompts, group_ids, refs, time.perf_counter())

    @staticmethod
    def done(call: PendingCall) -> bool:
        """Whether every server has finished its share (without waiting)."""
        ready, _ = ray.wait(call.refs, num_returns=len(call.refs), timeout=0)
        return len(ready) == len(call.refs)

    def collect(self, call: PendingCall) -> Batch:
        """The call's rows in prompt order, with the prompts' media, as one ``Batch`` (waits for the call)."""
        results = self._get(call.refs)
        prompt_of = dict(zip(call.group_ids, call.prompts))
        trajectories = [with_prompt_media(t, prompt_of[t.group_id]) for part, _, _ in results for t in part]
        for _, _, counts in results:  # the kinds' counts (agent/*, trace/*, workflow/*), summed over the servers
            for key, value in counts.items():
                self.rollout_counts[key] = self.rollout_counts.get(key, 0.0) + value
        if not trajectories:
            raise RuntimeError(f"the rollout servers returned no rows for {len(call.prompts)} prompt(s)")
        for key in results[0][1]:
            slowest = max(timings[key] for _, timings, _ in results)
            self.rollout_timings[key] = self.rollout_timings.get(key, 0.0) + slowest
        # From submission to collection: overlaps training, so this is latency, not the driver's time.
        latency = time.perf_counter() - call.submitted
        self.rollout_timings["server_call"] = self.rollout_timings.get("server_call", 0.0) + latency
        return rollout_batch(trajectories, self.config, self.pad_token_id)

    def _get(self, refs: list[ray.ObjectRef], timeout: float | None = None) -> list:
        """``ray.get``, with a server that died named, rather than Ray's actor error."""
        try:
            return ray.get(refs, timeout=timeout)
        except ray.exceptions.RayActorError as e:
            dead = [i for i, s in enumerate(self.servers) if not _alive(s)]
            raise RolloutServerDied(
                f"rollout server(s) {dead or '?'} of {len(self.servers)} died (killed, out of memory, or its node "
                "lost); the run stops here. Run the same command again to resume from the last checkpoint. "
                f"Ray says: {str(e).splitlines()[0]}"
            ) from None

    def idle_share(self) -> float:
        """The share of the servers' time since the last look that their engines did not step (0 to 1); NaN at
        the first look."""
        busy = sum(self._get([s.busy_seconds.remote() for s in self.servers], timeout=60))
        now = time.perf_counter()
        mark, self._busy_mark = self._busy_mark, (now, busy)
        if mark is None or now <= mark[0]:
            return float("nan")
        capacity = (now - mark[0]) * len(self.servers)
        return min(1.0, max(0.0, 1.0 - (busy - mark[1]) / capacity))

    def generate(self, prompts: list[PromptSample], group_ids: list[int], sampling: Sampling) -> Batch:
        """Submit and wait (validation)."""
        return self.collect(self.submit(prompts, group_ids, sampling))

    def take_timings(self) -> dict[str, float]:
        timings, self.rollout_timings = self.rollout_timings, {}
        return timings

    def take_counts(self) -> dict[str, float]:
        counts, self.rollout_counts = self.rollout_counts, {}
        return counts

    def shutdown(self) -> None:
        for server in self.servers:
            ray.kill(server)


def _alive(server) -> bool:
    try:
        ray.get(server.version.remote(), timeout=10)
        return True
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        return False
