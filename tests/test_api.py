"""``vlmrl.api`` is user code's one import path: every documented name imports from there, as its home's object.

The module docstring's list (``- ``name``: ...`` lines) is the documentation the reference page is written
from; ``__all__`` must be exactly that list, each name must be the object the module it lives in defines, and
the shipped examples must import vlmrl's names from ``vlmrl.api`` only.
"""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

import vlmrl.api as api

ROOT = Path(__file__).resolve().parents[1]


def _documented() -> list[str]:
    return re.findall(r"^- ``(\w+)``: ", api.__doc__, flags=re.MULTILINE)


def test_all_is_exactly_the_documented_list():
    assert _documented() == api.__all__
    assert len(set(api.__all__)) == len(api.__all__)


@pytest.mark.parametrize("name", _documented())
def test_each_documented_name_is_its_homes_object(name):
    value = getattr(api, name)
    home = importlib.import_module(value.__module__)  # where it is defined, not where it is re-exported from
    assert getattr(home, name) is value
    assert value.__module__.startswith("vlmrl.") and value.__module__ != "vlmrl.api"


def test_star_import_gives_every_name_and_an_unknown_name_says_what_there_is():
    namespace: dict = {}
    exec("from vlmrl.api import *", namespace)
    assert set(api.__all__) <= set(namespace)
    with pytest.raises(AttributeError, match="has no attribute 'Nope'; it holds tool, ToolContext"):
        api.Nope  # noqa: B018


def test_a_tools_or_parser_file_does_not_load_torch():
    # Names load when first asked for: a tools file pays for its own imports, not for the agent runner's torch.
    code = (
        "import sys\nfrom vlmrl.api import tool, ToolContext, ToolResult, ParsedTurn, ToolCall, parse_qwen, ToolStatus\n"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"


def test_the_shipped_examples_import_vlmrl_only_from_vlmrl_api():
    internal = re.compile(r"^\s*(?:from|import)\s+vlmrl(?!\.api\b)[\w.]*", re.MULTILINE)
    files = sorted((ROOT / "examples").rglob("*.py")) + sorted((ROOT / "reward_functions").rglob("*.py"))
    offenders = {str(f.relative_to(ROOT)): internal.findall(f.read_text()) for f in files}
    assert not {f: lines for f, lines in offenders.items() if lines}
    assert "from vlmrl.api import" in (ROOT / "examples" / "agent_tools.py").read_text()
