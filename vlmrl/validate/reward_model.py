"""A judge or score model: its path, its architecture against the kind, its placement against the devices, the
judge's template rendered on the training data's first row; and the reward function against it. Read from the
model's config.json and that one row only: no model loads."""

from __future__ import annotations

import json
import re
from pathlib import Path

from vlmrl.workflows import workflow_name
from vlmrl.config import Config, RewardModelKind, RewardModelPlacement
from vlmrl.plan import Cluster, device, world_size
from vlmrl.reward.judging import JudgeTemplateError, compile_template, render_question, template_text
from vlmrl.validate.first_row import FirstRow, first_row

P = "worker.reward.reward_model"

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_GENERATIVE = ("ForConditionalGeneration", "ForCausalLM", "ForImageTextToText")
_SAMPLE_RESPONSE = "red"
"""The policy's response in the reward input the template is rendered on at validation."""


def _sample_input(config: Config, first: FirstRow) -> dict:
    """The reward input of the training data's first row, as ``vlmrl.driver.scoring.reward_inputs`` makes it, with a
    sample response: the row's own columns (but the prompt, answer and media), then the keys every input has."""
    from vlmrl.data.dataset import answer_text

    data, row = config.data, first.row
    media = (data.prompt_key, data.answer_key, data.image_key, data.video_key)
    images = row.get(data.image_key)
    count = 1 if isinstance(images, (str, dict)) else len(images or [])
    question = str(row.get(data.prompt_key, ""))
    x = {
        **{k: v for k, v in row.items() if k not in media},
        "response": _SAMPLE_RESPONSE,
        "response_length": 1,
        "ground_truth": answer_text(row.get(data.answer_key, "")),
        "prompt": f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n",
        "data_source": str(row.get("data_source") or "unknown"),
        "images": [None] * count,
        "sample_id": 0,
    }
    rollout = config.worker.rollout
    if rollout.agent:
        x.update(rollout_id="0:0#0")
    if workflow_name(rollout) == "multi_turn":
        x.update(messages=[], num_turns=1, tool_calls=[], turn_rewards=[], stop_reason="done")
    return x


def reward_model_problems(config: Config, cluster: Cluster, pending: tuple[str, ...] = ()) -> list[str]:
    """``pending``: directories the run builds before it starts (``${tiny:...}`` assets), not to be read yet."""
    rm = config.worker.reward.reward_model
    if not rm.model_path:
        return []
    problems = [] if _under(rm.model_path, pending) else _architecture_problems(rm.model_path, rm.kind)
    for key, value, low in (("micro_batch_size", rm.micro_batch_size, 1), ("max_length", rm.max_length, 16),
                            ("max_new_tokens", rm.max_new_tokens, 1), ("num_cpus", rm.num_cpus, 1)):  # fmt: skip
        if value < low:
            problems.append(f"{P}.{key}={value}: must be at least {low}")
    if rm.timeout is not None and not rm.timeout > 0:
        problems.append(f"{P}.timeout={rm.timeout}: must be a positive number of seconds, or null for no limit")
    if rm.temperature < 0:
        problems.append(f"{P}.temperature={rm.temperature}: must be at least 0 (0 is greedy)")
    if not rm.max_score > 0:
        problems.append(f"{P}.max_score={rm.max_score}: must be positive")
    if rm.kind is RewardModelKind.judge:
        problems.extend(_template_problems(config, pending))
    elif rm.prompt_template:
        problems.append(f"{P}.prompt_template is set but {P}.kind=score: a score model reads the conversation; "
                        "unset the template or use kind=judge")  # fmt: skip
    problems.extend(_placement_problems(config, cluster))
    return problems


def _template_problems(config: Config, pending: tuple[str, ...]) -> list[str]:
    """The judge's template compiles and renders on the training data's first row (its own columns included).

    The data not built yet (``pending``) or not readable row by row (a hub dataset): the template is only
    compiled here, and rendered on the first batch.
    """
    rm, first = config.worker.reward.reward_model, None
    try:
        template = compile_template(template_text(rm.prompt_template))
        first = None if _under(config.data.train_files, pending) else first_row(config.data.train_files)
        if first is not None:
            render_question(template, _sample_input(config, first), f"the first training row ({first.where})")
    except JudgeTemplateError as e:
        data = config.data
        own = sorted(set(first.row) - {data.prompt_key, data.answer_key, data.image_key, data.video_key}) if first else []
        columns = f"; that row's columns: {', '.join(own)}" if own else ""
        return [
            f"{e} (a template may use question, response, ground_truth, prompt, num_images and the row's own "
            f"columns{columns})"
        ]
    return []


def _under(paths: str, pending: tuple[str, ...]) -> bool:
    """Whether any of the comma-separated ``paths`` lies under a directory that is not built yet."""
    return any(p.strip().startswith(root) for p in paths.split(",") for root in pending)


def _architecture_problems(model_path: str, kind: RewardModelKind) -> list[str]:
    config_file = Path(model_path) / "config.json"
    if not Path(model_path).is_dir():
        if _HUB_ID.fullmatch(model_path):
            return []  # a Hub id: its config is read where the model loads, as the actor's is
        return [f"{P}.model_path={model_path}: no such directory (a local model directory, or a Hub id org/name)"]
    try:
        architectures = json.loads(config_file.read_text()).get("architectures") or []
    except (OSError, ValueError) as e:
        return [f"{P}.model_path={model_path}: cannot read {config_file}: {e}"]
    names = ", ".join(architectures) or "none listed"
    if kind is RewardModelKind.judge and not any(a.endswith(_GENERATIVE) for a in architectures):
        return [
            f"{P}.model_path={model_path} is {names}, not a generative model, but {P}.kind=judge needs one "
            "(ForConditionalGeneration or ForCausalLM); use kind=score for a classifier"
        ]
    if kind is RewardModelKind.score and not any(a.endswith("ForSequenceClassification") for a in architectures):
        return [
            f"{P}.model_path={model_path} is {names}, but {P}.kind=score needs a ForSequenceClassification "
            "model with one label; use kind=judge for a generative model"
        ]
    return []


def _placement_problems(config: Config, cluster: Cluster) -> list[str]:
    rm = config.worker.reward.reward_model
    on_gpu = device(config, cluster) == "cuda"
    if rm.placement is RewardModelPlacement.colocated:
        return []  # it shares each worker's device, as the reference model does
    if not on_gpu:
        return []  # a CPU actor; the local cluster's logical CPUs are sized for it (vlmrl.main)
    if not 0 < rm.num_gpus:
        return [
            f"{P}.num_gpus={rm.num_gpus}: a separate reward model on GPU needs a positive share of a GPU; "
            f"or set {P}.placement=colocated"
        ]
    if config.trainer.nnodes == 1 and cluster.gpus and world_size(config) + rm.num_gpus > cluster.gpus:
        return [
            f"{P}.placement=separate needs {rm.num_gpus:g} GPU(s) beside the {world_size(config)} training "
            f"worker(s), but this machine has {cluster.gpus}; lower trainer.n_gpus_per_node, or set "
            f"{P}.placement=colocated"
        ]
    return []
