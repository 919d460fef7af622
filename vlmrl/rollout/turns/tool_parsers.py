"""Reading tool calls out of a model turn's text.

The default is Qwen's (Hermes-style) format, which Qwen2.5 and Qwen3 models
are trained on: each call is ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.
``worker.rollout.multi_turn.format`` picks a built-in parser, or names one by
path (``my_parser.py:parse``): a function of the turn's text that returns a
``ParsedTurn``.

A call that cannot be read (no JSON, no name) is not dropped silently: it is a
``ParsedTurn.errors`` entry, which the agent loop answers with an error
observation and counts as a parse error.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vlmrl.user_code import UserCodeError, load_object

KEY = "worker.rollout.multi_turn.format"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: Any


@dataclass
class ParsedTurn:
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    """One message per call that could not be read, for the model."""


_QWEN_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def parse_qwen(text: str) -> ParsedTurn:
    """Qwen's ``<tool_call>`` JSON blocks, in order.

    >>> parse_qwen('look <tool_call>{"name": "zoom", "arguments": {"x": 1}}</tool_call>').calls
    [ToolCall(name='zoom', arguments={'x': 1})]
    >>> parse_qwen('<tool_call>{"name": zoom}</tool_call>').errors[0][:28]
    'tool call 1 is not JSON: Exp'
    """
    parsed = ParsedTurn()
    blocks = _QWEN_CALL.findall(text)
    # An opened block the turn never closed is a broken call, not prose.
    if text.count("<tool_call>") > len(blocks):
        parsed.errors.append("a <tool_call> block is not closed with </tool_call>")
    for n, block in enumerate(blocks, 1):
        try:
            value = json.loads(block)
        except json.JSONDecodeError as e:
            parsed.errors.append(f"tool call {n} is not JSON: {e}")
            continue
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            parsed.errors.append(f'tool call {n} must be {{"name": ..., "arguments": {{...}}}}')
            continue
        arguments = value.get("arguments", {})
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        parsed.calls.append(ToolCall(value["name"], arguments))
    return parsed


PARSERS: dict[str, Callable[[str], ParsedTurn]] = {"qwen": parse_qwen, "hermes": parse_qwen}


def load_parser(name: str) -> Callable[[str], ParsedTurn]:
    """A built-in parser by name, or a user's by path."""
    if name in PARSERS:
        return PARSERS[name]
    if ":" not in name:
        raise UserCodeError(f"{KEY}={name!r}: not a built-in format ({', '.join(PARSERS)}) nor path/to/file.py:function")
    fn = load_object(name, KEY)
    if not callable(fn):
        raise UserCodeError(f"{KEY}: {name} is not a function")
    return fn
