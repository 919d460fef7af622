"""The model passes a trainer worker runs: log-probs, the policy and value updates, and what they need.

``actor`` computes log-probs (old, reference) and runs the policy update; ``critic`` the value pass and its
update; both updates share ``update_loop``, whose gradient accumulation is exact for every loss aggregation.
``micro_batches`` and ``partition`` cut a batch into micro-batches (fixed, trimmed of shared padding, or by a
token budget) and balance it over workers; ``packing`` lays rows out padding-free; ``image_features`` runs each
distinct image through the vision tower once and ``shared_prompts`` each distinct prompt once (an option).

``models`` loads the actor, reference and critic; ``fsdp_options`` applies FSDP2 and its memory options; ``lora``
adds and merges adapters; ``optimizers`` and ``lr_schedule`` hold the optimizer and its schedule; ``checkpoint``
and ``safe_checkpoint`` save and load sharded state without running pickled code. The losses and estimators
themselves are pure functions in ``vlmrl.algos``; these modules take the model as an argument and know nothing of
Ray or the engine.
"""
