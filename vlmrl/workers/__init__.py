"""The Ray-side roles, and the driver's handle on them.

``trainer.TrainerWorker`` holds the FSDP2 actor, the reference policy and the critic, and the step's trajectories
(``store.TrajectoryStore``), and runs the passes of ``vlmrl.train`` over its share of the batch.
``rollout.RolloutWorker`` holds an engine (``vlmrl.rollout``) and turns prompts into trajectories, single-turn or
through the multi-turn loop; ``agents`` serves an external agent's endpoint on that engine and turns its calls into
rows. ``hybrid.HybridWorker`` composes a trainer and a rollout worker in one process with the in-process weight
sync between them, as EasyR1 and verl colocate them: that is the default worker. For asynchronous training with
separate servers, ``rollout_server`` and ``rollout_pool`` run engines apart from the trainers, and
``reward_model`` hosts a judge or a score model.

``group.WorkerGroup`` is how the driver calls them: each call is written out as a scatter of the batch, a
``.remote()`` per worker and a gather, with no decorator magic. Heavy imports (transformers, vLLM) happen inside
the worker processes, so the driver and the Runner start without them.
"""
