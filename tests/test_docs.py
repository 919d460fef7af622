"""The docs site builds strictly, its generated pages match the code, and its hand-written pages do not drift.

- ``scripts/gen_docs.py --check``: the configuration, metrics and CLI reference pages are what the code generates.
- ``mkdocs build --strict``: no broken link, anchor or page, and every page is in the navigation (``docs/notes/``
  aside).
- Hand-written tables that give a key's default (``| key | default | ...``) agree with the schema's default.
- The README stays short, and no page but the performance page carries dated measurement narrative.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import yaml
from helpers.runs import REPO

from vlmrl.config.help import _show, iter_options

DOCS = REPO / "docs"
MONTHS = "January|February|March|April|May|June|July|August|September|October|November|December"
DATED = re.compile(rf"\b\d{{1,2}} ({MONTHS})\b|\b({MONTHS}) \d{{1,2}}\b|\bcommit [0-9a-f]{{7,40}}\b|\bthis session\b")


def test_the_generated_reference_pages_match_the_code():
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "gen_docs.py"), "--check"], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr


def test_the_configuration_page_gives_each_keys_default_from_the_code():
    """Spot-check the generated page's row of a key whose default a hand-written table once got wrong."""
    page = (DOCS / "reference" / "configuration.md").read_text()
    defaults = {key: _show(default) for key, _, default, _ in iter_options()}
    section = page.split("## `worker.rollout.async_rl`", 1)[1].split("\n## ", 1)[0]
    row = next(line for line in section.splitlines() if line.startswith("| `worker.rollout.async_rl.max_head_offpolicyness` |"))
    assert row.split(" | ")[2] == f"`{defaults['worker.rollout.async_rl.max_head_offpolicyness']}`"


def test_the_site_builds_strictly(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=REPO,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "site" / "reference" / "configuration" / "index.html").is_file()


def _default_tables(text: str):
    """Rows ``(key, default)`` of every Markdown table whose header starts ``| key | default |``."""
    in_table = False
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
        if len(cells) >= 2 and cells[0].startswith("key") and cells[1] == "default":
            in_table = True
            continue
        if not cells:
            in_table = False
        elif in_table and not set(cells[0]) <= {"-", " "}:
            yield cells[0], cells[1]


def _same_value(written: str, default: str) -> bool:
    """A table's `300` is the code's 300.0, and its `error` the code's "error": compared as YAML values."""
    return yaml.safe_load(written) == yaml.safe_load(default)


def _hand_written_pages():
    return [p for p in DOCS.rglob("*.md") if "reference" not in p.parts or p.name == "algorithms.md"]


def test_hand_written_tables_give_each_keys_default_from_the_code():
    defaults = {key: _show(default) for key, _, default, _ in iter_options()}
    checked, wrong = 0, []
    for page in [*_hand_written_pages(), REPO / "README.md"]:
        for key_cell, default_cell in _default_tables(page.read_text()):
            keys = re.findall(r"`([\w.]+)`", key_cell)
            values = re.findall(r"`([^`]*)`", default_cell)
            if len(keys) != len(values):
                continue
            for key, value in zip(keys, values):
                if key in defaults:
                    checked += 1
                    if not _same_value(value, defaults[key]):
                        wrong.append(f"{page.relative_to(REPO)}: {key} = {value}, the code's default is {defaults[key]}")
    assert checked >= 10, "the tables of keys and defaults were not found"
    assert not wrong, "\n".join(wrong)


def test_the_readme_is_short_and_its_links_lead_somewhere():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    assert "bash scripts/install.sh && bash scripts/test.sh" in text
    links = [link for link in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text) if "://" not in link]
    assert "docs/index.md" in links
    missing = [link for link in links if not (REPO / link).exists()]
    assert not missing, f"README links to missing files: {missing}"


@pytest.mark.parametrize("page", ["README.md", *sorted(str(p.relative_to(REPO)) for p in DOCS.rglob("*.md"))])
def test_no_dated_narrative_outside_the_performance_page_and_the_notes(page):
    if page == "docs/performance.md" or page.startswith("docs/notes/"):
        pytest.skip("measurements carry their dates here")
    found = [m.group(0) for m in DATED.finditer((REPO / page).read_text())]
    assert not found, f"{page}: dated narrative {found}; move measurements to docs/performance.md"


def test_the_reliability_guide_lists_every_fault_test():
    # The fault suite's table is the one place a reader learns what each fault test injects; a new file under
    # tests/faults/ that it does not name is a fault nobody is told about.
    guide = (REPO / "docs/guides/reliability.md").read_text()
    missing = [p.name for p in sorted((REPO / "tests/faults").glob("test_*.py")) if f"`{p.name}`" not in guide]
    assert not missing, f"docs/guides/reliability.md's fault table does not name {missing}"
