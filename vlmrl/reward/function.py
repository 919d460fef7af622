"""Loading a user's reward function from ``path/to/file.py:function`` or ``package.module:function``.

This module is imported by the reward processes too, so it imports nothing heavy.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vlmrl.config.options import RewardManagerType
from vlmrl.user_code import resolved_from
from vlmrl.config.redact import redact

KEY = "worker.reward.reward_function"


class RewardFunctionError(ValueError):
    """The reward function cannot be used, or a call of it failed; the message names it and the sample."""


class RewardTimeout(RewardFunctionError):
    """A call of the reward function ran past worker.reward.timeout."""


def load_reward_function(spec: str) -> tuple[Callable, RewardManagerType | None]:
    """The function named by ``spec`` and the REWARD_TYPE it declares (on itself or its module), if any.

    Every failure, an exception raised while the user's module is imported included,
    comes back as a RewardFunctionError that names ``spec``.
    """
    if ":" not in spec:
        raise RewardFunctionError(f"{KEY}={spec!r}: expected path/to/file.py:function or package.module:function")
    location, name = spec.rsplit(":", 1)
    if location.endswith(".py"):
        path = Path(location)
        if not path.is_file():
            raise RewardFunctionError(f"{KEY}: file {location} does not exist{resolved_from(location)}")
        # A stable name per file, so that pickling by reference finds the module again.
        module_name = "vlmrl_reward_" + hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]
        module_spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_name] = module
        try:
            module_spec.loader.exec_module(module)
        except BaseException as e:  # SystemExit from user code too: report it, do not exit
            del sys.modules[module_name]
            raise RewardFunctionError(f"{KEY}: {location} failed to load: {type(e).__name__}: {e}") from e
    else:
        try:
            module = importlib.import_module(location)
        except ModuleNotFoundError as e:
            raise RewardFunctionError(f"{KEY}: cannot import module {location} ({e})") from e
        except BaseException as e:
            raise RewardFunctionError(f"{KEY}: module {location} failed to load: {type(e).__name__}: {e}") from e
    fn = getattr(module, name, None)
    if not callable(fn):
        raise RewardFunctionError(f"{KEY}: {location} has no function {name!r}")
    declared = getattr(fn, "REWARD_TYPE", None) or getattr(module, "REWARD_TYPE", None)
    if declared is not None:
        try:
            declared = RewardManagerType(declared)
        except ValueError as e:
            raise RewardFunctionError(f"{spec}: REWARD_TYPE={declared!r} is not 'sequential' or 'batch'") from e
    return fn, declared


def check_kwargs(fn: Callable, spec: str, kwargs: dict[str, Any]) -> None:
    """Fail at start-up, not at the first step, when the kwargs do not fit the function."""
    try:
        inspect.signature(fn).bind(None, **kwargs)
    except TypeError as e:
        raise RewardFunctionError(
            f"worker.reward.reward_function_kwargs={redact(kwargs)} do not fit {spec}{inspect.signature(fn)}: {e}; "
            "fix the kwargs, or drop the YAML's with worker.reward.reward_function_kwargs=null on the command line"
        ) from e
