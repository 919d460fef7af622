"""The errors of the data pipeline."""

from __future__ import annotations


class DataError(ValueError):
    """A source or a row that cannot be used, named with where it came from and how to fix it."""


class BadRowError(DataError):
    """One row that cannot become a sample; ``data.on_bad_sample=skip`` leaves such rows out.

    ``where`` is "FILE row N", ``key`` the column at fault.
    """

    def __init__(self, where: str, key: str, problem: str):
        self.where, self.key, self.problem = where, key, problem
        super().__init__(f"{where}, key {key!r}: {problem}")
