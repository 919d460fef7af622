"""The table of EasyR1's config keys (docs/getting-started/from-easyr1.md) covers EasyR1's whole schema, and says the truth about each key.

The key list is tests/fixtures/easyr1/schema_keys_b44b311.txt (EasyR1's
dataclass fields at b44b311, 'input' or 'auto'). Each key has one row in the
page's "Every EasyR1 key" section with a state: same, differs, refused or derived.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
from helpers.configs import CPU, QUICKSTART, problems_of
from helpers.runs import REPO

from vlmrl.config import Config
from vlmrl.config.schema import DERIVED_KEYS

STATES = {"same", "differs", "refused", "derived"}
ROW = re.compile(r"^\| `(?P<key>[\w.]+)` \| (?P<default>[^|]*) \| (?P<state>\w+) \| (?P<note>[^|]*) \|$")


def easyr1_keys() -> dict[str, str]:
    lines = (REPO / "tests" / "fixtures" / "easyr1" / "schema_keys_b44b311.txt").read_text().splitlines()
    return dict(line.split("\t") for line in lines if line and not line.startswith("#"))


def keys_table() -> dict[str, dict[str, str]]:
    text = (REPO / "docs" / "getting-started" / "from-easyr1.md").read_text()
    section = text.split("## Every EasyR1 key", 1)[1].split("\n## ", 1)[0]
    rows = [m.groupdict() for line in section.splitlines() if (m := ROW.match(line.strip()))]
    table = {r["key"]: r for r in rows}
    assert len(table) == len(rows), "a key has two rows"
    return table


def vlmrl_keys(cls=Config, prefix: str = "") -> set[str]:
    keys = set()
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            keys |= vlmrl_keys(type(default), f"{prefix}{f.name}.")
        else:
            keys.add(f"{prefix}{f.name}")
    return keys


def test_the_fixture_is_easyr1s_whole_schema():
    keys = easyr1_keys()
    assert len(keys) == 193
    assert sum(kind == "auto" for kind in keys.values()) == 17


def test_the_page_has_one_row_with_a_state_for_every_easyr1_key_and_no_other():
    keys, table = easyr1_keys(), keys_table()
    assert set(table) == set(keys), (sorted(set(keys) - set(table)), sorted(set(table) - set(keys)))
    for key, row in table.items():
        assert row["state"] in STATES, (key, row)
        if row["state"] in ("differs", "refused"):
            assert row["note"].strip(), f"{key}: say how it differs or why it is refused"


def test_every_input_key_is_in_vlmrls_schema_and_every_auto_key_is_derived():
    keys, table, ours = easyr1_keys(), keys_table(), vlmrl_keys()
    for key, kind in keys.items():
        if kind == "auto":
            assert key in DERIVED_KEYS and table[key]["state"] == "derived", key
        else:
            # val_override_config is a typed section here (its own keys), a dict in EasyR1.
            assert key in ours or any(k.startswith(key + ".") for k in ours), key
            assert table[key]["state"] != "derived", key


def test_the_table_says_refused_only_where_validation_refuses(tmp_path):
    table = keys_table()
    refused = {k for k, row in table.items() if row["state"] == "refused"}
    assert {
        "worker.hybrid_engine", "worker.reward.skip_special_tokens",
    } <= refused  # fmt: skip
    # Implemented: hybrid sharding, the critic's LoRA and Ulysses sequence parallelism.
    assert not {
        "worker.critic.model.lora.rank", "worker.actor.fsdp.fsdp_size", "worker.ref.fsdp.fsdp_size",
        "worker.actor.ulysses_size", "worker.critic.ulysses_size",
    } & refused  # fmt: skip
    # Each refusal the table names is one: a value that fails validation, with the key in the message.
    for override in (
        "worker.hybrid_engine=false",
        "worker.reward.skip_special_tokens=false",
    ):
        key = override.split("=")[0]
        assert [p for p in problems_of(QUICKSTART, override, cluster=CPU) if key in p], override


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch, quickstart_assets):
    monkeypatch.chdir(REPO)
