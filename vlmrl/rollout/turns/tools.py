"""Tools the model may call in a multi-turn rollout: plain Python functions named by path.

``worker.rollout.multi_turn.tools=[my_tools.py:zoom, ...]``. A tool's name,
description and JSON-schema parameters come from the function itself: its
name, the first paragraph of its docstring, its type hints, defaults and the
``Args:`` section of the docstring. The ``tool`` decorator overrides any of
them. The schemas reach the chat template's ``tools=``, so the model sees
what it may call.

A tool gets its parsed arguments as keyword arguments and, if it has a
parameter named ``context``, a ``ToolContext``: the row's fields, the images
the trajectory has shown so far, the turn number and a dict that lives as
long as the trajectory. It returns text, images, or a ``ToolResult`` with an
optional turn reward and a ``done`` flag.

Tools loaded from their specs run in child processes of the rollout worker
(``multi_turn.tool_processes``, ``vlmrl.rollout.turns.tool_child``): a call that
hangs past the timeout has its process killed and replaced, and one that
crashes it (``os._exit``, a segfault) is an error observation, not a dead
worker. Their results and ``context.state`` come back as data. With
``tool_processes=0``, ``async def`` tools are awaited in the worker's event
loop and plain functions run in a thread pool; a hung thread cannot be
stopped, so once every thread is held by a call that timed out, the next call
raises ``ToolPoolExhausted`` (the step fails, naming the tools) instead of
timing out unseen.

Whatever a tool does wrong (bad arguments, an exception, a timeout, a result
of the wrong type) becomes an error observation the model reads, with a
status the metrics count; it never ends the run.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import threading
import re
import time
import types
import typing
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from vlmrl.user_code import UserCodeError, load_object

KEY = "worker.rollout.multi_turn.tools"


class ToolPoolExhausted(RuntimeError):
    """Every thread of the tool pool is held by a call that timed out and never returned."""


class ToolStatus(str, Enum):
    ok = "ok"
    parse_error = "parse_error"
    """The model's call was not valid (no JSON, no name): see ``tool_parsers``."""
    unknown_tool = "unknown_tool"
    bad_arguments = "bad_arguments"
    error = "error"
    """The tool raised, or returned something that is not a result."""
    timeout = "timeout"
    skipped = "skipped"
    """Not run: more calls in one turn than multi_turn.max_parallel_calls, or a call in the last allowed turn."""


@dataclass
class ToolContext:
    row: dict[str, Any]
    """The row's fields: ``ground_truth``, ``data_source``, ``prompt`` and its other columns."""
    images: list[Any]
    """The images the trajectory has shown so far, the row's first, as PIL images."""
    turn: int
    """The model turn (0-based) whose call this is."""
    state: dict[str, Any]
    """Per trajectory: the same dict at every call of every tool of one trajectory."""
    sample_id: str


@dataclass
class ToolResult:
    text: str = ""
    images: list[Any] = field(default_factory=list)
    reward: float | None = None
    """A turn reward, put on the last token of the turn that made the call."""
    done: bool = False
    """End the trajectory after this turn."""


def tool(name: str | None = None, description: str | None = None, parameters: dict | None = None):
    """Decorator overriding what is read from the function: ``@tool(description="...")``."""

    def mark(fn: Callable) -> Callable:
        fn.__vlmrl_tool__ = {"name": name, "description": description, "parameters": parameters}
        return fn

    return mark


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]
    """JSON schema of the arguments (an object)."""
    fn: Callable
    takes_context: bool
    spec: str = ""
    """Where it was loaded from (path/to/file.py:name); empty for a Tool built from a function in this process."""

    def schema(self) -> dict[str, Any]:
        """The OpenAI-style function schema chat templates take as ``tools=``."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}


def _json_type(hint: Any) -> dict[str, Any]:
    if hint is inspect.Parameter.empty or hint is Any:
        return {}
    origin = typing.get_origin(hint)
    if origin is typing.Literal:
        return {"enum": list(typing.get_args(hint))}
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return _json_type(args[0]) if len(args) == 1 else {}
    if origin in (list, tuple):
        out: dict[str, Any] = {"type": "array"}
        args = typing.get_args(hint)
        if args:
            out["items"] = _json_type(args[0])
        return out
    if origin is dict:
        return {"type": "object"}
    return {"type": _JSON_TYPES[hint]} if hint in _JSON_TYPES else {}


def _docstring_parts(doc: str) -> tuple[str, dict[str, str]]:
    """The first paragraph, and each argument's description from a Google-style ``Args:`` section."""
    doc = inspect.cleandoc(doc or "")
    description = doc.split("\n\n", 1)[0].replace("\n", " ").strip()
    args: dict[str, str] = {}
    section = re.search(r"^(?:Args|Arguments|Parameters):\s*\n((?:[ \t]+.*\n?)+)", doc, re.MULTILINE)
    if section:
        for line in section.group(1).splitlines():
            m = re.match(r"\s+(\w+)(?:\s*\([^)]*\))?:\s*(.*)", line)
            if m:
                args[m.group(1)] = m.group(2).strip()
    return description, args


def tool_from_function(fn: Callable, where: str) -> Tool:
    """The ``Tool`` a function describes; a UserCodeError naming ``where`` if it cannot be one."""
    if not callable(fn):
        raise UserCodeError(f"{KEY}: {where} is not a function")
    overrides = getattr(fn, "__vlmrl_tool__", {})
    try:
        signature = inspect.signature(fn)
        hints = typing.get_type_hints(fn)
    except (TypeError, ValueError, NameError) as e:
        raise UserCodeError(f"{KEY}: cannot read the signature of {where}: {e}") from e
    description, arg_docs = _docstring_parts(fn.__doc__ or "")
    properties: dict[str, Any] = {}
    required = []
    takes_context = False
    for name, p in signature.parameters.items():
        if name == "context":
            takes_context = True
            continue
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.kind is p.POSITIONAL_ONLY:
            raise UserCodeError(f"{KEY}: {where}: parameter {name!r} is positional-only; tools get keyword arguments")
        prop = _json_type(hints.get(name, p.annotation))
        if name in arg_docs:
            prop["description"] = arg_docs[name]
        properties[name] = prop
        if p.default is p.empty:
            required.append(name)
    parameters = overrides.get("parameters") or {"type": "object", "properties": properties, "required": required}
    name = overrides.get("name") or fn.__name__
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.-]*", name):
        raise UserCodeError(f"{KEY}: {where}: tool name {name!r} is not a valid function name")
    return Tool(
        name=name,
        description=overrides.get("description") or description or name,
        parameters=parameters,
        fn=fn,
        takes_context=takes_context,
    )


def load_tools(specs: list[str]) -> list[Tool]:
    """The tools ``specs`` name, in order; their names must be unique."""
    tools = [dataclasses.replace(tool_from_function(load_object(spec, KEY), spec), spec=spec) for spec in specs]
    seen: dict[str, str] = {}
    for spec, t in zip(specs, tools):
        if t.name in seen:
            raise UserCodeError(f"{KEY}: {spec} and {seen[t.name]} are both named {t.name!r}; rename one (@tool(name=...))")
        seen[t.name] = spec
    return tools


def as_result(value: Any) -> ToolResult:
    """A tool's return value as a ``ToolResult``; TypeError if it is none of the accepted kinds."""
    if isinstance(value, ToolResult):
        return value
    if value is None:
        return ToolResult()
    if isinstance(value, str):
        return ToolResult(text=value)
    if _is_image(value):
        return ToolResult(images=[value])
    if isinstance(value, dict):
        unknown = set(value) - {"text", "images", "reward", "done"}
        if unknown:
            raise TypeError(f"a result dict may hold text, images, reward and done, not {sorted(unknown)}")
        return as_result(ToolResult(**value))
    if isinstance(value, (list, tuple)):
        text = [v for v in value if isinstance(v, str)]
        images = [v for v in value if _is_image(v)]
        if len(text) + len(images) != len(value):
            raise TypeError("a result list may hold only strings and PIL images")
        return ToolResult(text="\n".join(text), images=images)
    raise TypeError(f"a tool returned {type(value).__name__}; return text, PIL images, a dict or a ToolResult")


def _is_image(value: Any) -> bool:
    return type(value).__module__.startswith("PIL.") and hasattr(value, "size") and hasattr(value, "mode")


@dataclass
class CallOutcome:
    name: str
    arguments: Any
    status: ToolStatus
    result: ToolResult
    seconds: float = 0.0

    def record(self) -> dict[str, Any]:
        """What the reward function and the metrics see of the call."""
        return {"name": self.name, "arguments": self.arguments, "status": self.status.value, "seconds": self.seconds}


class ToolRunner:
    """Runs tool calls concurrently: in ``processes`` child processes when that is above 0 and every tool was
    loaded from a spec; else ``async def`` tools on the event loop and others in a thread pool.

    In processes, a call past the timeout has its process killed and replaced. In threads, a sync tool
    that hangs past the timeout is given up on (its call is an error observation) but its thread
    cannot be stopped; once all ``threads`` are held so, the next sync call raises ToolPoolExhausted.
    """

    def __init__(self, tools: list[Tool], timeout: float | None, threads: int = 32, processes: int = 0):
        self.tools = {t.name: t for t in tools}
        self.timeout = timeout
        self.threads = threads
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="vlmrl-tool")
        self._stuck = 0
        """Threads still running a call that timed out."""
        self._lock = threading.Lock()
        self.processes = None
        if processes > 0 and tools and all(t.spec for t in tools):
            from vlmrl.rollout.agents.pool import AgentProcesses

            self.processes = AgentProcesses(
                [t.spec for t in tools], KEY, processes, module="vlmrl.rollout.turns.tool_child", what="tool"
            )
            self.processes.start()

    async def call(self, name: str, arguments: Any, context: ToolContext) -> CallOutcome:
        tool_ = self.tools.get(name)
        if tool_ is None:
            known = ", ".join(sorted(self.tools)) or "none"
            return _failed(name, arguments, ToolStatus.unknown_tool, f"unknown tool {name!r}; the tools are: {known}")
        if not isinstance(arguments, dict):
            return _failed(name, arguments, ToolStatus.bad_arguments, "the arguments must be a JSON object")
        kwargs = dict(arguments)
        if tool_.takes_context:
            kwargs["context"] = context
        try:
            inspect.signature(tool_.fn).bind(**kwargs)
        except TypeError as e:
            return _failed(name, arguments, ToolStatus.bad_arguments, f"bad arguments for {name}: {e}")
        if self.processes is not None:
            return await self._call_in_process(tool_, arguments, context)
        start = time.perf_counter()
        thread_call = None
        try:
            if inspect.iscoroutinefunction(tool_.fn):
                work = tool_.fn(**kwargs)
            else:
                thread_call = self._submit(tool_, kwargs)
                work = asyncio.wrap_future(thread_call)
            value = await asyncio.wait_for(work, self.timeout)
            result = as_result(value)
        except asyncio.TimeoutError:
            if thread_call is not None and not thread_call.done():  # its thread runs on until the tool returns
                with self._lock:
                    self._stuck += 1
                thread_call.add_done_callback(lambda _: self._unstick())
            outcome = _failed(name, arguments, ToolStatus.timeout, f"{name} timed out after {self.timeout} s")
        except ToolPoolExhausted:
            raise
        except Exception as e:  # the tool's own failure: the model is told, the run goes on
            outcome = _failed(name, arguments, ToolStatus.error, f"{name} failed: {type(e).__name__}: {e}")
        else:
            outcome = CallOutcome(name, arguments, ToolStatus.ok, result)
        outcome.seconds = time.perf_counter() - start
        return outcome

    def _submit(self, tool_: Tool, kwargs: dict) -> Future:
        """The call on a pool thread; ToolPoolExhausted when every thread is held by a call that timed out."""
        with self._lock:
            stuck = self._stuck
        if stuck >= self.threads:
            raise ToolPoolExhausted(
                f"{KEY}: all {self.threads} tool threads are held by calls that ran past "
                f"multi_turn.tool_timeout={self.timeout} s and never returned, so no tool call can run; "
                f"the tools ({', '.join(sorted(self.tools))}) hang. Fix them, or run them in processes "
                "(multi_turn.tool_processes > 0), where a hung call's process is killed"
            )
        return self.pool.submit(lambda: tool_.fn(**kwargs))

    def _unstick(self) -> None:
        with self._lock:
            self._stuck -= 1

    async def _call_in_process(self, tool_: Tool, arguments: dict, context: ToolContext) -> CallOutcome:
        name = tool_.name
        fields = None
        if tool_.takes_context:
            fields = {f.name: getattr(context, f.name) for f in dataclasses.fields(context)}
        loop = asyncio.get_running_loop()
        kind, value, seconds = await loop.run_in_executor(
            self.pool, self.processes.call, (name, arguments, fields), self.timeout
        )
        if kind == "ok":
            if tool_.takes_context and isinstance(value.get("state"), dict):
                context.state.clear()
                context.state.update(value["state"])
            try:
                result = as_result({k: value[k] for k in ("text", "images", "reward", "done")})
            except TypeError as e:
                outcome = _failed(name, arguments, ToolStatus.error, f"{name} failed: {e}")
            else:
                outcome = CallOutcome(name, arguments, ToolStatus.ok, result)
        elif kind == "timeout":
            outcome = _failed(name, arguments, ToolStatus.timeout, f"{name} timed out after {self.timeout} s")
        else:  # raised, or its process died (the worker did not)
            outcome = _failed(name, arguments, ToolStatus.error, f"{name} failed: {value}")
        outcome.seconds = seconds
        return outcome

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        if self.processes is not None:
            self.processes.close()


def _failed(name: str, arguments: Any, status: ToolStatus, message: str) -> CallOutcome:
    return CallOutcome(name, arguments, status, ToolResult(text=f"Error: {message}"))

