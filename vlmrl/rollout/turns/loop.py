"""Multi-turn rollouts: the model talks to tools or an environment over several turns.

Turns run in lock-step: one engine call per turn over every trajectory still
going (prefix caching makes the shared history cheap), then every tool call
of that turn at once (asyncio; sync tools in threads), then the observations
are appended and the next turn starts. A trajectory ends when the model
answers without a call ("done", or a tool or the environment says done),
after ``max_turns`` model turns ("max_turns"), when its token budget is spent
("length"), or when the environment fails ("error"). Calls made in the last
allowed turn are recorded as ``skipped`` and not run, as verl's agent loop
does: nothing would read their results, and a slow tool would hold up the
whole rollout for nothing. An environment still steps after the last turn,
since its step is the only judge of that action.

Each turn is its own engine request with n=1, seeded by (group, sample,
turn): the first turn's seed is the one the single-turn path gives sample i
of its group (``group_seed`` + i), so the turns of a trajectory are distinct
draws and a resumed run samples what an uninterrupted one does.

The record (``Trajectory``) keeps two token views apart while it grows: the
engine's (one placeholder per image) and the actor's (patch tokens). The
model's tokens are appended as sampled, with loss mask 1; observations with
mask 0 (see ``observations`` for how they are rendered). The 3-D positions of
the whole sequence come from the family's own position function at the end.

Budget: ``data.max_response_length`` bounds everything after the prompt. A
turn may sample what is left (or ``max_tokens_per_turn``); an observation that
would not leave room for one more token is not appended and the trajectory
ends, so no image is ever cut from its tokens.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from vlmrl.records import PromptSample, Trajectory
from vlmrl.rollout.engine import Engine, EngineRequest, Sampling, image_content_id
from vlmrl.rollout.engine.sampling import group_seed
from vlmrl.rollout.episode import Episode
from vlmrl.rollout.turns import envs
from vlmrl.rollout.turns.observations import ConversationRenderer, split_images
from vlmrl.rollout.turns.tool_parsers import ParsedTurn
from vlmrl.rollout.turns.tools import CallOutcome, ToolContext, ToolResult, ToolRunner, ToolStatus


@dataclass(frozen=True)
class Limits:
    max_turns: int
    max_response_length: int
    """Tokens after the prompt, model and observation tokens together."""
    max_tokens_per_turn: int | None
    max_tool_response_length: int
    max_images: int
    tool_timeout: float
    max_parallel_calls: int


def turn_seed(first_seed: int, turn: int) -> int:
    """The seed of a trajectory's ``turn``-th request: its first seed for turn 0, a distinct draw after.

    >>> turn_seed(11, 0), turn_seed(11, 1), turn_seed(11, 2)
    (11, 11000004, 11000005)
    """
    return first_seed if turn == 0 else (first_seed * 1_000_003 + turn) % (2**63 - 1)


@dataclass
class _Conversation(Episode):
    """One trajectory while its turns are played, with what its tools and environment keep."""

    calls: list[dict] = field(default_factory=list)
    env: Any = None


@dataclass
class _Reply:
    """What answers one model turn."""

    messages: list[dict] = field(default_factory=list)
    images: list[Any] = field(default_factory=list)
    reward: float = 0.0
    done: bool = False
    failed: bool = False
    """The environment failed: the trajectory ends with stop reason "error"."""


class AgentLoop:
    """Plays multi-turn rollouts on an engine, with tools (``tools``) or an environment class (``env_class``)."""

    def __init__(
        self,
        engine: Engine,
        renderer: ConversationRenderer,
        limits: Limits,
        *,
        positions: Callable[[list[int], dict[str, torch.Tensor]], torch.Tensor],
        pad_ids: tuple[int, ...],
        runner: ToolRunner | None = None,
        parser: Callable[[str], ParsedTurn] | None = None,
        env_class: type | None = None,
    ):
        if (runner is None) == (env_class is None):
            raise ValueError("an agent loop talks to tools or to an environment: give one")
        self.engine, self.renderer, self.limits = engine, renderer, limits
        self.positions, self.pad_ids = positions, pad_ids
        self.runner, self.parser, self.env_class = runner, parser, env_class
        self.tokenizer = renderer.tokenizer
        self.end_of_turn = self.tokenizer.eos_token_id

    # ------------------------------------------------------------------ the loop

    def run(
        self, prompts: list[PromptSample], group_ids: list[int], sampling: Sampling
    ) -> tuple[list[Trajectory], dict[str, float]]:
        """n trajectories per prompt, in prompt and sample order, and the seconds of generation and tools."""
        timings = {"engine": 0.0, "tools": 0.0, "render": 0.0}
        # Every turn sends the engine all of a trajectory's images again; each image's id is computed once here
        # (the prompt's, for its n trajectories) or when a tool's arrives, so the engine need not hash them.
        conversations = [
            self._start(prompt, group_id, i, image_ids)
            for prompt, group_id in zip(prompts, group_ids, strict=True)
            for image_ids in [[image_content_id(image) for image in prompt.images]]
            for i in range(sampling.n)
        ]
        active = [c for c in conversations if not c.stop_reason]
        if self.env_class is not None:
            start = time.perf_counter()
            active = self._reset(active)
            timings["tools"] += time.perf_counter() - start
        for turn in range(self.limits.max_turns):
            if not active:
                break
            start = time.perf_counter()
            outputs = self.engine.generate([self._request(c, turn, sampling) for c in active])
            timings["engine"] += time.perf_counter() - start
            answered = []
            for c, output in zip(active, outputs, strict=True):
                sample = output.samples[0]
                # Per token where a weight load landed inside the turn (a rollout server's engine), else one version.
                c.add_turn(sample.token_ids, sample.log_probs, sample.versions or output.version, sample.text)
                if sample.finish_reason == "stop":
                    answered.append(c)
                elif c.used() < self.limits.max_response_length and self.end_of_turn is not None:
                    # Cut by max_tokens_per_turn, not by the budget: the turn is closed with the end-of-turn
                    # token as context (never trained: the model did not sample it) and answered as written.
                    c.add_context([self.end_of_turn])
                    answered.append(c)
                else:
                    c.stop_reason = "length"
            start = time.perf_counter()
            replies = asyncio.run(self._replies(answered, turn))
            timings["tools"] += time.perf_counter() - start
            start = time.perf_counter()
            active = [c for c, reply in zip(answered, replies) if self._answer(c, reply, turn)]
            timings["render"] += time.perf_counter() - start
        for c in active:
            c.stop_reason = "max_turns"
        start = time.perf_counter()
        trajectories = [self._finish(c, sampling.temperature, sampling.want_log_probs) for c in conversations]
        timings["render"] += time.perf_counter() - start
        return trajectories, timings

    def _start(self, prompt: PromptSample, group_id: int, index: int, image_ids: list[str]) -> _Conversation:
        return _Conversation.start(prompt, group_id, index, image_ids)

    def _request(self, c: _Conversation, turn: int, sampling: Sampling) -> EngineRequest:
        left = self.limits.max_response_length - c.used()
        max_tokens = min(left, self.limits.max_tokens_per_turn or left)
        first = group_seed(self.engine.seed, c.group_id, sampling.n) + c.index
        return EngineRequest(
            request_id=f"{c.sample_id}:{turn}",
            prompt_token_ids=list(c.raw),
            multi_modal_data=c.multi_modal_data(),
            sampling=dataclasses.replace(sampling, n=1, max_tokens=max_tokens, seed=turn_seed(first, turn)),
            multi_modal_ids={"image": list(c.image_ids)} if c.image_ids else {},
        )

    def _answer(self, c: _Conversation, reply: _Reply, turn: int) -> bool:
        """Take a turn's reply into the conversation; whether it goes on to another turn."""
        c.turn_rewards[-1] += reply.reward
        if reply.failed:
            c.stop_reason = "error"
            return False
        if reply.done:
            c.stop_reason = "done"
            return False
        if turn + 1 >= self.limits.max_turns:
            c.stop_reason = "max_turns"
            return False
        return self._observe(c, reply.messages, reply.images, after_turn=True)

    def _observe(self, c: _Conversation, messages: list[dict], images: list[Any], *, after_turn: bool) -> bool:
        room = self.limits.max_images - len(c.new_images)
        if len(images) > room:
            dropped = len(images) - max(room, 0)
            images = images[: max(room, 0)]
            messages = _drop_image_items(messages, len(images))
            messages.append(
                {"role": "user", "content": f"({dropped} image(s) left out: at most {self.limits.max_images} per trajectory)"}
            )
        try:
            obs = self.renderer.render(messages, images, after_turn=after_turn)
        except (ValueError, TypeError) as e:
            c.stop_reason = "error"
            c.calls.append({"name": "", "status": "render_error", "error": str(e), "turn": len(c.turn_ends)})
            return False
        # Room for the observation and at least one more sampled token, or the trajectory ends here.
        if c.used() + len(obs.ids) + 1 > self.limits.max_response_length:
            c.stop_reason = "length"
            return False
        c.add_observation(obs, messages)
        return True

    # ------------------------------------------------------------------ replies

    async def _replies(self, conversations: list[_Conversation], turn: int) -> list[_Reply]:
        if self.env_class is not None:
            return await asyncio.gather(*(self._env_step(c) for c in conversations))
        return await asyncio.gather(*(self._tool_reply(c, turn) for c in conversations))

    async def _tool_reply(self, c: _Conversation, turn: int) -> _Reply:
        parsed = self.parser(c.last_text)
        if not parsed.calls and not parsed.errors:
            return _Reply(done=True)  # an answer, not a call
        context = ToolContext(row=c.row(), images=list(c.images), turn=turn, state=c.state, sample_id=c.sample_id)
        last = turn + 1 >= self.limits.max_turns  # no turn follows to read the results: nothing is run
        limit = 0 if last else self.limits.max_parallel_calls
        runs = [self.runner.call(call.name, call.arguments, context) for call in parsed.calls[:limit]]
        outcomes: list[CallOutcome] = list(await asyncio.gather(*runs))
        why = (
            f"not run: the trajectory reached multi_turn.max_turns={self.limits.max_turns}"
            if last
            else f"Error: at most {limit} tool calls per turn; this one was not run"
        )
        for call in parsed.calls[limit:]:
            outcomes.append(CallOutcome(call.name, call.arguments, ToolStatus.skipped, ToolResult(text=why)))
        outcomes += [CallOutcome("", None, ToolStatus.parse_error, ToolResult(text=f"Error: {e}")) for e in parsed.errors]
        results, reply = [], _Reply()
        for outcome in outcomes:
            c.calls.append({**outcome.record(), "turn": turn})
            result = outcome.result
            results.append((self._cut(result.text), list(result.images)))
            reply.images += result.images
            reply.reward += float(result.reward or 0.0)
            reply.done = reply.done or result.done
        reply.messages = self.renderer.tool_messages(results)
        return reply

    async def _env_step(self, c: _Conversation) -> _Reply:
        start = time.perf_counter()
        try:
            value = await envs.call(c.env.step, c.last_text, pool=self._pool, timeout=self.limits.tool_timeout)
            messages, reward, done = envs.as_step(value)
        except Exception as e:  # the environment's failure ends this trajectory, not the run
            status = "timeout" if isinstance(e, asyncio.TimeoutError) else "error"
            c.calls.append({"name": "env.step", "status": status, "error": f"{type(e).__name__}: {e}",
                            "seconds": time.perf_counter() - start, "turn": len(c.turn_ends) - 1})  # fmt: skip
            return _Reply(failed=True)
        c.calls.append({"name": "env.step", "status": "ok", "seconds": time.perf_counter() - start,
                        "turn": len(c.turn_ends) - 1})  # fmt: skip
        messages, images = split_images(self._cut_messages(messages))
        return _Reply(messages=messages, images=images, reward=reward, done=done)

    def _reset(self, conversations: list[_Conversation]) -> list[_Conversation]:
        """Make each trajectory's environment and show its first observation; the ones still going."""

        async def reset_all():
            return await asyncio.gather(*(reset(c) for c in conversations), return_exceptions=True)

        async def reset(c: _Conversation):
            c.env = self.env_class()
            sample = {**c.row(), "images": list(c.images)}
            return envs.as_messages(await envs.call(c.env.reset, sample, pool=self._pool, timeout=self.limits.tool_timeout))

        going = []
        for c, result in zip(conversations, asyncio.run(reset_all())):
            if isinstance(result, BaseException):
                c.stop_reason = "error"
                c.calls.append({"name": "env.reset", "status": "error", "error": f"{type(result).__name__}: {result}", "turn": 0})
                continue
            if result:
                messages, images = split_images(self._cut_messages(result))
                if not self._reopen_prompt(c, messages, images):
                    continue
            going.append(c)
        return going

    def _reopen_prompt(self, c: _Conversation, messages: list[dict], images: list[Any]) -> bool:
        """Put an observation between the prompt and the first turn: the prompt's generation prompt comes off
        (it stays in the prompt's tokens, which are never trained) and the observation, which opens the model's
        turn itself, follows it as context."""
        gen = self.tokenizer.encode(self.renderer.generation_prompt, add_special_tokens=False)
        if not gen or c.raw[-len(gen) :] != gen or c.ids[-len(gen) :] != gen:
            c.stop_reason = "error"
            c.calls.append({"name": "env.reset", "status": "error", "turn": 0,
                            "error": "the prompt does not end with the chat template's generation prompt"})  # fmt: skip
            return False
        for view in (c.raw, c.ids, c.mask, c.log_probs, c.versions):
            del view[-len(gen) :]
        c.prompt_length -= len(gen)
        # The generation prompt's tokens come back as the observation's first context tokens.
        return self._observe(c, messages, images, after_turn=False)

    @property
    def _pool(self):
        return self.runner.pool if self.runner is not None else None

    def _cut(self, text: str) -> str:
        """A tool's text within max_tool_response_length tokens, cut at the end."""
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if len(ids) <= self.limits.max_tool_response_length:
            return text
        return self.tokenizer.decode(ids[: self.limits.max_tool_response_length]) + "..."

    def _cut_messages(self, messages: list[dict]) -> list[dict]:
        out = []
        for m in messages:
            content = m.get("content")
            if isinstance(content, str):
                m = {**m, "content": self._cut(content)}
            elif isinstance(content, list):
                m = {**m, "content": [
                    {**i, "text": self._cut(i["text"])} if isinstance(i, dict) and isinstance(i.get("text"), str) else i
                    for i in content
                ]}  # fmt: skip
            out.append(m)
        return out

    # ------------------------------------------------------------------ the record

    def _finish(self, c: _Conversation, temperature: float, want_log_probs: bool) -> Trajectory:
        return c.to_trajectory(
            positions=self.positions,
            pad_ids=self.pad_ids,
            temperature=temperature,
            want_log_probs=want_log_probs,
            tool_calls=c.calls,
            # One re-render per group (its first trajectory): the re-render and re-tokenisation of a whole
            # conversation cost about as much as rendering all of its observations, and the rate over the
            # first trajectories estimates the rate over all of them.
            render_mismatch=self._mismatch(c) if c.index == 0 else None,
            conversation=True,
        )

    def _mismatch(self, c: _Conversation) -> bool:
        """Whether the engine's view differs from the chat template's rendering of the whole conversation.

        The re-render is the prompt (without its generation prompt) and the conversation as the template writes
        it after a prefix, tokenized anew; differences come from templates that are not append-only (Qwen3's
        drops earlier turns' reasoning) and from sampled tokens that are not the tokenizer's own encoding.
        """
        gen = self.renderer.generation_prompt
        prompt_text = c.prompt.prompt_text
        if not prompt_text.endswith(gen) or not c.messages:
            return False
        try:
            conversation = self.renderer.conversation_text(c.messages)
        except (ValueError, TypeError):
            return True
        full = self.tokenizer.encode(prompt_text[: len(prompt_text) - len(gen)] + conversation, add_special_tokens=False)
        if self.renderer.stop_opens_turn:
            # GLM: the last reply's stop token opens a turn the conversation has not written yet.
            full += c.raw[len(full) : len(full) + 1]
        return full[: len(c.raw)] != c.raw


def _drop_image_items(messages: list[dict], keep: int) -> list[dict]:
    """``messages`` with the image items after the first ``keep`` removed."""
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            items = []
            for item in content:
                if isinstance(item, dict) and item.get("type") == "image":
                    if keep <= 0:
                        continue
                    keep -= 1
                items.append(item)
            m = {**m, "content": items}
        out.append(m)
    return out
