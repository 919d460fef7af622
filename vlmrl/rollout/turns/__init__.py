"""The multi-turn loop and what serves it: tools, tool-call parsers, environments and observations.

``loop.AgentLoop`` plays the turns of every trajectory in lock-step on the engine, token in and token out.
``tools`` holds the typed tool functions and runs them (in ``tool_child`` processes when
``multi_turn.tool_processes`` asks), ``tool_parsers`` reads a turn's tool calls from its text, ``envs`` takes
what an environment class's ``reset`` and ``step`` return, and ``observations`` renders what answers a turn into
token ids and media.
"""
