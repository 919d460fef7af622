"""The one error a configuration raises, shared by loading (``vlmrl.config``) and the rules (``vlmrl.validate``)."""

from __future__ import annotations

from vlmrl.config.redact import mask_text

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """Every problem found in a configuration, one per line, each with its fix."""

    def __init__(self, problems: list[str]):
        # A problem that quotes a value read from the environment (an API key) shows it as ***.
        problems = [mask_text(p) for p in problems]
        self.problems = problems
        super().__init__(
            f"{len(problems)} problem(s) in the configuration:\n"
            + "\n".join(f"  - {p}" for p in problems)
        )
