"""The ``--help`` text: every option of the schema with its type, default and the attribute docstring under it."""

from __future__ import annotations

import ast
import dataclasses
import enum
import functools
import inspect
import itertools
import json
import textwrap
import types
import typing
from typing import Any

from vlmrl.config.schema import Config

__all__ = ["field_docs", "help_text", "iter_options"]

USAGE = """usage: python -m vlmrl.main config=<yaml> [key=value ...] [--dry-run | --help [KEY_PREFIX]]

  the CPU quickstart:  python -m vlmrl.main config=examples/quickstart.yaml
  the tests:           bash scripts/test.sh"""


def help_text(prefix: str = "") -> str:
    """Every option (or those under ``prefix``) as ``dotted.key  type = default`` and its one-line help."""
    options = [o for o in iter_options() if o[0].startswith(prefix)]
    if not options:
        sections = sorted({key.rsplit(".", 1)[0] for key, *_ in iter_options() if "." in key})
        close = [s for s in sections if prefix.lower() in s.lower()] or sections
        return f"no option is under {prefix!r}; sections: {', '.join(close)}"
    lines = [
        USAGE.splitlines()[0],
        "",
        "  config=<yaml>       a YAML with any of the keys below (EasyR1's layout); key=value overrides it",
        "  --dry-run           validate, print the resolved config and the resource plan, and exit",
        "  --help [KEY_PREFIX] this text, or only the options under KEY_PREFIX (for example --help worker.rollout)",
        "",
        f"Options under {prefix} (key  type = default):" if prefix else "Options (key  type = default):",
    ]
    for key, tp, default, doc in options:
        lines.append(f"  {key}  {_type_name(tp)} = {_show(default)}")
        lines.append(f"      {doc}")
    return "\n".join(lines)


def iter_options(cls: type = Config, prefix: str = "", instance: Any = None):
    """``(dotted key, type, default, help)`` for every leaf option of the schema, in file order."""
    instance = cls() if instance is None else instance
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        value = getattr(instance, f.name)
        if dataclasses.is_dataclass(hints[f.name]):
            yield from iter_options(hints[f.name], f"{prefix}{f.name}.", value)
        else:
            yield f"{prefix}{f.name}", hints[f.name], value, docs.get(f.name, "")


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The attribute docstrings of a dataclass (the string right under each field), read from its source."""
    (node,) = ast.parse(textwrap.dedent(inspect.getsource(cls))).body
    docs = {}
    body = node.body  # type: ignore[attr-defined]
    for stmt, nxt in itertools.pairwise(body):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[stmt.target.id] = " ".join(nxt.value.value.split())
    return docs


def _type_name(tp: Any) -> str:
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        (inner,) = [a for a in args if a is not type(None)]
        return f"{_type_name(inner)} or null"
    if typing.get_origin(tp) is list:
        return f"list of {_type_name(args[0])}"
    if typing.get_origin(tp) is dict:
        return "mapping"
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return "{" + ", ".join(m.value for m in tp) + "}"
    return getattr(tp, "__name__", str(tp))


def _show(value: Any) -> str:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, list):
        return "[" + ", ".join(_show(v) for v in value) + "]"
    return json.dumps(value)

