"""External agents: the user's agent run once per rollout against the endpoint, and its calls turned into rows.

``runner.AgentRunner`` runs the agent for each rollout, in its own event loop (``async def`` agents) or in ``child``
processes held by ``pool.AgentProcesses`` (sync agents; the tool processes of ``turns`` reuse that pool), and
``traces`` turns the calls the endpoint recorded into trainable rows.
"""
