"""Generation: the rollout interface at this level, and one subpackage per part under it.

The rollout interface: ``kind`` says what every rollout kind is (``RolloutKind``, ``RolloutStats``, ``Credit``),
``workflow`` is the interface of a user's workflow class (``Workflow``, ``Context``, the engine awaited by many
samples), and ``episode`` is the record a multi-turn rollout builds its trajectory in. Nothing here imports the
workers or the driver: the workers and the workflows (``vlmrl.workflows``) compose these pieces.

``engine`` is the interface every rollout generates through (add, step, abort, stream, a blocking generate, weight
loads with versions and interrupt modes, sleep and wake); ``engine.vllm.VLLMEngine`` implements it on vLLM in the
calling process, ``engine.vllm_sampler`` holds what vlmrl puts on vLLM's sampler (banned vision tokens, seeds drawn
in blocks on CPU), and ``engine.sampling`` builds the engine requests of a step; it imports nothing else of the
rollout, and vLLM only inside ``engine.vllm``. ``turns`` is the multi-turn loop: ``turns.loop`` plays the turns of
every trajectory in lock-step on the engine, token in and token out, served by ``tools`` (typed Python functions,
in ``tool_child`` processes when asked), ``tool_parsers``, ``envs`` (environment classes) and ``observations``
(rendering what answers a turn into ids and media). ``endpoint`` serves an OpenAI-compatible API for external
agents on the worker's engine (``endpoint.server.AgentEndpoint``, with ``loop``, ``limits``, ``openai`` and
``render``), and ``agents`` runs the user's agent once per rollout (``runner``, its ``child`` processes and their
``pool``) and turns the recorded calls into trainable rows (``traces``).
"""
