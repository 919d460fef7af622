"""The agent endpoint: an OpenAI-compatible HTTP server on a rollout engine that records every call.

``server.AgentEndpoint`` serves the API and records each call against its rollout; ``loop.EngineLoop`` is the one
thread that drives the engine for it (and for the rollout servers), with pause and drain for weight syncs;
``openai`` checks a request's sampling options and writes the choices; ``render`` turns chat requests into token ids
and images; ``limits`` bounds calls, bodies, connections and slow clients. This ``__init__`` imports nothing,
so ``loop`` comes without the server's HTTP stack.
"""
