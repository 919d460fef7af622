"""An OpenAI-compatible HTTP endpoint on a rollout engine that records every call against its rollout.

Issue 19 (Agent Lightning style): an agent written with the OpenAI SDK, or
anything that speaks its protocol, runs unchanged against vlmrl's engine, and
every LLM call it makes becomes a ``Call`` record (``vlmrl.rollout.agents.traces``)
with the exact prompt ids in the actor's view, the sampled ids, their
log-probs and the policy version that served it. It serves
``POST /v1/chat/completions`` (images as ``image_url`` data URLs, tools),
``POST /v1/completions`` and ``GET /v1/models``.

Who is calling: each rollout has its own API key, ``<token>.<secret>:<rollout
id>`` (what ``open_rollout`` returns, and ``api_key``). The token is random per
endpoint and the secret random per rollout (``secrets.token_urlsafe``, neither
holds "." or ":"), so the key splits at its first ":" and a rollout id may hold
anything. A missing or wrong token is refused with 401; a rollout id the owner
never opened (``open_rollout``) with 404; a key whose secret is not the
rollout's it names with 403 (one rollout, or a client cached across rollouts,
cannot call into another); a rollout the owner closed (``close_rollout``) with
410 naming it. Errors have OpenAI's shape, ``{"error": {"message", "type",
"param", "code"}}``. The key was chosen over a header or a URL path because
every OpenAI-compatible client lets the user set it, and nothing else.

It binds 127.0.0.1 by default, and only from ``start`` to ``close``.

Bounds (``EndpointLimits``): at most ``max_connections`` connections are open
at once (one more is answered 503 and closed); a connection that has not sent
a request's headers within ``header_timeout_s`` of opening (or of its last
reply) is closed; a body not received within ``body_timeout_s`` is answered
408 and its connection closed. A body larger than ``max_body_bytes``, by
default what the engine can take (``body_bound``: the context's text and the
per-call image budget), is answered 413 from its ``Content-Length``, before
it is read, and its connection is closed unread. Images are checked against
the per-call budget from their headers before they are decoded
(``vlmrl.rollout.endpoint.render.RenderBudget``).

Length: a call whose prompt (image placeholders expanded, as the engine counts
it) plus ``max_tokens`` exceeds ``max_model_len``, or that asks more than the
per-call budget, is refused with 400 ``context_length_exceeded`` or
``max_tokens_exceeded``, never cut. A call that gives no ``max_tokens`` gets
what fits, up to the budget (OpenAI's rule).

Deliberate deviations from OpenAI's API, each refused with 400 rather than
ignored, since training on tokens that another distribution sampled would be
silently wrong: no ``stream``; no ``stop`` strings (vLLM cuts the text but not
the sampled ids); no penalties, ``logit_bias``, ``response_format`` or top
log-probs. Every request samples with log-probs (the trace needs them); they
are returned only when asked for. Any model name is taken. Extensions: ``top_k``
and ``ignore_eos`` as in vLLM's server; each response says the weight version
that served it in ``vlmrl_version`` and the ``X-Vlmrl-Version`` header, and its
calls' indices in ``vlmrl_call_indices``.

Concurrency: HTTP handlers run on one asyncio thread; rendering runs on a
pool of ``render_threads`` helper threads, so one call's slow images do not
hold up another's (the renderer serializes its own use of the processor and
tokenizer, which are not thread-safe); the engine is driven only by an
``EngineLoop`` thread. For a weight sync, ``load_weights`` (or ``paused`` around
the owner's own steps) holds new calls, waits for those in flight, loads, and
lets the held calls go to the new weights. Between ``start`` and ``close``
nothing else may use the engine (no ``Engine.generate`` beside it): what the
owner needs goes through ``call_engine``, e.g. waking an engine that sleeps
between rollouts before the agents call. Rendering a multi-turn conversation
re-tokenizes the earlier assistant turns from their text, as every
OpenAI-compatible server does; whether the ids match what was sampled is the
trace aggregation's check.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import itertools
import json
import math
import secrets
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from vlmrl.rollout.endpoint.loop import Aborted, EngineLoop
from vlmrl.rollout.endpoint.limits import ENCODED_BYTES_PER_PIXEL, EndpointLimits, Refused, body_bound
from vlmrl.rollout.endpoint.openai import EndpointError, Options, chat_choice, completion_choice, parse_options
from vlmrl.rollout.endpoint.render import ChatRenderer, OverBudget, RenderedPrompt, RenderError
from vlmrl.rollout.engine import Engine, EngineOutput, EngineRequest, NamedTensors, Sampling
from vlmrl.rollout.turns.tool_parsers import ParsedTurn, parse_qwen
from vlmrl.rollout.agents.traces import Call

__all__ = ["VERSION_HEADER", "AgentEndpoint", "EndpointError", "EndpointLimits", "body_bound"]

VERSION_HEADER = "X-Vlmrl-Version"


@dataclass
class _Rollout:
    secret: str
    """The rollout's part of its API key: a call that names the rollout must hold it."""
    calls: list[Call] = field(default_factory=list)
    next_index: int = 0
    requests: set[str] = field(default_factory=set)
    """Engine requests of this rollout now queued or in flight (aborted when it closes)."""
    seed: int | None = None
    """Seeds the calls that give none: call i samples with ``seed + i``, so a rollout's samples do not depend
    on what else the engine serves at the time (an exact resume repeats them)."""
    temperature: float = 1.0
    """The temperature of the calls that give none (the trainer's: its rollouts', or greedy validation's)."""
    rewards: dict[int, float] = field(default_factory=dict)
    """Call index -> the rewards the agent reported for it (``POST /v1/rewards``), summed."""


class AgentEndpoint:
    """Serves an ``Engine`` over OpenAI's HTTP API between ``start`` and ``close``; records calls per rollout."""

    def __init__(
        self,
        engine: Engine,
        renderer: ChatRenderer,
        limits: EndpointLimits,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        model_name: str = "vlmrl",
        parse_tools: Callable[[str], ParsedTurn] = parse_qwen,
        render_threads: int = 4,
        engine_loop: EngineLoop | None = None,
    ):
        """``port`` 0 takes a free one (see ``port`` after ``start``); ``parse_tools`` reads tool calls from a
        response's text when the request has tools (``vlmrl.rollout.turns.tool_parsers``); ``render_threads``: calls
        rendered at once; ``engine_loop``: the loop that already owns ``engine`` (a rollout server's, shared with
        its other calls), else ``start`` makes one."""
        self._given_loop = engine_loop
        self.engine, self.renderer, self.limits = engine, renderer, limits
        self.render_threads = render_threads
        self.host, self.model_name, self.parse_tools = host, model_name, parse_tools
        self._requested_port = port
        self.port: int | None = None
        self._token = secrets.token_urlsafe(32)
        self._lock = threading.Lock()
        self._rollouts: dict[str, _Rollout] = {}
        self._ended: dict[str, str] = {}
        """Closed rollouts' ids and secrets (so a late call with the right key hears that its rollout ended)."""
        self._request_ids = itertools.count()
        self._engine_loop: EngineLoop | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self._listener: asyncio.AbstractServer | None = None
        self._render_pool: ThreadPoolExecutor | None = None

    # ------------------------------------------------------------ lifecycle

    def start(self, timeout: float = 30.0) -> AgentEndpoint:
        """Bind and serve; returns self (so ``with AgentEndpoint(...).start() as endpoint``)."""
        if self._engine_loop is not None:
            raise RuntimeError("the endpoint was started already")
        self._engine_loop = self._given_loop or EngineLoop(self.engine)
        self._render_pool = ThreadPoolExecutor(self.render_threads, thread_name_prefix="vlmrl-endpoint-render")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="vlmrl-endpoint-http", daemon=True)
        self._thread.start()
        try:
            asyncio.run_coroutine_threadsafe(self._listen(), self._loop).result(timeout)
        except BaseException:
            self.close()
            raise
        return self

    async def _listen(self) -> None:
        app = web.Application(client_max_size=self.limits.body_bytes(), middlewares=[self._errors])
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/rewards", self._reward)
        # keepalive_timeout closes a connection that has sent no complete request's headers that long after it
        # opened or after its last reply; lingering_time=0: a refused body is not read to its end.
        self._runner = web.AppRunner(
            app, access_log=None, handle_signals=False, shutdown_timeout=5.0,
            keepalive_timeout=self.limits.header_timeout_s, lingering_time=0,
        )  # fmt: skip
        await self._runner.setup()
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.host, self._requested_port))
        except OSError:
            sock.close()
            raise
        self.port = sock.getsockname()[1]
        server, cap = self._runner.server, self.limits.max_connections
        assert server is not None

        def connection() -> asyncio.Protocol:  # aiohttp's protocol, or a refusal past the cap
            return server() if len(server.connections) < cap else Refused(cap)

        self._listener = await asyncio.get_running_loop().create_server(connection, sock=sock, backlog=128)

    async def _stop_serving(self) -> None:
        if self._listener is not None:
            self._listener.close()
        if self._runner is not None:
            await self._runner.cleanup()

    def close(self, timeout: float = 30.0) -> None:
        """Refuse and abort every call, stop listening (the port is free after) and stop the threads."""
        if self._engine_loop is not None:
            self._engine_loop.close(timeout)  # first: handlers waiting on the engine answer at once
        if self._loop is not None and self._thread is not None and self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(self._stop_serving(), self._loop).result(timeout)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout)
            self._loop.close()
        if self._render_pool is not None:
            self._render_pool.shutdown(wait=False, cancel_futures=True)
        self._runner = self._listener = self._loop = self._thread = None

    def __enter__(self) -> AgentEndpoint:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def base_url(self) -> str:
        """What an OpenAI client takes as ``base_url``."""
        if self.port is None:
            raise RuntimeError("the endpoint is not started")
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/v1"

    def api_key(self, rollout_id: str) -> str:
        """The key an agent of ``rollout_id`` calls with, ``<token>.<secret>:<rollout id>``: the one
        ``open_rollout`` returned. KeyError for a rollout never opened."""
        with self._lock:
            rollout = self._rollouts.get(rollout_id)
            secret = rollout.secret if rollout is not None else self._ended.get(rollout_id)
        if secret is None:
            raise KeyError(f"rollout {rollout_id!r} was never opened: it has no key")
        return f"{self._token}.{secret}:{rollout_id}"

    def __repr__(self) -> str:  # never the token
        return f"AgentEndpoint(host={self.host!r}, port={self.port})"

    # ------------------------------------------------------------ rollouts

    def open_rollout(self, rollout_id: str, seed: int | None = None, temperature: float = 1.0) -> str:
        """Accept calls for ``rollout_id`` from now until ``close_rollout``; the API key they must carry (its
        own: a key of another rollout is refused). An id is used once.

        ``seed``: a call that gives no seed of its own samples with ``seed`` plus its index in the rollout;
        None leaves such calls to the engine's generator. ``temperature``: for calls that give none."""
        if not isinstance(rollout_id, str) or not rollout_id:
            raise ValueError("a rollout id is a non-empty string")
        with self._lock:
            if rollout_id in self._rollouts or rollout_id in self._ended:
                raise ValueError(f"rollout {rollout_id!r} was opened before; rollout ids are used once")
            self._rollouts[rollout_id] = _Rollout(secrets.token_urlsafe(24), seed=seed, temperature=temperature)
        return self.api_key(rollout_id)

    def close_rollout(self, rollout_id: str) -> list[Call]:
        """End ``rollout_id``: later calls are refused, calls in flight are aborted (their agents get 410).

        Returns its recorded calls in index order. Indices are given as calls
        arrive; a call that failed or was aborted leaves its index unused.
        """
        with self._lock:
            rollout = self._rollouts.pop(rollout_id, None)
            if rollout is None:
                raise KeyError(f"rollout {rollout_id!r} is not open")
            self._ended[rollout_id] = rollout.secret
            pending = list(rollout.requests)
        if pending and self._engine_loop is not None:
            self._engine_loop.abort(pending)
        calls = [dataclasses.replace(c, reward=rollout.rewards[c.index]) if c.index in rollout.rewards else c
                 for c in rollout.calls]  # fmt: skip
        return sorted(calls, key=lambda c: c.index)

    # ------------------------------------------------------------ weight syncs

    def pause(self) -> None:
        """Hold new calls (they wait, then are served after ``resume``); calls in flight go on."""
        self._running().pause()

    def drain(self, timeout: float | None = None) -> bool:
        """Wait (after ``pause``) until no call is in flight; False if ``timeout`` passed first."""
        return self._running().drain(timeout)

    def resume(self) -> None:
        self._running().resume()

    @contextmanager
    def paused(self, timeout: float | None = None) -> Iterator[None]:
        """Pause and drain on entry, resume on exit: inside, the engine has no call in flight."""
        self.pause()
        try:
            if not self.drain(timeout):
                raise TimeoutError(f"calls were still in flight after {timeout} s")
            yield
        finally:
            self.resume()

    def call_engine(self, fn: Callable[[Engine], Any], timeout: float | None = None) -> Any:
        """Run ``fn(engine)`` on the thread that owns the engine; what it returns. The only way to touch the
        engine while the endpoint runs."""
        return self._running().call(fn, timeout)

    def load_weights(self, named_tensors: NamedTensors, version: int, timeout: float | None = None) -> None:
        """Load new weights between calls: pause, drain, ``Engine.load_weights``, resume."""
        with self.paused(timeout):
            self.call_engine(lambda engine: engine.load_weights(named_tensors, version))

    def in_flight(self) -> int:
        """Calls now added to the engine and not finished."""
        return self._running().in_flight()

    def queued(self) -> int:
        """Calls waiting to be added to the engine (held while paused)."""
        return self._running().queued()

    def _running(self) -> EngineLoop:
        if self._engine_loop is None:
            raise RuntimeError("the endpoint is not started")
        return self._engine_loop

    # ------------------------------------------------------------ HTTP

    @web.middleware
    async def _errors(self, request: web.Request, handler: Callable) -> web.StreamResponse:
        try:
            return await handler(request)
        except EndpointError as e:
            return _error(e)
        except web.HTTPException as e:  # no such route, wrong method, body too large: in OpenAI's shape too
            return _error(EndpointError(e.status, e.reason or "error", f"http_{e.status}", close=e.status == 413))
        except Exception as e:
            return _error(EndpointError(500, f"{type(e).__name__}: {e}", "internal_error", "server_error"))

    def _authorize(self, request: web.Request, *, rollout: bool = True) -> str:
        """The caller's rollout id, once its key holds the token and the secret of the open rollout it names."""
        header = request.headers.get("Authorization", "")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise EndpointError(401, "no API key: send 'Authorization: Bearer <the rollout's llm.api_key>'",
                                "missing_api_key")  # fmt: skip
        credential, _, rollout_id = key.strip().partition(":")
        token, _, secret = credential.partition(".")
        if not hmac.compare_digest(token.encode(), self._token.encode()):
            raise EndpointError(401, "incorrect API key", "invalid_api_key")
        if not rollout:
            return rollout_id
        with self._lock:
            if not rollout_id:
                raise EndpointError(401, "the API key names no rollout: use the rollout's own llm.api_key",
                                    "invalid_api_key")  # fmt: skip
            live = self._rollouts.get(rollout_id)
            own = live.secret if live is not None else self._ended.get(rollout_id)
            if own is not None and not hmac.compare_digest(secret.encode(), own.encode()):
                raise EndpointError(
                    403, f"the API key is not rollout {rollout_id!r}'s: each rollout calls with its own key "
                    "(its llm.api_key), and a key serves no other rollout", "wrong_rollout_key", "permission_error",
                )  # fmt: skip
            self._live(rollout_id)
        return rollout_id

    def _live(self, rollout_id: str) -> _Rollout:
        """The open rollout ``rollout_id`` (call with the lock held)."""
        rollout = self._rollouts.get(rollout_id)
        if rollout is not None:
            return rollout
        if rollout_id in self._ended:
            raise EndpointError(410, f"rollout {rollout_id!r} has ended; it takes no more calls", "rollout_ended")
        raise EndpointError(404, f"rollout {rollout_id!r} is unknown: it was never opened", "rollout_not_found")

    async def _body(self, request: web.Request) -> dict:
        """The JSON body, refused (413) from its declared length before it is read when it is over the bound,
        and (408) when it does not arrive within ``body_timeout_s``; either closes the connection."""
        bound = self.limits.body_bytes()
        if request.content_length is not None and request.content_length > bound:
            raise EndpointError(
                413, f"the body is {request.content_length} bytes, over this endpoint's {bound}: what the model's "
                "context of text and the per-call image budget (worker.rollout.agent_options.max_call_pixels) come "
                f"to, at about {ENCODED_BYTES_PER_PIXEL:g} byte per pixel for encoded images; send fewer, smaller or "
                "JPEG images",
                "request_too_large", close=True,
            )  # fmt: skip
        try:
            async with asyncio.timeout(self.limits.body_timeout_s):
                raw = await request.read()
        except TimeoutError as e:
            raise EndpointError(
                408, f"the body did not arrive within {self.limits.body_timeout_s:g} s", "request_timeout", close=True
            ) from e
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise EndpointError(400, f"the body is not JSON ({e})", "invalid_json") from e
        if not isinstance(body, dict):
            raise EndpointError(400, "the body must be a JSON object", "invalid_json")
        return body

    async def _in_pool(self, fn: Callable, *args: Any) -> Any:
        """``fn(*args)`` on a rendering thread, off the event loop."""
        try:
            return await asyncio.get_running_loop().run_in_executor(self._render_pool, fn, *args)
        except OverBudget as e:
            raise EndpointError(400, str(e), e.code, param=e.param) from e
        except RenderError as e:
            raise EndpointError(400, str(e), "invalid_prompt") from e

    def _choices(self, write: Callable[..., dict], output: EngineOutput, *args: Any) -> list[dict]:
        """The reply's choices (the tokenizer decodes them: under the renderer's lock)."""
        with self.renderer.lock:
            return [write(i, sample, self.renderer.tokenizer, *args) for i, sample in enumerate(output.samples)]

    async def _models(self, request: web.Request) -> web.Response:
        self._authorize(request, rollout=False)
        model = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "vlmrl"}
        return web.json_response({"object": "list", "data": [model]})

    async def _chat(self, request: web.Request) -> web.Response:
        rollout_id = self._authorize(request)
        body = await self._body(request)
        options = parse_options(body, chat=True)
        tools = body.get("tools") or None
        prompt = await self._in_pool(self.renderer.chat, body.get("messages"), tools, self.limits.budget())
        output, indices = await self._serve(rollout_id, prompt, options)
        parse = self.parse_tools if tools is not None and body.get("tool_choice") != "none" else None
        choices = await self._in_pool(self._choices, chat_choice, output, parse, options.log_probs)
        return self._response("chat.completion", "chatcmpl", choices, prompt, output, indices)

    async def _reward(self, request: web.Request) -> web.Response:
        """``{"reward": r, "call": i}``: a reward for call ``i`` of the caller's rollout (default: its latest
        recorded call), summed with earlier ones for it; it becomes that call's turn reward when the rollout ends."""
        rollout_id = self._authorize(request)
        body = await self._body(request)
        reward, call = body.get("reward"), body.get("call")
        if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
            raise EndpointError(400, f"'reward' must be a finite number; got {reward!r}", "invalid_reward",
                                param="reward")  # fmt: skip
        with self._lock:
            rollout = self._live(rollout_id)
            recorded = sorted(c.index for c in rollout.calls)
            if call is None:
                if not recorded:
                    raise EndpointError(400, f"rollout {rollout_id!r} has no recorded call to reward yet",
                                        "invalid_call", param="call")  # fmt: skip
                call = recorded[-1]
            elif isinstance(call, bool) or not isinstance(call, int) or call not in recorded:
                raise EndpointError(
                    400, f"'call' {call!r} is not a recorded call of rollout {rollout_id!r}; its calls: {recorded}",
                    "invalid_call", param="call",
                )  # fmt: skip
            rollout.rewards[call] = rollout.rewards.get(call, 0.0) + float(reward)
            total = rollout.rewards[call]
        return web.json_response({"object": "reward", "call": call, "reward": total})

    async def _completions(self, request: web.Request) -> web.Response:
        rollout_id = self._authorize(request)
        body = await self._body(request)
        options = parse_options(body, chat=False)
        prompt = await self._in_pool(self.renderer.completion, body.get("prompt"), self.limits.budget())
        output, indices = await self._serve(rollout_id, prompt, options)
        choices = await self._in_pool(self._choices, completion_choice, output, options.log_probs)
        return self._response("text_completion", "cmpl", choices, prompt, output, indices)

    # ------------------------------------------------------------ serving a call

    def _max_tokens(self, prompt_length: int, asked: int | None) -> int:
        """The call's max_tokens, or the refusal of a call over the length budget."""
        limits = self.limits
        room = limits.max_model_len - prompt_length
        if asked is None:
            if room < 1:
                raise EndpointError(
                    400, f"the prompt is {prompt_length} tokens (images expanded to their patch tokens), which leaves "
                    f"no room to sample under the model's context of {limits.max_model_len}", "context_length_exceeded",
                    param="messages",
                )  # fmt: skip
            return min(limits.max_tokens, room)
        if asked > limits.max_tokens:
            raise EndpointError(
                400, f"max_tokens={asked} is over this endpoint's per-call budget of {limits.max_tokens} tokens",
                "max_tokens_exceeded", param="max_tokens",
            )  # fmt: skip
        if prompt_length + asked > limits.max_model_len:
            raise EndpointError(
                400, f"the prompt is {prompt_length} tokens (images expanded to their patch tokens) and max_tokens is "
                f"{asked}: {prompt_length + asked} is over the model's context of {limits.max_model_len}; shorten the "
                "conversation or ask for fewer tokens", "context_length_exceeded", param="max_tokens",
            )  # fmt: skip
        return asked

    async def _serve(self, rollout_id: str, prompt: RenderedPrompt, options: Options) -> tuple[EngineOutput, list[int]]:
        """Run one call on the engine and record its samples; the output and the samples' call indices."""
        if options.n > self.limits.max_n:
            raise EndpointError(
                400, f"n={options.n} is over this endpoint's {self.limits.max_n}", "invalid_n", param="n"
            )
        max_tokens = self._max_tokens(len(prompt.actor_ids), options.max_tokens)
        request_id = f"endpoint-{next(self._request_ids)}"
        with self._lock:
            rollout = self._live(rollout_id)
            first = rollout.next_index  # indices are given as calls arrive
            rollout.next_index += options.n
            seed = options.seed
            if seed is None and rollout.seed is not None:
                seed = rollout.seed + first
            temperature = rollout.temperature if options.temperature is None else options.temperature
            sampling = Sampling(
                n=options.n, temperature=temperature, top_p=options.top_p, top_k=options.top_k,
                max_tokens=max_tokens, want_log_probs=True, ignore_eos=options.ignore_eos, seed=seed,
            )  # fmt: skip
            engine_request = EngineRequest(
                request_id=request_id,
                prompt_token_ids=prompt.engine_ids,
                multi_modal_data={"image": list(prompt.images)} if prompt.images else {},
                sampling=sampling,
            )
            # Submitted under the lock, so a close_rollout either comes first (refused above) or aborts it.
            future = self._running().submit(engine_request)
            rollout.requests.add(request_id)
        try:
            output = await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            self._running().abort([request_id])
            raise
        except Aborted as e:
            with self._lock:
                self._live(rollout_id)  # ended while the call was served: says so
            raise EndpointError(503, f"the call was aborted ({e})", "aborted", "server_error") from e
        except Exception as e:  # the engine refused the request (e.g. more images than it takes)
            raise EndpointError(400, f"the engine refused the call ({type(e).__name__}: {e})", "engine_refused") from e
        finally:
            with self._lock:
                rollout.requests.discard(request_id)
        indices = list(range(first, first + options.n))
        calls = [
            Call(
                rollout_id=rollout_id,
                index=index,
                prompt_ids=list(prompt.actor_ids),
                response_ids=list(sample.token_ids),
                log_probs=list(sample.log_probs or []),
                version=output.version,
                finish_reason=sample.finish_reason or "stop",
                temperature=temperature,
                images=tuple(prompt.images),
            )
            for index, sample in zip(indices, output.samples, strict=True)
        ]
        with self._lock:
            self._live(rollout_id)  # a rollout closed in the meantime does not get calls after its close
            rollout.calls += calls
        return output, indices

    def _response(
        self,
        kind: str,
        prefix: str,
        choices: list[dict],
        prompt: RenderedPrompt,
        output: EngineOutput,
        indices: list[int],
    ) -> web.Response:
        completion = sum(len(s.token_ids) for s in output.samples)
        body = {
            "id": f"{prefix}-{uuid.uuid4().hex}",
            "object": kind,
            "created": int(time.time()),
            "model": self.model_name,
            "choices": choices,
            "usage": {
                "prompt_tokens": len(prompt.actor_ids),
                "completion_tokens": completion,
                "total_tokens": len(prompt.actor_ids) + completion,
            },
            "vlmrl_version": output.version,
            "vlmrl_call_indices": indices,
        }
        return web.json_response(body, headers={VERSION_HEADER: str(output.version)})


def _error(e: EndpointError) -> web.Response:
    response = web.json_response(e.body(), status=e.status)
    if e.close:
        response.force_close()
    return response
