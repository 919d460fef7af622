"""The maths of training, one module per kind: advantages, losses, KL, groups, logits.

Import from ``vlmrl.trainer.core_algos``, which re-exports the public names.
"""
