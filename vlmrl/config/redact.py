"""Secrets kept out of everything a run writes or prints: one rule, applied by ``to_dict`` and ``ConfigError``.

Two kinds of value are secret and shown as ``***``:

- **values from the environment**: any value produced by an ``${oc.env:NAME}``
  interpolation (``worker.reward.reward_function_kwargs.api_key:
  ${oc.env:OPENAI_API_KEY}``), wherever it is, under whatever key. Loading
  (``vlmrl.config.loading.parse``) records where they are on the config
  (``Secrets``, travelling with the config object) and remembers their text in
  this process, so an error message that quotes one is masked too.
- **keys that name a secret** in the free-form mappings the user fills
  (``reward_function_kwargs``, ``override_config``, ...): a key whose words
  (split at ``_``, ``-``, ``.`` and camelCase) include ``key``, ``apikey``,
  ``token``, ``secret``, ``password``, ``passwd``, ``credential(s)``,
  ``auth``, ``authorization``, ``bearer`` or ``cookie``, or whose lower-case
  name contains ``password``, ``passwd``, ``secret`` or ``apikey``. So
  ``api_key``, ``hf_token``, ``clientSecret`` and ``key`` are secret;
  ``max_tokens`` and ``tokenizer`` are not. The schema's own fields are not
  judged by name: none holds a secret, and ``data.prompt_key`` names a column.

- **every value of a mapping that holds secrets by its nature** (``SECRET_MAPPINGS``:
  ``worker.reward.env``, the environment the reward processes get), whatever
  its key and wherever it came from.

The rule errs towards masking: a masked value that was not secret costs a
line of log, a leaked key costs the key. Text that merely contains a value from
the environment is masked whole when that value is at least ``MIN_SECRET_TEXT``
characters long (shorter ones, like ``1`` or ``true``, would mask everything).
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from typing import Any

MASK = "***"
MIN_SECRET_TEXT = 6
SECRET_WORDS = frozenset(
    {
        "key", "apikey", "token", "secret", "password", "passwd", "credential", "credentials",
        "auth", "authorization", "bearer", "cookie",
    }
)
SECRET_PARTS = ("password", "passwd", "secret", "apikey")
SECRET_MAPPINGS = frozenset({("worker", "reward", "env")})
"""Config paths of mappings whose every value is masked."""

_ENV_NAME = re.compile(r"oc\.env\s*:\s*([A-Za-z_][A-Za-z0-9_]*)")
_WORD = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|[0-9]+")

_seen_values: set[str] = set()
"""The text of every value this process read from the environment into a config (``remember``)."""


@dataclasses.dataclass(frozen=True)
class Secrets:
    """Where a loaded config holds values from the environment, and their text."""

    paths: frozenset[tuple[Any, ...]] = frozenset()
    """Key paths (a list index as an int) of the values an ``oc.env`` interpolation produced."""
    values: frozenset[str] = frozenset()
    """The text of those values and of the environment variables they read."""

    def __reduce__(self):
        # A process that receives the config (the Runner, a worker) remembers its secrets as well, so the
        # messages it builds with ``mask_text`` are masked there too.
        return (_received, (self.paths, self.values))


def _received(paths: frozenset, values: frozenset) -> Secrets:
    remember(values)
    return Secrets(paths, values)


def secret_name(name: Any) -> bool:
    """Whether a mapping key names a secret (see the module docstring for the rule)."""
    if not isinstance(name, str):
        return False
    lowered = name.lower()
    if any(part in lowered for part in SECRET_PARTS):
        return True
    return any(word.lower() in SECRET_WORDS for word in _WORD.findall(name))


def find_env_values(unresolved: Any, resolved: Any, environ: typing.Mapping[str, str]) -> Secrets:
    """The ``oc.env`` values of a config: ``unresolved`` and ``resolved`` are the same tree before and after
    OmegaConf resolved its interpolations (``OmegaConf.to_container(..., resolve=False / True)``)."""
    paths, values = set(), set()

    def walk(raw: Any, value: Any, path: tuple) -> None:
        if isinstance(raw, dict) and isinstance(value, dict):
            for key in raw:
                if key in value:
                    walk(raw[key], value[key], (*path, key))
        elif isinstance(raw, list) and isinstance(value, list):
            for i, (r, v) in enumerate(zip(raw, value)):
                walk(r, v, (*path, i))
        elif isinstance(raw, str) and _ENV_NAME.search(raw):
            paths.add(path)
            values.update(_texts(value))
            values.update(environ[name] for name in _ENV_NAME.findall(raw) if environ.get(name))

    walk(unresolved, resolved, ())
    return Secrets(frozenset(paths), frozenset(v for v in values if v))


def _texts(value: Any) -> list[str]:
    if isinstance(value, dict):
        return [t for v in value.values() for t in _texts(v)]
    if isinstance(value, list):
        return [t for v in value for t in _texts(v)]
    return [] if value is None or isinstance(value, bool) else [str(value)]


def attach(config: Any, secrets: Secrets) -> None:
    """Record ``secrets`` on a loaded config (not a field: it travels with the object, pickles included)."""
    object.__setattr__(config, "_secrets", secrets)
    remember(secrets.values)


def secrets_of(config: Any) -> Secrets:
    return getattr(config, "_secrets", None) or Secrets()


def remember(values: typing.Iterable[str]) -> None:
    """Mask these values in every message this process builds with ``mask_text`` (``ConfigError``'s)."""
    _seen_values.update(v for v in values if v)


def mask_text(text: str, values: typing.Iterable[str] = ()) -> str:
    """``text`` with each remembered (and given) secret value of ``MIN_SECRET_TEXT`` characters or more as ``***``."""
    for value in sorted({*_seen_values, *values}, key=len, reverse=True):
        if len(value) >= MIN_SECRET_TEXT and value in text:
            text = text.replace(value, MASK)
    return text


def redact(tree: Any, schema: Any = None, secrets: Secrets | None = None) -> Any:
    """A copy of ``tree`` (plain data) with its secrets as ``***``.

    ``schema`` is the type ``tree`` was built from (a config dataclass): its fields are not judged by
    name. Without it every key is judged by name. ``secrets`` are the config's values from the environment.
    """
    secrets = secrets or Secrets()
    values = {*secrets.values, *_seen_values}

    def walk(node: Any, tp: Any, path: tuple) -> Any:
        if path in secrets.paths or (path[:-1] in SECRET_MAPPINGS and node not in (None, "")):
            return MASK
        if isinstance(node, dict):
            fields = _field_types(tp)
            out = {}
            for key, value in node.items():
                in_schema = fields is not None and key in fields
                if not in_schema and secret_name(key) and value not in (None, "", {}, []):
                    out[key] = MASK
                else:
                    out[key] = walk(value, fields[key] if in_schema else None, (*path, key))
            return out
        if isinstance(node, list):
            inner = _list_item_type(tp)
            return [walk(v, inner, (*path, i)) for i, v in enumerate(node)]
        if isinstance(node, str) and any(len(v) >= MIN_SECRET_TEXT and v in node for v in values):
            return MASK
        return node

    return walk(tree, schema, ())


def mask_values(tree: Any) -> Any:
    """A copy of ``tree`` (the plan's values, say) with each string that holds a remembered secret value as ``***``."""
    if isinstance(tree, dict):
        return {key: mask_values(value) for key, value in tree.items()}
    if isinstance(tree, list):
        return [mask_values(value) for value in tree]
    if isinstance(tree, str) and mask_text(tree) != tree:
        return MASK
    return tree


def _field_types(tp: Any) -> dict[str, Any] | None:
    """The field types of a dataclass type (Optional unwrapped), or None for anything else."""
    tp = _unwrap(tp)
    if tp is None or not dataclasses.is_dataclass(tp):
        return None
    return typing.get_type_hints(tp)


def _list_item_type(tp: Any) -> Any:
    tp = _unwrap(tp)
    args = typing.get_args(tp)
    return args[0] if typing.get_origin(tp) is list and args else None


def _unwrap(tp: Any) -> Any:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        return inner[0] if len(inner) == 1 else None
    return tp
