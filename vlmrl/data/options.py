"""Option values of the data section, kept free of heavy imports so the config can load them."""

from __future__ import annotations

import enum


class BadSamplePolicy(str, enum.Enum):
    """What a row that cannot be turned into a sample does to the run."""

    error = "error"
    """Stop with an error naming the file, the row and the key."""
    skip = "skip"
    """Leave the row out, count it and log it with its file and row."""
