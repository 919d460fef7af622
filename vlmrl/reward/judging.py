"""What a reward model is asked and how its answer becomes a score: pure functions, no model.

A judge gets one user message per response: the images the policy saw, then the
question rendered from a jinja template (``worker.reward.reward_model.prompt_template``).
A score model gets the conversation itself: the user's turn and the policy's
response. A judge's text is turned into a number by ``parse_verdict``; a text
that does not parse gives None, and the caller applies ``on_invalid``.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import jinja2

from vlmrl.config.options import JudgeParse
from vlmrl.user_code import resolved_from

KEY = "worker.reward.reward_model"

DEFAULT_TEMPLATE = (
    "You are grading an answer to a question about the image{{ 's' if num_images != 1 else '' }} above.\n"
    "Question: {{ question }}\n"
    "{% if ground_truth %}Reference answer: {{ ground_truth }}\n{% endif %}"
    "Answer to grade: {{ response }}\n"
    "Is the answer correct? Reply with one word: yes or no."
)
"""The built-in judge question (parse=yes_no)."""

_SPECIAL = re.compile(r"<\|[^|>]*\|>")
_USER_TURN = re.compile(r"<\|im_start\|>user\n(.*?)(?:<\|im_end\|>|$)", re.S)
_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")


class JudgeTemplateError(ValueError):
    """The judge's prompt template cannot be read or rendered; the message names the key."""


def template_text(spec: str) -> str:
    """The template's source: the file ``spec`` names when it ends in .jinja (or exists), else ``spec`` itself."""
    if not spec:
        return DEFAULT_TEMPLATE
    if spec.endswith((".jinja", ".j2", ".txt")) or (len(spec) < 4096 and "\n" not in spec and Path(spec).is_file()):
        path = Path(spec)
        if not path.is_file():
            raise JudgeTemplateError(f"{KEY}.prompt_template={spec}: no such file{resolved_from(spec)}")
        return path.read_text()
    return spec


def compile_template(source: str) -> jinja2.Template:
    """A jinja template that fails on an unknown variable, so a misspelt name is an error, not an empty string."""
    try:
        return jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True).from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise JudgeTemplateError(f"{KEY}.prompt_template: line {e.lineno}: {e.message}") from e


def question_of(prompt_text: str) -> str:
    """The prompt's last user turn as plain text: chat markup and media placeholders removed.

    ``prompt`` in a reward input is the whole rendered chat prompt; a judge wants the question alone.
    A prompt with no Qwen-style user turn is returned without its special tokens.
    """
    turns = _USER_TURN.findall(prompt_text)
    text = turns[-1] if turns else prompt_text
    return _SPECIAL.sub("", text).strip()


def template_variables(reward_input: dict[str, Any]) -> dict[str, Any]:
    """What a judge template may use: the row's fields, then question, response, ground_truth, prompt, num_images."""
    images = reward_input.get("images") or []
    return {
        **{k: v for k, v in reward_input.items() if isinstance(k, str) and k.isidentifier()},
        "question": question_of(str(reward_input.get("prompt", ""))),
        "response": reward_input.get("response", ""),
        "ground_truth": reward_input.get("ground_truth", ""),
        "prompt": reward_input.get("prompt", ""),
        "num_images": len(images),
    }


def render_question(template: jinja2.Template, reward_input: dict[str, Any], where: str) -> str:
    try:
        return template.render(**template_variables(reward_input))
    except jinja2.TemplateError as e:
        raise JudgeTemplateError(f"{KEY}.prompt_template does not render for {where}: {type(e).__name__}: {e}") from e


def judge_conversation(template: jinja2.Template, reward_input: dict[str, Any], where: str) -> list[dict]:
    """One user message: the images the policy saw (the same PIL objects, not re-read), then the question."""
    images = reward_input.get("images") or []
    content = [{"type": "image", "image": image} for image in images]
    content.append({"type": "text", "text": render_question(template, reward_input, where)})
    return [{"role": "user", "content": content}]


def scored_conversation(reward_input: dict[str, Any]) -> list[dict]:
    """The conversation a score model rates: the prompt's user turn (images first) and the policy's response.

    A multi-turn trajectory brings its own messages; they are used as they are, with the last turn's response.
    """
    messages = reward_input.get("messages")
    if messages:
        return list(messages)
    images = reward_input.get("images") or []
    user = [{"type": "image", "image": image} for image in images]
    user.append({"type": "text", "text": question_of(str(reward_input.get("prompt", "")))})
    return [{"role": "user", "content": user}, {"role": "assistant", "content": str(reward_input.get("response", ""))}]


def parse_verdict(text: str, mode: JudgeParse, max_score: float) -> float | None:
    """The judge's score in [0, 1], or None when ``text`` does not hold one in the asked-for form.

    yes_no reads the first word only, so "yes, but..." is yes and "The answer is yes" is invalid: a
    judge that does not answer as asked is counted rather than guessed at.
    """
    mode = JudgeParse(mode)
    if mode is JudgeParse.yes_no:
        words = text.strip().split(maxsplit=1)
        first = words[0].strip(".,!:;\"'()*").lower() if words else ""
        return {"yes": 1.0, "no": 0.0}.get(first)
    match = _NUMBER.search(text)
    if match is None:
        return None
    value = float(match.group())
    if not (math.isfinite(value) and 0.0 <= value <= max_score):
        return None
    return value / max_score


def describe(reward_input: dict[str, Any], position: int) -> str:
    """How an error names a sample: its id in the step and its data source."""
    return (
        f"sample {reward_input.get('sample_id', position)} "
        f"(data source {reward_input.get('data_source', 'unknown')!r})"
    )
