"""The rollout role on its own: an engine that keeps generating while new weights arrive (disaggregated placement).

``RolloutServer`` runs as a threaded Ray actor, apart from the trainer workers
(``start_rollout_server``). Its engine is built as ``RolloutWorker`` builds it
and is owned by one ``EngineLoop`` thread; every other method runs on one of
Ray's call threads and talks to the engine only through the loop, so:

- several ``generate`` calls may be in flight at once; each submits its seeded
  requests and waits for their futures, and their requests share engine steps;
- ``load_weights`` fetches the weights on its call thread while the engine
  keeps stepping, then loads them on the loop's thread between two steps.
  ``continue`` and ``reprefill`` interrupt the requests in flight
  (``InterruptMode``); ``refuse`` holds new requests, waits until those in
  flight have finished, loads, and lets the held ones in, so that no output
  straddles two versions.

Every trajectory carries, per response token, the version of the weights that
sampled it (``SampleOutput.versions``), so a response that straddled a load has
tokens of two versions. Single-turn calls submit their requests to the loop
directly; multi-turn calls run the turn loop in the call's thread, each turn's
requests going through the loop (``LoopedEngine``), with the tools or the
environment in this actor. Under ``refuse`` a load waits for the turns in
flight, so it lands at turn boundaries; under ``continue`` a turn it interrupts
has tokens of both versions. A workflow class awaits its generations through
the loop too (``LoopedEngine.asynchronous``). An external agent's endpoint
serves its calls through the same loop; as an agent's call records one version,
a load then always waits for the calls in flight (``refuse``).

The server returns trajectories without pixels (``Trajectory.slim``), as the
colocated worker does: the driver holds the prompts' media.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from typing import Any

import ray
from transformers import AutoConfig

from vlmrl.config import Config
from vlmrl.heap import started
from vlmrl.models import family_of
from vlmrl.plan import Plan
from vlmrl.records import PromptSample, Trajectory
from vlmrl.rollout.endpoint.loop import EngineLoop, LoopedEngine
from vlmrl.rollout.engine import EngineOutput, InterruptMode, NamedTensors, Sampling
from vlmrl.rollout.engine.sampling import media_offsets, sampling_mask, seeded_requests
from vlmrl.train.models import apply_overrides, load_processor, tokenizer_of
from vlmrl.weight_sync.collective import Broadcast, GroupAddress, WeightGroup
from vlmrl.weight_sync.object_store import WeightBuckets
from vlmrl.workers.rollout import RolloutWorker
from vlmrl import workflows

ENV_VARS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TOKENIZERS_PARALLELISM": "false"}
"""The server's process environment: vLLM's engine core in the actor's own process (so ``load_weights`` hands
it the tensors directly), and no tokenizer threads fighting the engine for the cores."""


class RolloutServer:
    """An engine behind a loop thread; meant for ``ray.remote(RolloutServer).options(max_concurrency=...)``."""

    def __init__(self, config: Config, plan: Plan, rank: int = 0):
        kind = workflows.workflow_name(config.worker.rollout)
        model = config.worker.actor.model
        processor = load_processor(model.model_path, model.tokenizer_path, model.trust_remote_code)
        tokenizer = tokenizer_of(processor)
        # The trainer bans the same tokens from the actor's vocabulary (``TrainerWorker.allowed_tokens``).
        hf_config = AutoConfig.from_pretrained(model.model_path, trust_remote_code=model.trust_remote_code)
        apply_overrides(hf_config, dict(model.override_config))
        allowed = sampling_mask(tokenizer, hf_config.get_text_config().vocab_size, family_of(hf_config).banned_tokens)
        # RolloutWorker's construction; the rollout kind plays its turns through the loop (LoopedEngine), the
        # one thread that steps the engine, so they share steps with the other calls in flight.
        loops: list[EngineLoop] = []

        def looped(engine):
            loops.append(EngineLoop(engine))
            return LoopedEngine(loops[0])

        worker = RolloutWorker(
            config, plan, rank, tokenizer, allowed, processor, engine_for_kind=looped, server=True
        )
        self.engine, self.pad_ids, self.kind, self.loop = worker.engine, worker.pad_ids, worker.kind, loops[0]
        self.single_turn = kind == "single_turn"
        """Single-turn calls submit their seeded requests here directly; the other kinds' go to the kind."""
        self.whole_calls = kind == "openai_agent"
        """An agent's call records one version (``Call.version``): a weight load waits for the calls in flight."""
        self._calls = itertools.count()
        """Numbers each generate call; its request ids start with it, unique among the calls in flight."""
        self._load_lock = threading.Lock()
        """One weight load at a time: a refuse-mode load pauses the loop, which another load must not undo."""
        started()  # the engine and the libraries live as long as this process (vlmrl.heap)

    # ---------------------------------------------------------------- rollout

    def generate(
        self, prompts: list[PromptSample], group_ids: list[int], sampling: Sampling
    ) -> tuple[list[Trajectory], dict[str, float], dict[str, float]]:
        """n trajectories per prompt, in prompt order, without pixels (fewer or more where the kind's rows vary);
        the seconds of the call's pieces; the kind's counts (``RolloutStats.counts``).

        Thread-safe. The requests are seeded by group id (``seeded_requests``),
        so a group samples the same tokens whichever other calls share the engine.
        """
        if not self.single_turn:
            # The turn loop runs here, beside the engine: each turn is a request through the loop, so a weight
            # load lands between engine steps and the tokens of a turn it interrupted carry both versions.
            trajectories, stats = self.kind.rollout(prompts, group_ids, sampling)
            return [t.slim() for t in trajectories], dict(stats.seconds), dict(stats.counts)
        t0 = time.perf_counter()
        call = next(self._calls)  # itertools.count's next is atomic under the GIL
        requests = [
            dataclasses.replace(r, request_id=f"{call}/{r.request_id}")
            for r in seeded_requests(prompts, group_ids, sampling, self.engine.seed)
        ]
        futures = []
        try:
            for request in requests:
                futures.append(self.loop.submit(request))
            t1 = time.perf_counter()
            outputs: list[EngineOutput] = [f.result() for f in futures]
        except BaseException:
            # A failed request or a closing server: the call's other requests must not run on for nobody.
            self.loop.abort([r.request_id for r in requests])
            raise
        t2 = time.perf_counter()
        trajectories = [
            t.slim()
            for prompt, group_id, output in zip(prompts, group_ids, outputs, strict=True)
            for t in self._trajectories(prompt, group_id, output, sampling.temperature)
        ]
        # "engine": waiting for the outputs, which includes sharing steps with other calls and any weight load.
        seconds = {"requests": t1 - t0, "engine": t2 - t1, "trajectories": time.perf_counter() - t2}
        return trajectories, seconds, {}

    def _trajectories(
        self, prompt: PromptSample, group_id: int, output: EngineOutput, temperature: float
    ) -> list[Trajectory]:
        offsets = media_offsets(prompt.input_ids, self.pad_ids)
        trajectories = []
        for i, sample in enumerate(output.samples):
            t = Trajectory.single_turn(
                prompt, group_id, i, sample.token_ids, sample.text, temperature, sample.log_probs,
                output.version, offsets,
            )  # fmt: skip
            if sample.versions:  # per token: a sample that straddled a weight load has tokens of two versions
                t = dataclasses.replace(t, versions=[-1] * t.prompt_length + list(sample.versions))
            trajectories.append(t)
        return trajectories

    # ---------------------------------------------------------------- weights

    weight_group: WeightGroup | None = None
    """This server's member of the trainer's weight-transfer group (``join_weight_group``); None: not joined."""

    def join_weight_group(self, address: GroupAddress, rank: int) -> None:
        """Join the trainer's weight-transfer group as ``rank`` (``vlmrl.weight_sync.collective.open_group``;
        blocks until every member has joined), once; ``load_weights`` then takes its ``Broadcast``."""
        if self.weight_group is not None:
            raise RuntimeError(f"this server is already in a weight-transfer group ({self.weight_group.address})")
        self.weight_group = WeightGroup(address, rank)

    def load_weights(
        self,
        weights: WeightBuckets | Broadcast | NamedTensors,
        version: int,
        interrupt: InterruptMode | str = "continue",
    ) -> dict[str, float]:
        """Replace the engine's weights (HF names, full tensors) and make them policy ``version``.

        ``weights``: the object-store buckets of a sync (``vlmrl.weight_sync.object_store.push_weights``),
        a ``Broadcast`` about to arrive in the weight-transfer group this server joined
        (``vlmrl.weight_sync.collective.broadcast_weights``), or ``(name, tensor)`` pairs. ``interrupt``: an
        ``InterruptMode`` or its value ("continue", "reprefill", "refuse"). Returns the seconds spent
        fetching (or receiving) and loading.
        """
        mode = InterruptMode.refuse if self.whole_calls else InterruptMode(interrupt)
        t0 = time.perf_counter()
        # Fetched (or received) here, on a call thread, so the engine keeps generating while the tensors arrive.
        if isinstance(weights, Broadcast):
            if self.weight_group is None or self.weight_group.address != weights.group:
                raise RuntimeError(f"a broadcast in {weights.group}: a weight-transfer group this server is not in")
            named = self.weight_group.receive()
        else:
            named = weights.fetch() if isinstance(weights, WeightBuckets) else list(weights)
        t1 = time.perf_counter()
        with self._load_lock:
            if mode is InterruptMode.refuse:
                self.loop.pause()
                try:
                    self.loop.drain()
                    waited = time.perf_counter()
                    self.loop.call(lambda engine: engine.load_weights(named, version))
                finally:
                    self.loop.resume()
            else:
                waited = time.perf_counter()
                self.loop.call(lambda engine: engine.load_weights(named, version, mode))
        return {
            "timing_s/resync_fetch": t1 - t0,
            "timing_s/resync_drain": waited - t1,
            "timing_s/resync_engine": time.perf_counter() - waited,
        }

    def version(self) -> int:
        """The policy version of the weights loaded now (0: the ones the engine started on)."""
        return self.engine.version

    def in_flight(self) -> int:
        """Requests added to the engine and not finished (for admission and tests)."""
        return self.loop.in_flight()

    def busy_seconds(self) -> float:
        """Seconds the engine has spent stepping since the server started (the rest of the time it was idle)."""
        return self.loop.busy_s

    def close(self) -> None:
        """Abort everything queued or in flight (their generate calls raise ``Aborted``) and stop the loop."""
        self.loop.close()
        self.kind.close()


def start_rollout_server(
    config: Config, plan: Plan, rank: int = 0, *, max_concurrency: int = 8, num_cpus: float = 1, num_gpus: float = 0,
    **options: Any,
):
    """A ``RolloutServer`` actor (building; call ``version`` to wait for it).

    ``max_concurrency``: Ray call threads. Each generate call in flight holds one
    until its requests finish, and a weight load needs one while they run, so it
    must exceed the generate calls the caller keeps in flight. ``options``: more
    Ray actor options (a scheduling strategy, a name; a ``runtime_env`` of the
    caller's replaces the one with ``ENV_VARS``).
    """
    options.setdefault("runtime_env", {"env_vars": dict(ENV_VARS)})
    return (
        ray.remote(RolloutServer)
        .options(max_concurrency=max_concurrency, num_cpus=num_cpus, num_gpus=num_gpus, **options)
        .remote(config, plan, rank)
    )

