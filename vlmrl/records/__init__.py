"""The records that travel between the stages of a step: a dataset row, a trajectory, and a step's batch.

Imports only torch: every other package may use these records.
"""

from vlmrl.records.batch import Batch
from vlmrl.records.prompt import PromptSample
from vlmrl.records.trajectory import Media, Trajectory

__all__ = ["Batch", "Media", "PromptSample", "Trajectory"]
