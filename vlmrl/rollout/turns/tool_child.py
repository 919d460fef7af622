"""The process user tools run in (``worker.rollout.multi_turn.tool_processes``): a crash or a hang ends it, not the
rollout worker.

``python -m vlmrl.rollout.turns.tool_child READ_FD WRITE_FD``, started and replaced
by ``agents.pool.AgentProcesses`` (as sync agents are). It loads the
tools itself from their specs, so no function is pickled, and imports only
``vlmrl.rollout.turns.tools``'s light dependencies and the user's modules. The protocol:

* parent -> child, pickled (the child trusts its parent): ``{"sys_path", "spec": [tool specs], "key"}`` once,
  then ``(name, arguments, context fields or None)`` per call;
* child -> parent, as data (``vlmrl.user_process.send_data``): ``["ready"]`` or ``["failed", message]`` once,
  then ``["ok", {"text", "images", "reward", "done", "state"}]`` or ``["raised", "Type: message"]`` per call.

A call's ``context.state`` travels both ways, so it must hold data (dicts,
lists, strings, numbers, bytes, images); a tool's module-level variables live
per process, not per worker.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import sys
from multiprocessing.connection import Connection

from vlmrl.rollout.agents.child import exit_with_parent
from vlmrl.rollout.turns.tools import KEY, ToolContext, as_result, load_tools
from vlmrl.user_code import UserCodeError
from vlmrl.user_process import NotData, become_subreaper, send_data


def serve(read_fd: int, write_fd: int) -> None:
    inbox, outbox = Connection(read_fd, writable=False), Connection(write_fd, readable=False)
    become_subreaper()
    exit_with_parent()
    init = inbox.recv()
    sys.path[:] = init["sys_path"] + ([os.getcwd()] if os.getcwd() not in init["sys_path"] else [])
    try:
        tools = {t.name: t for t in load_tools(init["spec"])}
    except UserCodeError as e:
        send_data(outbox, ["failed", str(e)])
        return
    send_data(outbox, ["ready"])
    try:
        while True:
            name, arguments, context = inbox.recv()
            answer = _call(tools[name], arguments, context)
            try:
                send_data(outbox, answer)
            except NotData as e:  # found before anything was written
                send_data(outbox, ["raised", f"{KEY}: {name} returned (or left in context.state) something that "
                                             f"is not data: {e}"])
    except (EOFError, BrokenPipeError):  # the parent closed the pipes or is gone
        return


def _call(tool, arguments: dict, context: dict | None) -> list:
    kwargs = dict(arguments)
    ctx = ToolContext(**context) if context is not None else None
    if ctx is not None:
        kwargs["context"] = ctx
    try:
        value = tool.fn(**kwargs)
        if inspect.iscoroutine(value):
            value = asyncio.run(value)
        result = as_result(value)
    except BaseException as e:  # sys.exit() in a tool is a failed call too
        return ["raised", f"{type(e).__name__}: {e}"]
    answer = {"text": result.text, "images": list(result.images), "reward": result.reward, "done": bool(result.done),
              "state": ctx.state if ctx is not None else None}  # fmt: skip
    return ["ok", answer]


if __name__ == "__main__":
    serve(int(sys.argv[1]), int(sys.argv[2]))
