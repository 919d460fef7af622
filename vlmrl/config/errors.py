"""The one error a configuration raises, shared by loading (``vlmrl.config``) and the rules (``vlmrl.validate``)."""

from __future__ import annotations

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """Every problem found in a configuration, one per line, each with its fix."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__(
            f"{len(problems)} problem(s) in the configuration:\n"
            + "\n".join(f"  - {p}" for p in problems)
        )
