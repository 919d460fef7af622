"""The loggers behind ``trainer.logger``, one module each.

A logger module imports its package (mlflow, tensorboard, wandb, swanlab) only
when the logger is constructed, so naming none of them costs nothing at start-up.
The registry that maps ``trainer.logger`` names to these classes is in
``vlmrl.loggers.tracking``.
"""
