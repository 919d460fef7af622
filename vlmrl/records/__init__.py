"""The records that travel between the stages of a step: a dataset row, a trajectory, and a step's batch."""

from vlmrl.records.batch import Batch, PromptSample

__all__ = ["Batch", "PromptSample"]
