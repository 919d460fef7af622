"""Tools, parsers and an environment for the multi-turn tests, loaded by path as a user's would be."""

from __future__ import annotations

import asyncio
import time

from PIL import Image

from vlmrl.rollout.turns.tool_parsers import ParsedTurn, ToolCall, parse_qwen
from vlmrl.rollout.turns.tools import ToolResult, tool

COLOURS = [(220, 30, 30), (30, 200, 40), (30, 60, 220), (240, 220, 20)]


def card(index: int, size: int = 56) -> Image.Image:
    """A distinct picture per index: two colours in a pattern, so that swapping two of them changes the pixels."""
    image = Image.new("RGB", (size, size), COLOURS[index % 4])
    inner = Image.new("RGB", (size // 2, size // 2), COLOURS[(index + 1 + index // 4) % 4])
    image.paste(inner, ((index * 7) % (size // 2), (index * 11) % (size // 2)))
    return image


def reveal(context) -> ToolResult:
    """Show the picture again, larger.

    Args:
        context: filled in by vlmrl.
    """
    context.state["calls"] = context.state.get("calls", 0) + 1
    return ToolResult(text=f"picture {context.turn}", images=[card(context.turn)], reward=0.25)


def calculator(expression: str, precision: int = 2) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: digits and + - * / ( ).
        precision: decimals of the result.
    """
    if not set(expression) <= set("0123456789+-*/(). "):
        raise ValueError(f"not arithmetic: {expression!r}")
    return f"{round(eval(expression), precision)}"  # noqa: S307 - the characters are checked above


def broken(x: int) -> str:
    """Always fails."""
    raise RuntimeError(f"broken tool got {x}")


async def slow(seconds: float = 0.1) -> str:
    """Waits, then answers."""
    await asyncio.sleep(seconds)
    return f"slept {seconds}"


def sleepy(seconds: float = 0.1) -> str:
    """Waits in a thread, then answers."""
    time.sleep(seconds)
    return f"slept {seconds}"


def hang() -> str:
    """Never answers in time."""
    time.sleep(30)
    return "late"


@tool(name="finish", description="Give the final answer.")
def submit(answer: str) -> ToolResult:
    return ToolResult(text="ok", reward=1.0, done=True)


def wrong_result() -> object:
    """Returns something that is not a result."""
    return 42


# ------------------------------------------------------------------ parsers: what the "model" calls


def call_reveal(text: str) -> ParsedTurn:
    """Every turn calls reveal, whatever the (random) model wrote."""
    return ParsedTurn(calls=[ToolCall("reveal", {})])


def call_everything(text: str) -> ParsedTurn:
    """Each kind of bad call at once, and one good one."""
    parsed = parse_qwen('<tool_call>{"name": "calculator", "arguments": {"expression": "2*(3+4)"}}</tool_call>'
                        '<tool_call>{"name": "nope", "arguments": {}}</tool_call>'
                        '<tool_call>{"name": "broken", "arguments": {"x": 1}}</tool_call>'
                        '<tool_call>{"name": "hang", "arguments": {}}</tool_call>'
                        '<tool_call>{"name": "calculator", "arguments": {"wrong": 1}}</tool_call>'
                        '<tool_call>{"name": "wrong_result", "arguments": {}}</tool_call>'
                        '<tool_call>{not json}</tool_call>')  # fmt: skip
    return parsed


def call_slow(text: str) -> ParsedTurn:
    return ParsedTurn(calls=[ToolCall("slow", {"seconds": 0.1})])


def call_sleepy(text: str) -> ParsedTurn:
    return ParsedTurn(calls=[ToolCall("sleepy", {"seconds": 0.1})])


# ------------------------------------------------------------------ an environment


class CountingEnv:
    """Shows a card at reset, then one per step; done after two steps, with reward 1 on the last."""

    def reset(self, sample):
        self.steps = 0
        self.answer = sample["ground_truth"]
        return [{"role": "user", "content": [{"type": "image", "image": card(9)}, {"type": "text", "text": "start"}]}]

    def step(self, action):
        self.steps += 1
        done = self.steps >= 2
        observation = [{"role": "user", "content": [{"type": "image", "image": card(self.steps)}, {"type": "text", "text": f"step {self.steps}"}]}]
        return observation, 1.0 if done else 0.0, done, {}


class BrokenEnv:
    def reset(self, sample):
        return "hello"

    def step(self, action):
        raise RuntimeError("the simulator crashed")
