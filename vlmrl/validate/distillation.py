"""``algorithm.distillation``: a teacher that is there, reads the same tokens as the student, and a run that can
give the teacher's signal the student's old log-probs before the advantages.

The tokenizers are compared from their files on disk (``tokenizer.json``, else
``vocab.json``): no model is loaded. Two tokenizers agree when every token has
the same id and, for BPE, the merges are the same; a teacher of another size
with the student's tokenizer passes.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from vlmrl.algos import DistillEstimator, DistillMode
from vlmrl.config import Config
from vlmrl.plan import ModelKindError, decoupled_loss, is_hub_id, model_kind
from vlmrl.workflows import is_builtin, properties, workflow_name

__all__ = ["distillation_problems", "tokenizer_difference"]

_KEY = "algorithm.distillation"


def distillation_problems(config: Config, pending: tuple[str, ...] = ()) -> list[str]:
    """``pending``: directories built before the run starts; a path under one is not read."""
    d = config.algorithm.distillation
    if not d.teacher_path:
        unused = [
            f"{_KEY}.{name}={value}"
            for name, value, default in (
                ("coef", d.coef, 1.0),
                ("mode", d.mode.value, DistillMode.add.value),
                ("estimator", d.estimator.value, DistillEstimator.reverse_kl.value),
            )
            if value != default
        ]
        if unused:
            return [
                f"{', '.join(unused)} with {_KEY}.teacher_path empty: no teacher runs, so these would do nothing; "
                f"set {_KEY}.teacher_path to the teacher's model directory"
            ]
        return []
    problems = []
    if not math.isfinite(d.coef) or d.coef < 0:
        problems.append(f"{_KEY}.coef={d.coef}: must be a finite number, 0 or more (0 turns the signal off)")
    problems.extend(_teacher_problems(config, pending))
    rollout = config.worker.rollout
    name = workflow_name(rollout)
    if not is_builtin(name) or properties(config).variable_rows:
        problems.append(
            f"{_KEY}.teacher_path with {'worker.rollout.agent' if rollout.agent else 'worker.rollout.workflow'}="
            f"{rollout.agent or rollout.workflow}: the rows of such rollouts get their advantages (and are trimmed "
            "to mini-batches by them) before the log-prob passes, so the teacher's signal cannot reach them; "
            "distil with single_turn or worker.rollout.multi_turn, or unset the teacher"
        )
    if decoupled_loss(config) and config.worker.actor.proximal_log_probs == "loglinear":
        problems.append(
            f"{_KEY}.teacher_path with worker.actor.proximal_log_probs=loglinear: the signal is the teacher's "
            "log-probs less the student's old ones, which loglinear never computes before the advantages; set "
            "worker.actor.proximal_log_probs=recompute"
        )
    return problems


def _under(path: str, pending: tuple[str, ...]) -> bool:
    return any(path.startswith(root) for root in pending)


def _teacher_problems(config: Config, pending: tuple[str, ...]) -> list[str]:
    """The teacher is a local directory of the student's kind with the student's tokenizer."""
    teacher = config.algorithm.distillation.teacher_path
    key = f"{_KEY}.teacher_path={teacher}"
    if _under(teacher, pending):
        return []
    if not Path(teacher).is_dir():
        hub = " (a Hub id: download it and give its directory)" if is_hub_id(teacher) else ""
        return [f"{key}: no such directory{hub}; the teacher must be a local HF model directory"]
    model = config.worker.actor.model
    student_key, student = (
        ("worker.actor.model.tokenizer_path", model.tokenizer_path)
        if model.tokenizer_path
        else ("worker.actor.model.model_path", model.model_path)
    )
    if not student or _under(student, pending) or not Path(student).is_dir():
        return []  # the student's own path is checked (or read from the Hub) elsewhere
    problems = []
    try:
        teacher_kind = model_kind(teacher)
        student_kind = model_kind(model.model_path) if Path(model.model_path).is_dir() else None
        if student_kind is not None and teacher_kind != student_kind:
            problems.append(
                f"{key} is a {teacher_kind.value} model but the student ({model.model_path}) is a "
                f"{student_kind.value} model: the teacher must read the same inputs (images included); give it a "
                f"{student_kind.value} teacher"
            )
    except ModelKindError as e:
        problems.append(f"{key}: {e}")
    difference = tokenizer_difference(student, teacher)
    if difference:
        problems.append(
            f"{key}: its tokenizer differs from the student's ({student_key}={student}): {difference}; the teacher "
            "scores the student's token ids, so it must share the student's tokenizer (it may differ in size)"
        )
    return problems


def _vocabulary(directory: Path) -> tuple[dict[str, int], list | None] | None:
    """``(token -> id, BPE merges or None)`` from a tokenizer's files, or None when it has neither file."""
    fast = directory / "tokenizer.json"
    if fast.is_file():
        data = json.loads(fast.read_text())
        model = data.get("model") or {}
        vocab = model.get("vocab") or {}
        if isinstance(vocab, list):  # Unigram: [piece, score] in id order
            vocab = {piece: i for i, (piece, _) in enumerate(vocab)}
        tokens = dict(vocab)
        tokens.update({t["content"]: t["id"] for t in data.get("added_tokens") or []})
        return tokens, model.get("merges")
    slow = directory / "vocab.json"
    if slow.is_file():
        tokens = json.loads(slow.read_text())
        added = directory / "added_tokens.json"
        if added.is_file():
            tokens.update(json.loads(added.read_text()))
        merges = directory / "merges.txt"
        return tokens, merges.read_text().splitlines() if merges.is_file() else None
    return None


def tokenizer_difference(student_dir: str | Path, teacher_dir: str | Path) -> str:
    """How the two directories' tokenizers differ, in a few words; empty when they agree."""
    student, teacher = _vocabulary(Path(student_dir)), _vocabulary(Path(teacher_dir))
    for which, path, found in (("student", student_dir, student), ("teacher", teacher_dir, teacher)):
        if found is None:
            return f"the {which}'s {path} has no tokenizer.json or vocab.json to compare"
    (s_tokens, s_merges), (t_tokens, t_merges) = student, teacher
    differing = sorted(t for t in s_tokens.keys() | t_tokens.keys() if s_tokens.get(t) != t_tokens.get(t))
    if differing:
        examples = ", ".join(f"{t!r}: {s_tokens.get(t)} vs {t_tokens.get(t)}" for t in differing[:3])
        return (
            f"{len(differing)} of {len(s_tokens.keys() | t_tokens.keys())} tokens have other ids (student vs "
            f"teacher, e.g. {examples})"
        )
    if s_merges != t_merges:
        return "the same tokens, but other BPE merges (the same text would split into other tokens)"
    return ""
