"""The metrics catalog (vlmrl/metrics_catalog.py) cannot go stale: every key a real run logs, every key the code
spells, and every key made from a fixed set of names in the code matches an entry; every entry is unique and
explained.

* Logged: the keys of the shared end-to-end run's metrics.jsonl (tests/conftest.py::e2e_run, which the suite runs
  anyway), and of every metrics.jsonl a training loop wrote (one with timing_s/step) that the tests run before
  this one left under pytest's base temporary directory: in a full suite run, the agent, async, algorithm
  (GAE, ReMax, online filtering, KL in the reward) and fault runs too, at no extra launch.
* Spelled: string literals of vlmrl/**/*.py that look like a metric key (a first segment that some entry has:
  actor/, reward/, timing_s/, ...) match an entry; a literal that ends in "/" (a prefix the code tests keys
  against) and the constant start of an f-string (f"agent/stop/{reason}") begin some entry's key.
* Made from names: the keys of the policy, decoupled and value losses, the staleness counters, the agent
  rollout statuses, the trace and balance metrics, and the driver's timed phases, built by the code itself.
"""

from __future__ import annotations

import ast
import doctest
import json
from pathlib import Path

import pytest
import torch
from helpers.runs import read_metrics

from vlmrl import algos, metrics_catalog
from vlmrl.metrics_catalog import SECTIONS, find

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "vlmrl"

KEY_PREFIXES = frozenset(m.key.split("/", 1)[0] for _, _, metrics in SECTIONS for m in metrics)
"""The first segments of the declared keys: a literal starting with one of these and a "/" is a metric key."""

NOT_LOGGED = {
    "timing_s/resync_fetch": "RolloutServer.load_weights returns it; wait_for_loads drops it, so it is never logged",
    "timing_s/resync_drain": "RolloutServer.load_weights returns it; wait_for_loads drops it, so it is never logged",
    "timing_s/resync_engine": "RolloutServer.load_weights returns it; wait_for_loads drops it, so it is never logged",
    "val/samples": "a logger's validation-sample table or text (wandb, swanlab, tensorboard), not a scalar metric",
    "val/sample_images": "swanlab's validation-sample images, not a scalar metric",
    "val/sample_": "tensorboard's validation-sample image tags (val/sample_<i>), not a scalar metric",
}
"""Literals in vlmrl/ that look like metric keys and are not logged metrics, each with the reason."""


def _undeclared(keys) -> list[str]:
    return sorted(k for k in set(keys) if find(k) is None)


def _starts_an_entry(prefix: str) -> bool:
    return any(m.key.startswith(prefix) for m in metrics_catalog.METRICS)


# ------------------------------------------------------------------ the entries


def test_every_entry_is_unique_and_explained():
    keys = [m.key for m in metrics_catalog.METRICS]
    assert len(keys) == len(set(keys)), f"declared twice: {sorted({k for k in keys if keys.count(k) > 1})}"
    titles = [title for title, _, _ in SECTIONS]
    assert len(titles) == len(set(titles)), titles
    unexplained = [m.key for m in metrics_catalog.METRICS if not m.meaning.strip().endswith(".")]
    assert not unexplained, f"entries whose meaning is empty or does not end with a full stop: {unexplained}"
    assert all(intro.strip().endswith(".") for _, intro, _ in SECTIONS), [intro for _, intro, _ in SECTIONS]
    # A concrete key finds its own entry: no two entries claim one key.
    hidden = [m.key for m in metrics_catalog.METRICS if "{" not in m.key and find(m.key) is not m]
    assert not hidden, hidden


def test_find_matches_keys_and_patterns():
    assert find("actor/pg_clipfrac_higher").meaning.startswith("Share of response tokens")
    assert find("reward/accuracy").key == "reward/{score}"
    assert find("reward/overall").key == "reward/overall"
    assert find("val/reward/format").key == "val/reward/{score}"
    assert find("val/hiyouga/geometry3k@test/accuracy").key == "val/{source...}/{score}"
    assert find("agent/log_prob_diff/turn_3").key == "agent/log_prob_diff/turn_{turn}"
    assert find("reward/a/b") is None  # {score} does not span "/"
    assert find("actor/made_up") is None
    results = doctest.testmod(metrics_catalog)
    assert results.attempted > 0 and results.failed == 0, results


# ------------------------------------------------------------------ keys a run logs


def _training_loops_metrics(base: Path) -> dict[Path, list[dict]]:
    """The lines of each metrics.jsonl under ``base`` that a training loop wrote (one logs timing_s/step; the
    loggers' unit tests write made-up keys)."""
    found = {}
    for path in sorted(base.rglob("metrics.jsonl")):
        lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        if any("timing_s/step" in line for line in lines):
            found[path] = lines
    return found


def test_every_key_a_run_logs_is_declared(e2e_run, tmp_path_factory):
    logged = {k for line in read_metrics(e2e_run.output_dir, "e2e") for k in line if k != "step"}
    assert "actor/pg_loss" in logged and "val/reward/overall" in logged, sorted(logged)
    missing = {k: "e2e_run" for k in _undeclared(logged)}
    for path, lines in _training_loops_metrics(tmp_path_factory.getbasetemp()).items():
        for key in _undeclared(k for line in lines for k in line if k != "step"):
            missing.setdefault(key, str(path))
    assert not missing, (
        "keys logged by real runs that vlmrl/metrics_catalog.py does not declare (add an entry with its meaning):\n"
        + "\n".join(f"  {k}  (in {where})" for k, where in sorted(missing.items()))
    )


# ------------------------------------------------------------------ keys the code spells


def _sources() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if p.name != "metrics_catalog.py")


def _looks_like_key(text: str) -> bool:
    head, slash, rest = text.partition("/")
    return bool(slash) and head in KEY_PREFIXES and all(part.isidentifier() or part == "" for part in rest.split("/"))


def spelled_keys(tree: ast.AST) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """``(literal keys, constant prefixes)`` spelled in ``tree``, each with its line: whole string literals that
    look like metric keys, and the constant start of f-strings, of literals ending in "/" and of a ``prefix=``
    argument (the metric names a helper puts under it)."""
    keys, prefixes, used = [], [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            used.update(id(v) for v in ast.walk(node))
            first = node.values[0] if node.values else None
            if isinstance(first, ast.Constant) and isinstance(first.value, str) and _looks_like_key(first.value):
                prefixes.append((first.value, node.lineno))
        elif isinstance(node, ast.keyword) and node.arg == "prefix" and isinstance(node.value, ast.Constant):
            used.add(id(node.value))
            if isinstance(node.value.value, str) and node.value.value.split("/")[0] in KEY_PREFIXES:
                prefixes.append((node.value.value + "/", node.value.lineno))
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "_stats" and node.args:
            name = node.args[0]
            if isinstance(name, ast.Constant) and isinstance(name.value, str):  # driver/metrics.py's mean/max/min
                used.add(id(name))
                keys += [(f"{name.value}/{s}", node.lineno) for s in ("mean", "max", "min")]
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in used:
            if _looks_like_key(node.value):
                (prefixes if node.value.endswith("/") else keys).append((node.value, node.lineno))
    return keys, prefixes


def test_every_key_the_code_spells_is_declared():
    problems, seen = [], set()
    for path in _sources():
        keys, prefixes = spelled_keys(ast.parse(path.read_text(), str(path)))
        where = path.relative_to(REPO)
        for key, line in keys:
            seen.add(key)
            if key not in NOT_LOGGED and find(key) is None:
                problems.append(f"{where}:{line}: {key!r} matches no entry")
        for prefix, line in prefixes:
            seen.add(prefix)
            if prefix not in NOT_LOGGED and not _starts_an_entry(prefix):
                problems.append(f"{where}:{line}: no entry starts with {prefix!r}")
    assert not problems, "metric keys in vlmrl/ that vlmrl/metrics_catalog.py does not declare:\n" + "\n".join(problems)
    assert not set(NOT_LOGGED) - seen, f"allowlisted but no longer in the code: {sorted(set(NOT_LOGGED) - seen)}"
    assert {"actor/reference_kl", "perf/mfu", "agent/stop/", "critic/score/mean"} <= seen  # the scan sees keys


def test_the_scan_finds_keys_in_literals_fstrings_and_helpers():
    tree = ast.parse(
        'm = {"actor/pg_loss": 1, "not a/key": 2, "rollout/engine.py": 3}\n'
        'n = {f"agent/stop/{r}": 1, f"{name}/mean": 2}\n'
        'k.startswith("agent/rollouts/")\n'
        'f(x, prefix="val/reward")\n'
        '_stats("agent/turns", t)\n'
    )
    keys, prefixes = spelled_keys(tree)
    assert sorted(k for k, _ in keys) == ["actor/pg_loss", "agent/turns/max", "agent/turns/mean", "agent/turns/min"]
    assert sorted(p for p, _ in prefixes) == ["agent/rollouts/", "agent/stop/", "val/reward/"]


# ------------------------------------------------------------------ keys made from names in the code


def _loss_inputs():
    torch.manual_seed(0)
    old, new = torch.randn(3, 5), torch.randn(3, 5)
    return old, new, torch.randn(3, 5), torch.ones(3, 5)


@pytest.mark.parametrize("loss_type", list(algos.POLICY_LOSSES))
def test_policy_loss_metrics_are_declared(loss_type):
    old, new, advantages, mask = _loss_inputs()
    _, metrics = algos.POLICY_LOSSES[loss_type](old, new, advantages, mask, algos.PolicyLossParams())
    _, decoupled = algos.policy_loss_decoupled(
        old, old, new, advantages, mask, algos.PolicyLossParams(), algos.DecoupledParams(loss_type=loss_type)
    )
    assert _undeclared(f"actor/{k}" for k in {**metrics, **decoupled}) == []


def test_value_loss_metrics_are_declared():
    values, returns, old, mask = _loss_inputs()
    _, metrics = algos.value_loss_clipped(values, returns, old, mask, 0.5, algos.LossAvgMode.token_mean)
    assert _undeclared(f"critic/{k}" for k in metrics) == []


def test_named_counters_are_declared():
    from vlmrl.driver.staleness import StalenessManager
    from vlmrl.rollout.agents.runner import AgentStatus
    from vlmrl.rollout.agents.traces import Aggregated
    from vlmrl.train.partition import seqlen_balance_metrics

    keys = [f"async/{k}" for k in StalenessManager(2, 4, 1).stats()]
    keys += [f"agent/rollouts/{s.value}" for s in AgentStatus]
    keys += list(Aggregated().metrics())
    keys += list(seqlen_balance_metrics([3, 1, 2, 2], [[0, 1], [2, 3]], [[0, 1], [2, 3]]))
    assert _undeclared(keys) == []


def test_the_timed_phases_of_a_step_are_declared():
    """Each ``timer("<phase>", ...)`` of the training loop is logged as timing_s/<phase>."""
    tree = ast.parse((PACKAGE / "driver" / "loop.py").read_text())
    phases = {
        node.args[0].value
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "timer"
        and node.args and isinstance(node.args[0], ast.Constant)
    }  # fmt: skip
    assert {"step", "gen", "update_actor"} <= phases
    assert _undeclared(f"timing_s/{p}" for p in phases) == []
