"""The Python rollout interface: a workflow class whose ``run(ctx, row)`` plays one sample of a row.

``worker.rollout.workflow=path/to/file.py:ZoomAndAnswer`` names a class; the
rollout worker makes one instance (with ``worker.rollout.workflow_kwargs``)
and awaits ``run(ctx, row)`` once per sample, n per row, all of a call's
samples at once on one event loop. ``run`` gets:

- ``row``: the dataset row as a ``PromptSample`` (its prompt's tokens in both
  views, images, ground truth, other columns in ``extra``);
- ``ctx`` (``Context``): ``await ctx.generate(episode_or_ids)`` (token-in,
  token-out, with images: the same engine request the built-in rollouts make,
  returning the tokens, the log-probs and the policy version of each token),
  ``ctx.episode()`` (the row's prompt as an ``Episode`` to append turns to),
  ``ctx.add_user(episode, content, images)`` (chat messages with images
  rendered into both token views exactly as the built-in multi-turn loop
  renders tool results), the processor and tokenizer, the sampling settings,
  the sample's seed, the configured tools, and the budget.

It returns an ``Episode`` (or a list: several rows of one rollout, which share
its advantage), or None to drop the sample (counted as ``workflow/dropped``).
An episode's rewards: ``episode.reward`` (then the reward function does not
score it), ``episode.turn_rewards`` per model turn; without ``reward`` the
reward function scores the last model turn.

A workflow that raises, returns something else, or runs past
``worker.rollout.workflow_timeout`` stops the run with an error naming the
workflow and the row, or, with ``data.on_bad_sample=skip``, drops that sample,
counted as ``workflow/errors`` or ``workflow/timeouts``. The timeout cuts a
workflow waiting on the engine or on an ``await``; a workflow that blocks the
event loop (``time.sleep``, a blocking socket) cannot be cut and must run such
calls with ``asyncio.to_thread``.

Seeds: sample i of a row's group starts at the seed the single-turn rollout
gives it (``group_seed`` + i), and the k-th ``generate`` of a sample draws
``turn_seed(seed, k)``, as the multi-turn loop's turns do, so a resumed run
samples what an uninterrupted one does.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import inspect
import logging
import time
import traceback
from dataclasses import dataclass
from typing import Any, ClassVar

from vlmrl.records import PromptSample, Trajectory
from vlmrl.rollout.engine import Engine, EngineOutput, EngineRequest, Sampling, image_content_id
from vlmrl.rollout.engine.sampling import group_seed
from vlmrl.rollout.episode import Episode, Positions
from vlmrl.rollout.kind import Credit, RolloutKind, RolloutStats
from vlmrl.rollout.turns.loop import turn_seed
from vlmrl.rollout.turns.observations import ConversationRenderer, Observation, split_images
from vlmrl.rollout.turns.tools import CallOutcome, ToolContext

log = logging.getLogger(__name__)


class Workflow:
    """Base class of a workflow (optional: any class with ``async def run(self, ctx, row)`` is one)."""

    credit: ClassVar[Credit] = Credit.per_row
    """``per_rollout`` when ``run`` returns several episodes that are one rollout's rows."""

    async def run(self, ctx: Context, row: PromptSample) -> Episode | list[Episode] | None:
        raise NotImplementedError(f"{type(self).__name__} must define async def run(self, ctx, row)")


class WorkflowError(RuntimeError):
    """A workflow raised, returned something it may not, or ran past its timeout."""


class OnError(enum.Enum):
    error = "error"
    skip = "skip"


@dataclass(frozen=True)
class Generation:
    """One sample of ``Context.generate``."""

    token_ids: list[int]
    text: str
    log_probs: list[float] | None
    """The engine's log-prob of each token (None unless ``worker.rollout.calculate_log_probs``)."""
    versions: list[int]
    """The policy version that sampled each token."""
    finish_reason: str | None
    """"stop" (end of turn) or "length" (max_tokens)."""


class AsyncEngine:
    """An ``Engine`` awaited by many coroutines: requests are added as they come and stepped together."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._waiting: dict[str, asyncio.Future] = {}
        self._pump: asyncio.Task | None = None
        self.seconds = 0.0
        """Seconds spent in the engine's steps."""

    async def generate(self, request: EngineRequest) -> EngineOutput:
        future = asyncio.get_running_loop().create_future()
        self._waiting[request.request_id] = future
        self.engine.add(request)
        if self._pump is None or self._pump.done():
            self._pump = asyncio.create_task(self._step_while_waiting())
        try:
            return await future
        except asyncio.CancelledError:  # a timed-out workflow: its request must not run on unread
            if self._waiting.pop(request.request_id, None) is not None:
                self.engine.abort([request.request_id])
            raise

    async def _step_while_waiting(self) -> None:
        await asyncio.sleep(0)  # the samples started with this one add their requests first: one batch
        while self._waiting:
            start = time.perf_counter()
            try:
                outputs = self.engine.step()
            except BaseException as e:
                for future in self._waiting.values():
                    if not future.done():
                        future.set_exception(e)
                self._waiting.clear()
                raise
            finally:
                self.seconds += time.perf_counter() - start
            for output in outputs:
                future = self._waiting.pop(output.request_id, None)
                if future is not None and not future.done():
                    future.set_result(output)
            await asyncio.sleep(0)


class Context:
    """What ``run`` gets besides the row: one per sample."""

    def __init__(
        self, rollouts: WorkflowRollouts, row: PromptSample, group_id: int, index: int, sampling: Sampling,
        engine: AsyncEngine, image_ids: list[str],
    ):  # fmt: skip
        self._rollouts, self._engine, self._image_ids = rollouts, engine, image_ids
        self.row = row
        self.group_id = group_id
        self.index = index
        """The sample's index in its row's group (0 .. n - 1)."""
        self.sampling = dataclasses.replace(sampling, n=1)
        """The step's sampling settings (``n`` is 1: ``run`` plays one sample; ``max_tokens`` the response budget)."""
        self.n = sampling.n
        """Samples per row this step (validation: worker.rollout.val_override_config.n)."""
        self.seed = group_seed(rollouts.engine_seed, group_id, sampling.n) + index
        """The sample's seed: its first ``generate`` draws with it."""
        self.processor = rollouts.processor
        self.tokenizer = rollouts.tokenizer
        self.tools = rollouts.tools
        """The configured tools (``worker.rollout.multi_turn.tools``) as a ``ToolRunner``, or None."""
        self.max_response_length = rollouts.max_response_length
        """Tokens an episode may hold after its prompt (``data.max_response_length``), model and context."""
        self._calls = 0
        self.request_ids: list[str] = []

    def episode(self) -> Episode:
        """A new episode holding the row's prompt."""
        return Episode.start(self.row, self.group_id, self.index, self._image_ids)

    async def generate(
        self,
        prompt: Episode | list[int],
        *,
        images: list[Any] | None = None,
        max_tokens: int | None = None,
        temperature: float | None = None,
        seed: int | None = None,
    ) -> Generation:
        """Sample one continuation of ``prompt``: an episode (its engine tokens and images), or token ids in the
        engine's view (one placeholder per image) with ``images``. For an episode ``max_tokens`` is at most
        what its budget has left."""
        if isinstance(prompt, Episode):
            ids, data = list(prompt.raw), prompt.multi_modal_data()
            mm_ids = {"image": list(prompt.image_ids)} if prompt.image_ids and not prompt.prompt.videos else {}
            left = self.max_response_length - prompt.used()
            if left <= 0:
                raise ValueError(
                    f"episode {prompt.sample_id} has no token budget left (data.max_response_length="
                    f"{self.max_response_length}); end the episode instead of generating"
                )
            max_tokens = min(max_tokens or left, left)
        else:
            ids, data, mm_ids = list(prompt), ({"image": list(images)} if images else {}), {}
            max_tokens = max_tokens or self.sampling.max_tokens
        request_id = f"{self.group_id}:{self.index}:{self._calls}"
        draw = turn_seed(self.seed, self._calls) if seed is None else seed
        self._calls += 1
        sampling = dataclasses.replace(self.sampling, max_tokens=max_tokens, seed=draw)
        if temperature is not None:
            sampling = dataclasses.replace(sampling, temperature=temperature)
        self.request_ids.append(request_id)
        output = await self._engine.generate(
            EngineRequest(
                request_id=request_id, prompt_token_ids=ids, multi_modal_data=data, sampling=sampling,
                multi_modal_ids=mm_ids,
            )
        )  # fmt: skip
        sample = output.samples[0]
        versions = list(sample.versions) or [output.version] * len(sample.token_ids)
        return Generation(list(sample.token_ids), sample.text, sample.log_probs, versions, sample.finish_reason)

    def add_generation(self, episode: Episode, generation: Generation) -> None:
        """Append a model turn (trained: loss mask 1)."""
        episode.add_turn(
            generation.token_ids, generation.log_probs, generation.versions, generation.text,
            closed=generation.finish_reason == "stop",
        )  # fmt: skip

    async def call_tool(self, episode: Episode, name: str, arguments: Any) -> CallOutcome:
        """Run a configured tool (``worker.rollout.multi_turn.tools``) as the multi-turn loop runs it: in its
        process or thread, within ``multi_turn.tool_timeout``, with the episode's row, images, turn and state as
        its context. The outcome's ``status`` says whether it ran; a failure is an outcome, never raised. The call is
        recorded on the episode (``Episode.calls``): the reward function gets it as ``tool_calls``."""
        if self.tools is None:
            raise ValueError("ctx.call_tool: no tools are configured; name them in worker.rollout.multi_turn.tools")
        turn = max(episode.num_turns - 1, 0)
        context = ToolContext(
            row=episode.row(), images=list(episode.images), turn=turn, state=episode.state, sample_id=episode.sample_id
        )
        outcome = await self.tools.call(name, arguments, context)
        episode.calls.append({**outcome.record(), "turn": turn})
        return outcome

    def render(self, messages: list[dict], images: list[Any] = (), *, after_turn: bool = True) -> Observation:
        """Chat ``messages`` (images as ``{"type": "image"}`` items, ``images`` in order) as the tokens that follow a
        model turn, in both views, up to the next generation prompt: what the multi-turn loop appends."""
        return self._rollouts.renderer.render(messages, list(images), after_turn=after_turn)

    def add_user(self, episode: Episode, content: str | list[dict], images: list[Any] = ()) -> bool:
        """Append a user message after the last model turn (context: loss mask 0), then the generation prompt.

        ``content``: text, or items (``{"type": "text", "text": ...}``, ``{"type": "image"}`` per image of
        ``images``, or ``{"type": "image", "image": PIL}``). False, and nothing appended, when it would leave
        no room for one more sampled token in the budget: the episode should end."""
        messages = [{"role": "user", "content": content}]
        messages, inline = split_images(messages)
        images = [*inline, *images]
        obs = self.render(messages, images)
        closing = [] if episode.closed else [self._rollouts.end_of_turn]
        if episode.used() + len(closing) + len(obs.ids) + 1 > self.max_response_length:
            return False
        if closing:  # a turn cut by max_tokens: its end-of-turn token as context, as the multi-turn loop does
            episode.add_context(closing)
            episode.closed = True
        episode.add_observation(obs, messages)
        return True


class WorkflowRollouts(RolloutKind):
    """A user workflow as a rollout kind: ``run`` once per sample, every sample of the call at once."""

    name = "workflow"
    variable_rows = True

    def __init__(
        self,
        workflow: Any,
        spec: str,
        engine: Engine,
        renderer: ConversationRenderer,
        *,
        positions: Positions,
        pad_ids: tuple[int, ...],
        max_response_length: int,
        timeout: float | None,
        on_error: OnError,
        tools: Any = None,
    ):
        self.workflow, self.spec, self.engine, self.renderer = workflow, spec, engine, renderer
        self.processor = renderer.processor
        self.tokenizer = renderer.tokenizer
        self.engine_seed = engine.seed
        self.positions, self.pad_ids = positions, pad_ids
        self.max_response_length, self.timeout, self.on_error, self.tools = max_response_length, timeout, on_error, tools
        self.end_of_turn = self.tokenizer.eos_token_id
        self.credit = getattr(type(workflow), "credit", Credit.per_row)
        self._seconds = 0.0

    def rollout(
        self, prompts: list[PromptSample], group_ids: list[int], sampling: Sampling
    ) -> tuple[list[Trajectory], RolloutStats]:
        start = time.perf_counter()
        self.engine.wake_up()
        try:
            results = asyncio.run(self._all(prompts, group_ids, sampling))
        finally:
            self.engine.sleep()
        ran = time.perf_counter()
        stats = RolloutStats(counts={"workflow/dropped": 0.0, "workflow/errors": 0.0, "workflow/timeouts": 0.0})
        trajectories: list[Trajectory] = []
        for (prompt, group_id, index), result in zip(self._samples(prompts, group_ids, sampling), results):
            trajectories += self._trajectories(result, prompt, group_id, index, sampling, stats)
        stats.seconds = {"engine": self._seconds, "workflow": ran - start - self._seconds,
                         "trajectories": time.perf_counter() - ran}  # fmt: skip
        return trajectories, stats

    def close(self) -> None:
        if self.tools is not None:
            self.tools.close()

    @staticmethod
    def _samples(prompts, group_ids, sampling):
        return [(p, g, i) for p, g in zip(prompts, group_ids, strict=True) for i in range(sampling.n)]

    async def _all(self, prompts, group_ids, sampling) -> list[Any]:
        # A rollout server's engine is stepped by its loop's thread, which has its own asynchronous view.
        asynchronous = getattr(self.engine, "asynchronous", None)
        engine = asynchronous() if asynchronous is not None else AsyncEngine(self.engine)
        samples = self._samples(prompts, group_ids, sampling)
        image_ids = {id(p): [image_content_id(image) for image in p.images] for p in prompts}
        runs = [
            self._one(Context(self, p, g, i, sampling, engine, image_ids[id(p)])) for p, g, i in samples
        ]
        try:
            return await asyncio.gather(*runs)
        finally:
            self._seconds = engine.seconds

    async def _one(self, ctx: Context) -> Any:
        """The sample's result, or the exception it ended with (raised later, with the row named)."""
        try:
            return await asyncio.wait_for(self.workflow.run(ctx, ctx.row), self.timeout)
        except (asyncio.TimeoutError, TimeoutError):
            return _Timeout(self.timeout)
        except Exception as e:  # noqa: BLE001: the row is named when it is raised again
            return _Raised(e, traceback.format_exc())

    def _trajectories(self, result, prompt, group_id, index, sampling, stats) -> list[Trajectory]:
        where = f"workflow {self.spec}, row {prompt.uid or prompt.index} (sample {group_id}:{index})"
        if isinstance(result, (_Raised, _Timeout)):
            key = "workflow/timeouts" if isinstance(result, _Timeout) else "workflow/errors"
            return self._fail(key, f"{where}: {result.describe()}", stats)
        if result is None:
            stats.counts["workflow/dropped"] += 1
            return []
        episodes = result if isinstance(result, list) else [result]
        if not episodes or not all(isinstance(e, Episode) for e in episodes):
            got = type(result).__name__ if not isinstance(result, list) else f"list of {[type(e).__name__ for e in result]}"
            return self._fail(
                "workflow/errors", f"{where}: run returned {got}; it must return an Episode (from ctx.episode()), a "
                "non-empty list of them, or None to drop the sample", stats,
            )  # fmt: skip
        rollout_id = f"{group_id}:{index}" if len(episodes) > 1 else ""
        out = []
        for k, episode in enumerate(episodes):
            if not episode.turn_ends:
                return self._fail("workflow/errors", f"{where}: an episode has no model turn (add one with "
                                  "ctx.add_generation)", stats)  # fmt: skip
            if len(episodes) > 1:
                episode = dataclasses.replace(episode, index=index * 1000 + k)
            out.append(
                episode.to_trajectory(
                    positions=self.positions, pad_ids=self.pad_ids, temperature=sampling.temperature,
                    want_log_probs=sampling.want_log_probs, rollout_id=rollout_id,
                )
            )  # fmt: skip
        return out

    def _fail(self, key: str, message: str, stats: RolloutStats) -> list[Trajectory]:
        if self.on_error is OnError.error:
            raise WorkflowError(message + " (data.on_bad_sample=skip drops such samples, counted)")
        stats.counts[key] += 1
        log.warning("sample dropped (%s): %s", key, message)
        return []


@dataclass(frozen=True)
class _Raised:
    error: BaseException
    trace: str

    def describe(self) -> str:
        return f"run raised {type(self.error).__name__}: {self.error}\n{self.trace}"


@dataclass(frozen=True)
class _Timeout:
    seconds: float | None

    def describe(self) -> str:
        return f"run did not finish within worker.rollout.workflow_timeout={self.seconds} s"


def check_workflow_class(cls: Any, spec: str) -> list[str]:
    """What is wrong with ``cls`` as a workflow (empty: nothing)."""
    if not isinstance(cls, type):
        return [f"{spec} is a {type(cls).__name__}, not a class; name a class with async def run(self, ctx, row)"]
    run = getattr(cls, "run", None)
    if run is None or run is Workflow.run:
        return [f"{spec}: class {cls.__name__} has no run method; define async def run(self, ctx, row)"]
    if not inspect.iscoroutinefunction(run):
        return [f"{spec}: {cls.__name__}.run is not async; define it as async def run(self, ctx, row)"]
    credit = getattr(cls, "credit", Credit.per_row)
    if not isinstance(credit, Credit):
        return [f"{spec}: {cls.__name__}.credit is {credit!r}; use vlmrl.api.Credit.per_row or per_rollout"]
    return []

