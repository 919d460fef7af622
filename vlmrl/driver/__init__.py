"""The driver: the Runner actor and the step loop that drives the workers.

``runner.Runner`` is the Ray actor that ``python -m vlmrl.main`` starts once the config has passed validation. It
reads the data, starts the workers (``vlmrl.workers``), the reward actors (``scoring``) and the loggers side by
side, and runs ``loop.TrainingLoop.fit``, whose body reads as the dataflow of a step: rollout (``sampler`` for
synchronous steps with DAPO's filtering and ReMax's baseline, ``async_sampler`` with ``staleness`` for bounded
staleness), rewards, log-prob passes, advantages (``advantage``), updates, resync, validation (``validation``) and
checkpoints (``checkpoint``, ``resume``, ``run_lock``).

The driver talks to the workers only through ``vlmrl.workers.group.WorkerGroup`` and to user reward code only
through the reward actors. It holds slim per-sample records (rewards, ids, lengths); the tokens and tensors stay in
the workers that sampled them. Around the loop: ``metrics``, ``perf`` (throughput and MFU), ``console`` (what the
terminal shows), ``stall`` and ``signal_check`` (runs that train nothing fail or warn), ``hooks`` (test-only
injection points, passed in, never read from the environment). Nothing imports the driver.
"""
