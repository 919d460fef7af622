"""Loading a config: YAML and ``key=value`` overrides merged with OmegaConf, then checked against the schema.

Loading merges three layers: the dataclass defaults, then a YAML file, then
``key=value`` overrides from the command line. The merge is done on plain
dictionaries and then checked field by field against the schema, so that one
run reports every unknown key, wrong type and invalid enum value at once
(OmegaConf's structured merge stops at the first). Enum fields take the
enum's value as a string, so ``algorithm.adv_estimator=grpo`` in YAML or on
the CLI becomes ``AdvantageEstimator.grpo``.

A mapping given on the command line merges into the YAML's (``key={b: 1}``
adds ``b``), except ``key=null`` and ``key={}``, which replace it with an empty
mapping: that is how a YAML's ``worker.reward.reward_function_kwargs`` is
dropped for a reward function that takes other arguments.

Only the schema is checked here; the rules between values (batch sizes that
divide, paths that exist, a reward function that imports) are
``vlmrl.validate``'s. Interpolations resolve with whatever OmegaConf resolvers
the process registered (``${tiny:...}``: ``vlmrl.testing.resolvers``).
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import os
import types
import typing
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from vlmrl.config.errors import ConfigError
from vlmrl.config.redact import attach, find_env_values, redact, remember, secrets_of
from vlmrl.config.schema import DERIVED_KEYS, RENAMED_KEYS, Config

__all__ = ["parse", "parse_config", "to_dict"]


def parse_config(cli_args: list[str]) -> Config:
    """Build the config from ``config=<yaml>`` and ``key=value`` arguments, checking only the schema.

    Raises ConfigError listing every unknown key, wrong type and invalid option
    value at once. ``vlmrl.validate.load_config`` also checks the invariants.
    """
    config, problems = parse(cli_args)
    if problems:
        raise ConfigError(problems)
    return config


def parse(cli_args: list[str], base: dict | None = None) -> tuple[Config, list[str]]:
    """The config and every schema problem found, returned rather than raised so validation can add its own.

    ``base``: a config tree given as a mapping (``vlmrl.api.train(config={...})``), in place of a YAML file;
    the ``key=value`` arguments go over it. A missing YAML file or one that does not parse still raises
    ConfigError at once: there is no config to check further.
    """
    yaml_path = None
    overrides = []
    for arg in cli_args:
        if arg.startswith("config="):
            yaml_path = arg.split("=", 1)[1]
        else:
            overrides.append(arg)
    problems: list[str] = []
    for arg in overrides:
        if "=" not in arg:
            problems.append(
                f"command-line argument {arg!r}: expected key=value (for example trainer.max_steps=3)"
            )
    if yaml_path is not None and not Path(yaml_path).is_file():
        raise ConfigError([f"config={yaml_path}: no such file", *problems])
    try:
        merged = (
            OmegaConf.load(yaml_path) if yaml_path is not None else OmegaConf.create(base or {})
        )
        emptied = [a.split("=", 1)[0] for a in overrides if _empties_mapping(a)]
        merged = OmegaConf.merge(
            merged, OmegaConf.from_dotlist([a for a in overrides if "=" in a and not _empties_mapping(a)])
        )
        for key in emptied:  # replaced, not merged (OmegaConf merges an empty mapping into the old one)
            OmegaConf.update(merged, key, {}, merge=False, force_add=True)
        raw = OmegaConf.to_container(merged, resolve=True)
        secrets = find_env_values(OmegaConf.to_container(merged, resolve=False), raw, os.environ)
        remember(secrets.values)  # before any problem that quotes one is reported
    except ConfigError:
        raise
    except (yaml.YAMLError, OmegaConfBaseException, TypeError, ValueError) as e:
        if isinstance(e.__cause__, ConfigError):
            raise ConfigError(e.__cause__.problems + problems) from e
        where = (
            f"config={yaml_path} or the command line"
            if yaml_path
            else "the command line"
        )
        raise ConfigError(
            [f"{where}: {type(e).__name__}: {e}".strip(), *problems]
        ) from e
    config = _build(Config, raw or {}, "", problems)
    attach(config, secrets)
    return config, problems


EMPTY_MAPPING = ("null", "{}", "~")
"""Command-line values that empty a mapping option rather than merge into it."""


def _empties_mapping(arg: str) -> bool:
    """``key=null`` or ``key={}`` where ``key`` is a mapping option of the schema."""
    key, _, value = arg.partition("=")
    return value.strip() in EMPTY_MAPPING and typing.get_origin(_field_type(key)) is dict


def _field_type(dotted: str) -> Any:
    """The schema's type at a dotted key, or None when no field has that key."""
    tp: Any = Config
    for name in dotted.split("."):
        if not dataclasses.is_dataclass(tp):
            return None
        tp = typing.get_type_hints(tp).get(name)
        if tp is None:
            return None
    return tp


def _build(cls: type, raw: Any, prefix: str, problems: list[str]) -> Any:
    """Convert a plain dict into dataclass ``cls``, recording problems instead of raising."""
    if not isinstance(raw, dict):
        problems.append(
            f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {raw!r}"
        )
        return cls()
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in raw.items():
        if key not in names:
            problems.append(_unknown_key(f"{prefix}{key}", names, prefix))
            continue
        kwargs[key] = _convert(hints[key], value, f"{prefix}{key}", problems)
    return cls(**{k: v for k, v in kwargs.items() if v is not _INVALID})


def _unknown_key(dotted: str, names: list[str], prefix: str) -> str:
    if dotted in DERIVED_KEYS:
        return (
            f"{dotted}: derived, not set: vlmrl computes it from {DERIVED_KEYS[dotted]} "
            "(python -m vlmrl.main config=... --dry-run shows it); remove it"
        )
    if dotted in RENAMED_KEYS:
        return f"{dotted}: an older EasyR1 name; use {RENAMED_KEYS[dotted]}"
    close = difflib.get_close_matches(dotted.rsplit(".", 1)[-1], names, n=1)
    fix = (
        f"did you mean {prefix}{close[0]}?"
        if close
        else f"valid keys: {', '.join(names)}"
    )
    return f"{dotted}: unknown key; {fix}"


_INVALID = object()


def _convert(tp: Any, value: Any, key: str, problems: list[str]) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _convert(inner, value, key, problems)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, key + ".", problems)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(value)
        except ValueError:
            valid = [m.value for m in tp]
            close = difflib.get_close_matches(str(value), valid, n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            problems.append(
                f"{key}={value!r}: not a valid option; choose one of: {', '.join(valid)}{hint}"
            )
            return _INVALID
    if origin is list:
        if not isinstance(value, list):
            problems.append(f"{key}: expected a list, got {value!r}")
            return _INVALID
        converted = [
            _convert(args[0], v, f"{key}[{i}]", problems) for i, v in enumerate(value)
        ]
        return _INVALID if _INVALID in converted else converted
    if origin is dict:
        if value is None:  # `key: null` in YAML: no entries
            return {}
        if not isinstance(value, dict):
            problems.append(
                f"{key}: expected a mapping, got {value!r}; to drop the YAML's entries, "
                f"pass {key}=null (or {key}={{}}) on the command line"
            )
            return _INVALID
        return value
    if tp is Any:
        return value
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is bool and not isinstance(value, bool):
        problems.append(f"{key}={value!r}: expected true or false")
        return _INVALID
    if tp is int and (isinstance(value, bool) or not isinstance(value, int)):
        problems.append(f"{key}={value!r}: expected an integer")
        return _INVALID
    if tp is str and value is None:
        # `key=` on the command line and `key: null` in YAML both mean "empty".
        return ""
    if tp is str and not isinstance(value, str):
        # YAML reads `experiment_name: 1` as an int; a string field takes it as text.
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        problems.append(f"{key}={value!r}: expected a string")
        return _INVALID
    if tp is float and not isinstance(value, float):
        problems.append(f"{key}={value!r}: expected a number")
        return _INVALID
    return value


def to_dict(config: Config) -> dict[str, Any]:
    """The config as plain data (enums as their values), for logging and saving, with its secrets as ``***``.

    Every writer of the config (the ``--dry-run`` output, ``config.json`` beside the outputs and in each
    checkpoint, the loggers' parameters and ``config.yaml``) goes through here; ``vlmrl.config.redact``
    says what is masked. The workers are given the config object, which keeps the real values.
    """
    plain = OmegaConf.to_container(OmegaConf.structured(config), enum_to_str=True)
    return redact(plain, Config, secrets_of(config))
