"""``openai_agent``: the user's agent (``worker.rollout.agent``) over an OpenAI-compatible endpoint, and its rows.

Each worker serves its own engine to the agents it runs, over an
OpenAI-compatible endpoint on loopback (``vlmrl.rollout.endpoint``), and runs
``solve(task, llm)`` once per rollout: n rollouts per prompt, the group of
the prompt's id (``vlmrl.rollout.agents.runner``). The calls each rollout made
become training rows (``vlmrl.rollout.agents.traces``, ``algorithm.trace_aggregation``),
and each row becomes a ``Trajectory``: the images of its calls processed for
the actor, its positions from the model family's rotary scheme, and the
rollout's id, so that the driver gives every row of a rollout one advantage.

A rollout that failed (raised, timed out, died, made no call) is counted and
left out, or fails the step (``agent_options.on_failure``). The counts
(``agent/*``, ``trace/*``) travel back in the call's ``RolloutStats``.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from vlmrl.config import AgentFailurePolicy, Config
from vlmrl.data.chat import template_has_tools, tools_system_message
from vlmrl.data.dataset import MODEL_INPUT_KEYS
from vlmrl.models import family_at
from vlmrl.plan import Plan
from vlmrl.records import Media, PromptSample, Trajectory
from vlmrl.rollout.agents.runner import AgentRunner, AgentStatus, AgentTask, RolloutRecord, load_agent, load_hooks
from vlmrl.rollout.agents.traces import Aggregated, TraceRow, aggregate
from vlmrl.rollout.endpoint.render import ChatRenderer
from vlmrl.rollout.endpoint.server import AgentEndpoint, EndpointLimits
from vlmrl.rollout.engine import Engine, Sampling
from vlmrl.rollout.engine.sampling import group_seed
from vlmrl.rollout.kind import Credit, RolloutKind, RolloutStats

log = logging.getLogger(__name__)

CALLS_PER_SEED = 1000
"""Seeds a rollout's calls take (its first seed, then one per call); distinct rollouts' ranges do not meet."""

Positions = Callable[[list[int], dict[str, torch.Tensor]], torch.Tensor]


class AgentRolloutError(RuntimeError):
    """A rollout's agent failed and ``worker.rollout.agent_options.on_failure=fail``."""


def task_fields(prompt: PromptSample) -> dict[str, Any]:
    """What the agent's ``task`` holds besides the images: the row's columns, its question and ground truth."""
    return {
        **prompt.extra,
        "prompt": prompt.question or prompt.prompt_text,
        "ground_truth": prompt.ground_truth,
        "data_source": prompt.data_source,
        "row_index": prompt.index,
    }


class OpenAIAgent(RolloutKind):
    """The agent endpoint over this worker's engine and the runner that calls the user's agent against it."""

    name = "openai_agent"
    credit = Credit.per_rollout
    variable_rows = True
    serves_between_steps = True

    @classmethod
    def build(cls, config: Config, plan: Plan, engine: Engine, processor, pad_ids: tuple[int, ...]) -> OpenAIAgent:
        from vlmrl.workflows.rendering import family_positions

        return cls(config, plan, engine, processor, family_positions(config.worker.actor.model.model_path))

    def __init__(self, config: Config, plan: Plan, engine: Engine, processor, positions: Positions):
        from vlmrl.workflows.rendering import image_resize

        data, rollout = config.data, config.worker.rollout
        opts = rollout.agent_options
        self.tokenizer = getattr(processor, "tokenizer", processor)
        self.image_processor = getattr(processor, "image_processor", None)
        template = data.override_chat_template or getattr(processor, "chat_template", None) or self.tokenizer.chat_template
        family = family_at(config.worker.actor.model.model_path)
        renderer = ChatRenderer(
            processor,
            family=family,
            resize=image_resize(family, processor, data.min_pixels, data.max_pixels),  # the endpoint decodes to RGB
            chat_template=data.override_chat_template,
            template_has_tools=template_has_tools(template),
            tools_message=tools_system_message,
        )
        limits = EndpointLimits(
            max_model_len=plan.rollout_max_model_len,
            max_tokens=opts.max_tokens_per_call or data.max_response_length,
            max_images=opts.max_images_per_call,
            max_image_pixels=opts.max_image_pixels,
            max_call_pixels=opts.max_call_pixels,
            header_timeout_s=opts.header_timeout,
            body_timeout_s=opts.body_timeout,
            max_connections=opts.max_connections,
        )
        # On a rollout server the engine is reached through the server's loop (LoopedEngine): the endpoint
        # submits to that loop, the one thread that steps the engine.
        loop = getattr(engine, "loop", None)
        raw = engine if loop is None else loop.engine
        self.endpoint = AgentEndpoint(raw, renderer, limits, host=opts.host, port=opts.port, engine_loop=loop).start()
        print(f"agent endpoint: serving {self.endpoint.base_url} (each rollout has its own key)", flush=True)
        hooks = {k: v for k, v in vars(rollout.agent_hooks).items() if v}
        self.runner = AgentRunner(
            load_agent(rollout.agent),
            self.endpoint,
            max_concurrency=opts.max_concurrency,
            timeout=opts.timeout,
            hooks=load_hooks(hooks),
            decode=self.tokenizer.decode,
        )
        try:
            self.runner.start()
        except BaseException:
            self.endpoint.close()
            raise
        self.positions = positions
        self.engine_seed = engine.seed
        self._calls = itertools.count()
        self._told_mismatch = False
        self.aggregation = config.algorithm.trace_aggregation
        self.on_failure = opts.on_failure
        self.max_prompt_length, self.max_response_length = data.max_prompt_length, data.max_response_length

    @property
    def paused(self):
        return self.endpoint.paused

    def close(self) -> None:
        self.runner.close()
        self.endpoint.close()

    def rollout(
        self, prompts: list[PromptSample], group_ids: list[int], sampling: Sampling
    ) -> tuple[list[Trajectory], RolloutStats]:
        """``sampling.n`` rollouts per prompt, their rows as trajectories, and the counts and seconds."""
        t0 = time.perf_counter()
        tasks, prompt_of = [], {}
        # The endpoint refuses an id it has served before, and validation reuses group ids: each call's ids
        # carry its number on this worker.
        call = next(self._calls)
        for prompt, group_id in zip(prompts, group_ids, strict=True):
            for i in range(sampling.n):
                rollout_id = f"{group_id}:{i}#{call}"
                # Seeded by the group and the sample, not by the call's number, so a resumed run repeats it.
                seed = (group_seed(self.engine_seed, group_id, sampling.n) + i) * CALLS_PER_SEED
                # A call that sets no temperature samples at the trainer's (greedy at validation by default).
                tasks.append(AgentTask(rollout_id, task_fields(prompt), list(prompt.images), seed, sampling.temperature))
                prompt_of[rollout_id] = (prompt, group_id)
        run = self.runner.run(tasks)
        t1 = time.perf_counter()
        failed = [r for r in run.rollouts if r.status is not AgentStatus.ok]
        if failed and self.on_failure is AgentFailurePolicy.fail:
            raise AgentRolloutError(
                f"{len(failed)} of {len(run.rollouts)} agent rollouts failed; the first: "
                f"{_describe(failed[0])} (worker.rollout.agent_options.on_failure=fail; drop leaves them out)"
            )
        for r in failed:
            log.warning("agent rollout left out: %s", _describe(r))
        done = {r.rollout_id: r for r in run.rollouts if r.status is AgentStatus.ok}
        aggregated = aggregate({rid: r.calls for rid, r in done.items()}, self.aggregation, self.tokenizer.decode)
        for m in aggregated.mismatches[: 1 - self._told_mismatch]:  # once per run, with both views
            self._told_mismatch = True
            log.warning(
                "%d call(s) did not continue their row (counted in trace/mismatches; this is said once per run); "
                "the first, rollout %s call %d (%s, from token %d): the row so far ends %r; the call's prompt ends %r",
                len(aggregated.mismatches), m.rollout_id, m.call_index, m.reason, m.diverges_at, m.previous[-200:],
                m.current[-200:],
            )  # fmt: skip
        trajectories, too_long = [], 0
        for row in aggregated.rows:
            # The endpoint bounds each call, not a merged row, and the padded view has room for
            # data.max_prompt_length + data.max_response_length: a row that does not fit is left out and counted,
            # never cut (a cut could split an image's tokens from its pixels).
            if row.prompt_length > self.max_prompt_length or len(row.token_ids) - row.prompt_length > self.max_response_length:
                too_long += 1
                if too_long == 1:
                    log.warning(
                        "rollout %s calls %s: a row of %d prompt and %d later tokens does not fit "
                        "data.max_prompt_length=%d / data.max_response_length=%d and is left out (trace/too_long_rows); "
                        "raise them, or have the agent make shorter calls",
                        row.rollout_id, row.call_span, row.prompt_length, len(row.token_ids) - row.prompt_length,
                        self.max_prompt_length, self.max_response_length,
                    )  # fmt: skip
                continue
            prompt, group_id = prompt_of[row.rollout_id]
            trajectories.append(self._trajectory(row, done[row.rollout_id], prompt, group_id))
        counts = {
            **{f"agent/rollouts/{status}": float(n) for status, n in run.counts().items()},
            "agent/calls": float(sum(len(r.calls) for r in done.values())),
            "agent/hook_errors": float(sum(run.hook_errors.values())),
            "trace/too_long_rows": float(too_long),
            **aggregated.metrics(),
        }
        return trajectories, RolloutStats(seconds={"agents": t1 - t0, "rows": time.perf_counter() - t1}, counts=counts)

    def _trajectory(self, row: TraceRow, record: RolloutRecord, prompt: PromptSample, group_id: int) -> Trajectory:
        """``row`` as a training row of task ``group_id``: images processed, positions of the family."""
        mm_inputs: dict[str, torch.Tensor] = {}
        if row.images:
            out = self.image_processor(images=list(row.images), do_resize=False, return_tensors="pt")
            mm_inputs = {k: v for k, v in out.items() if k in MODEL_INPUT_KEYS and k != "input_ids"}
        position_ids = self.positions(row.token_ids, mm_inputs)
        offsets = _image_offsets(row.token_ids, self.endpoint.renderer.image_token_id)
        if len(offsets) != len(row.images):
            raise ValueError(
                f"rollout {row.rollout_id} calls {row.call_span}: {len(offsets)} image runs but {len(row.images)} images"
            )
        return row.to_trajectory(
            group_id=group_id,
            position_ids=position_ids,
            mm_inputs=mm_inputs,
            media=[Media("image", o, image) for o, image in zip(offsets, row.images)],
            # The rollout's final answer (its last call's), on every row: the reward function scores it.
            response_text=self.tokenizer.decode(list(record.calls[-1].response_ids), skip_special_tokens=True),
            prompt_text=prompt.prompt_text,
            ground_truth=prompt.ground_truth,
            data_source=prompt.data_source,
            row_index=prompt.index,
            extra=prompt.extra,
            agent_reward=record.reward,
            prompt_media=0,  # its images came with the agent's calls, not from the row: the driver does not hold them
        )


def _image_offsets(token_ids: list[int], image_token_id: int | None) -> list[int]:
    """The index where each run of image pad tokens starts."""
    if image_token_id is None:
        return []
    return [i for i, t in enumerate(token_ids) if t == image_token_id and (i == 0 or token_ids[i - 1] != t)]


def _describe(record: RolloutRecord) -> str:
    error = (record.error or "").strip().splitlines()
    return f"rollout {record.rollout_id}: {record.status.value}" + (f" ({error[-1]})" if error else "")
