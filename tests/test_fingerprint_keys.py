"""The resume fingerprint decides every key of the schema, and holds the keys that change what trains.

``vlmrl.driver.resume`` puts each key under ``FINGERPRINTED`` or under
``NOT_FINGERPRINTED``. A key added to the schema without a decision fails the
first test here, naming the key. The others check the keys that the
fingerprint used to miss: the asynchronous schedule, the decoupled loss, what a
timed-out reward becomes, the rollout kind (multi-turn, an external agent) and
whether data paths may leave ``data.image_dir``.
"""

from __future__ import annotations

import pytest

from vlmrl.config import Config
from vlmrl.config.help import iter_options
from vlmrl.driver.resume import FINGERPRINTED, NOT_FINGERPRINTED, decided_by, differences, fingerprint

SCHEMA_KEYS = [key for key, *_ in iter_options(Config)]


def test_every_key_of_the_schema_is_either_fingerprinted_or_explicitly_not():
    undecided = [key for key in SCHEMA_KEYS if decided_by(key) is None]
    assert not undecided, (
        "add each of these keys to FINGERPRINTED (it changes what a step trains) or NOT_FINGERPRINTED (speed, "
        f"memory, logging, how long the run goes on) in vlmrl/driver/resume.py: {undecided}"
    )


def test_every_entry_names_a_key_of_the_schema_and_is_decided_once():
    entries = FINGERPRINTED + NOT_FINGERPRINTED
    stale = [e for e in entries if not any(k == e or k.startswith(e + ".") for k in SCHEMA_KEYS)]
    assert not stale, f"entries that name no key of the schema: {stale}"
    both = set(FINGERPRINTED) & set(NOT_FINGERPRINTED)
    assert not both, f"entries on both lists: {both}"


def _with(config: Config, key: str, value: str) -> Config:
    """``config`` with ``key`` set to ``value`` as the YAML would give it (set on the dataclass: the files these
    keys name need not exist for the fingerprint)."""
    node = config
    *parents, leaf = key.split(".")
    for part in parents:
        node = getattr(node, part)
    kind = type(getattr(node, leaf))
    parsed = {"true": True, "false": False}.get(value, value)
    if kind in (int, float) and not isinstance(parsed, bool):
        parsed = kind(value)
    elif hasattr(kind, "__members__"):
        parsed = kind[value]
    setattr(node, leaf, parsed)
    return config


# Each pair changes what a step trains, and used to resume silently.
CHANGES_WHAT_TRAINS = [
    ("worker.rollout.async_rl.enable", "true"),
    ("worker.rollout.async_rl.max_head_offpolicyness", "2"),
    ("worker.rollout.async_rl.stale_policy", "accept"),
    ("worker.actor.use_decoupled_loss", "true"),
    ("worker.actor.behaviour_weight_cap", "2.0"),
    ("worker.actor.behaviour_weight_mode", "truncate"),
    ("worker.actor.proximal_log_probs", "loglinear"),
    ("worker.reward.on_timeout", "zero"),
    ("worker.reward.timeout", "7"),
    ("worker.rollout.agent", "my_agent.py:solve"),
    ("worker.rollout.agent_options.on_failure", "fail"),
    ("worker.rollout.multi_turn.enable", "true"),
    ("worker.rollout.multi_turn.max_turns", "9"),
    ("data.allow_paths_outside_image_dir", "true"),
]


@pytest.mark.parametrize(("key", "value"), CHANGES_WHAT_TRAINS, ids=[k for k, _ in CHANGES_WHAT_TRAINS])
def test_a_setting_that_changes_what_trains_is_a_difference(key, value):
    changed = fingerprint(_with(Config(), key, value))
    assert any(line.startswith(f"{key}:") for line in differences(fingerprint(Config()), changed)), key


# What users change when resuming; each leaves the fingerprint as it is.
CHANGES_ONLY_HOW = [
    ("worker.rollout.async_rl.weight_transfer", "object_store"),
    ("worker.reward.num_workers", "3"),
    ("worker.reward.memory_limit_mb", "1024"),
    ("worker.rollout.agent_options.max_concurrency", "2"),
    ("worker.rollout.agent_options.header_timeout", "5"),
    ("worker.rollout.agent_hooks.on_failed", "hooks.py:report"),
    ("worker.actor.fsdp.enable_cpu_offload", "true"),
    ("worker.actor.micro_batch_size_per_device_for_update", "1"),
    ("worker.rollout.cpu_kvcache_space_gb", "2"),
    ("worker.rollout.multi_turn.tool_processes", "0"),
    ("trainer.step_timeout_s", "60"),
    ("trainer.save_limit", "2"),
    ("trainer.max_steps", "200"),
]


@pytest.mark.parametrize(("key", "value"), CHANGES_ONLY_HOW, ids=[k for k, _ in CHANGES_ONLY_HOW])
def test_a_setting_that_changes_speed_guards_logging_or_length_is_not(key, value):
    assert differences(fingerprint(Config()), fingerprint(_with(Config(), key, value))) == []
