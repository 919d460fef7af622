"""Generation: the engine interface and vLLM behind it, the multi-turn loop, and the endpoint for external agents.

``engine.Engine`` is the interface every rollout uses (add, step, abort, stream, a blocking generate, weight
loads with versions and interrupt modes, sleep and wake); ``vllm_engine.VLLMEngine`` implements it on vLLM in the
calling process, and ``vllm_sampler`` holds what vlmrl puts on vLLM's sampler (banned vision tokens, seeds drawn in
blocks on CPU). ``sampling`` builds the engine requests of a step.

Multi-turn rollouts: ``agent_loop`` plays the turns of every trajectory in lock-step on the engine, token in and
token out; ``tools`` (typed Python functions), ``tool_parsers``, ``envs`` (environment classes) and
``observations`` (rendering what answers a turn into ids and media) serve it.

External agents: ``endpoint`` (with ``endpoint_loop``, ``endpoint_openai`` and ``endpoint_render``) serves an
OpenAI-compatible API on the worker's engine, ``agent_runner`` (with its child processes and pool) runs the user's
agent once per rollout, and ``traces`` turns the recorded calls into trainable rows. Nothing here imports the
workers or the driver: the workers compose these pieces.
"""
