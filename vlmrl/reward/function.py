"""Loading a user's reward function from ``path/to/file.py:function`` or ``package.module:function``."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path

from vlmrl.config import RewardManagerType


class RewardFunctionError(ValueError):
    pass


def load_reward_function(spec: str) -> tuple[Callable, RewardManagerType | None]:
    """The function named by ``spec`` and the REWARD_TYPE it declares (on itself or its module), if any."""
    if ":" not in spec:
        raise RewardFunctionError(
            f"worker.reward.reward_function={spec!r}: expected path/to/file.py:function or package.module:function"
        )
    location, name = spec.rsplit(":", 1)
    if location.endswith(".py"):
        path = Path(location)
        if not path.is_file():
            raise RewardFunctionError(f"worker.reward.reward_function: file {location} does not exist")
        module_name = f"vlmrl_reward_{abs(hash(str(path.resolve())))}"
        module_spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_name] = module  # so pickling by reference (multiprocessing) can find it
        try:
            module_spec.loader.exec_module(module)
        except Exception as e:
            raise RewardFunctionError(f"worker.reward.reward_function: {location} failed to load: {e!r}") from e
    else:
        try:
            module = importlib.import_module(location)
        except ImportError as e:
            raise RewardFunctionError(f"worker.reward.reward_function: cannot import module {location} ({e})") from e
    fn = getattr(module, name, None)
    if not callable(fn):
        raise RewardFunctionError(f"worker.reward.reward_function: {location} has no function {name!r}")
    declared = getattr(fn, "REWARD_TYPE", None) or getattr(module, "REWARD_TYPE", None)
    if declared is not None:
        try:
            declared = RewardManagerType(declared)
        except ValueError as e:
            raise RewardFunctionError(f"{spec}: REWARD_TYPE={declared!r} is not 'sequential' or 'batch'") from e
    return fn, declared
