"""The tokens of what answers a model turn: tool results or an environment's observation.

Token-in/token-out: the model's sampled ids are never decoded and encoded
again (that drift is what corrupted training in Agent-R1, its issue #30).
What follows a turn is rendered from the new messages alone and appended:

- the chat template's separator after a turn's end token (Qwen: the newline
  after ``<|im_end|>``), which the model does not sample;
- the new messages as the template renders them after a conversation, found
  as the difference between rendering ``[system, *new]`` and ``[system]``, so
  no second system prompt appears;
- the template's generation prompt, which opens the model's next turn.

A family whose replies stop at the token that opens the next turn (GLM-4.1V's
``<|user|>``: its template closes no turn) has that token left out where the
reply already ends with it (``Observation.opener``), so the template's single
``<|user|>`` is the reply's stop token.

Each piece comes in two forms: the ids vLLM gets (one placeholder per
image, which the engine expands) and the ids the actor gets (the processor's
expansion into patch tokens, with the pixel values and grids). For the Qwen
processors the expansion is done here on the engine's ids, each placeholder
repeated once per merged patch of its image's grid, as the processor does in
text; only the images go through the image processor. The full processor
call costs nearly four times as much (it parses kwargs for every modality and
tokenizes the text again), and a rollout renders an observation per
trajectory per turn.

Templates without tool support (Qwen2-VL and Qwen2.5-VL's, the tiny test
models') get the tools as a system message (``vlmrl.data.chat``) and tool
results as a user turn wrapped in ``<tool_response>``, which is what Qwen2.5's
text template renders for a tool message.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from vlmrl.rollout.engine import image_content_id

_SYSTEM = [{"role": "system", "content": "S"}]
_TEXT_CACHE = 4096
_PIXEL_CACHE = 1024
"""Image processor outputs kept, by the images' content ids: a tool's picture often comes back to every sample of
a group (the same row), or to every trajectory (a fixed card), and the image processor is most of an
observation's cost (0.33 of 0.40 s for 512 observations in a profile of ``benchmarks.agent``'s loop)."""


@dataclass
class Observation:
    raw_ids: list[int]
    """For the engine: one placeholder token per image."""
    ids: list[int]
    """For the actor: each image's placeholder expanded to its patch tokens."""
    mm_inputs: dict[str, torch.Tensor]
    """The processor's pixel values and grids of ``images`` (empty without images)."""
    images: list[Any]
    """The images, resized to the processor's grid, in order."""
    text: str
    image_ids: list[str] = field(default_factory=list)
    """The content id of each image (``image_content_id``), in order."""
    opener: int | None = None
    """The first token, when it opens the next turn and a reply may have stopped at it (GLM-4.1V's role token,
    ``Family.stop_opens_turn``): appended after a reply that ended with it, it is left out (the reply holds it
    already, where the template writes it once). None: every token is appended."""


class ConversationRenderer:
    def __init__(
        self,
        processor: Any,
        *,
        chat_template: str | None,
        tools: list[dict],
        template_has_tools: bool,
        resize: Callable[[Any], Any],
        model_input_keys: tuple[str, ...],
        stop_opens_turn: bool = False,
    ):
        self.processor = processor
        self.tokenizer = getattr(processor, "tokenizer", processor)
        self.chat_template = chat_template
        self.tools = tools
        self.template_has_tools = template_has_tools
        self.resize = resize
        self.model_input_keys = model_input_keys
        self.stop_opens_turn = stop_opens_turn
        """The family's ``stop_opens_turn``: what follows a turn names its first token as its ``opener``."""
        self.end_of_turn = self._end_of_turn_separator()
        self.base = self._render(_SYSTEM, add_generation_prompt=False)
        """What the template writes for ``_SYSTEM`` alone: the prefix every rendering of new messages starts with."""
        generation = self._render(_SYSTEM, add_generation_prompt=True)
        self.generation_prompt = generation[len(self.base) :]
        self._texts: dict[tuple[str, bool], tuple[str, tuple[int, ...]]] = {}
        self._pixels: dict[tuple[str, ...], dict[str, torch.Tensor]] = {}
        self.expansion = _PlaceholderExpansion.of(processor)
        """Expands the engine's image placeholders into patch tokens without the processor; None: the processor."""

    def _render(self, messages: list[dict], *, add_generation_prompt: bool) -> str:
        kwargs: dict[str, Any] = {}
        if self.tools and self.template_has_tools:
            kwargs["tools"] = self.tools
        return self.processor.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            chat_template=self.chat_template,
            **kwargs,
        )

    def _end_of_turn_separator(self) -> str:
        """What the template writes after an assistant turn's end-of-turn token (Qwen: "\\n")."""
        marker = "vlmrl-answer-marker"
        text = self._render(
            [*_SYSTEM, {"role": "user", "content": "U"}, {"role": "assistant", "content": marker}],
            add_generation_prompt=False,
        )
        tail = text[text.rindex(marker) + len(marker) :]
        eos = self.tokenizer.eos_token or ""
        return tail[len(eos) :] if eos and tail.startswith(eos) else ""

    # ------------------------------------------------------------------ messages

    def tool_messages(self, results: list[tuple[str, list[Any]]]) -> list[dict]:
        """The messages answering one turn's calls: (text, images) per call, in call order."""
        if self.template_has_tools:
            return [{"role": "tool", "content": _content(text, images)} for text, images in results]
        if not any(images for _, images in results):  # text templates render a string content only
            return [{"role": "user", "content": "\n".join(f"<tool_response>\n{text}\n</tool_response>" for text, _ in results)}]
        content: list[dict] = []
        for k, (text, images) in enumerate(results):
            content.append({"type": "text", "text": ("\n" if k else "") + "<tool_response>\n"})
            content += [{"type": "image"} for _ in images]
            content.append({"type": "text", "text": f"{text}\n</tool_response>"})
        return [{"role": "user", "content": content}]

    def render(self, messages: list[dict], images: list[Any], *, after_turn: bool = True) -> Observation:
        """``messages`` (images as ``{"type": "image"}`` items, ``images`` in the same order) as the tokens
        that follow a model turn (``after_turn``) or the prompt, up to and including the next generation prompt."""
        text, raw_ids = self._text(messages, after_turn)
        opener = raw_ids[0] if after_turn and self.stop_opens_turn and raw_ids else None
        images = [self.resize(image) for image in images]
        if not images:
            return Observation(raw_ids, list(raw_ids), {}, [], text, opener=opener)
        image_ids = [image_content_id(image) for image in images]
        if self.expansion is not None:
            out = self._processed(images, tuple(image_ids))
            ids = self.expansion.expand(raw_ids, out)
        else:
            out = self.processor(text=[text], images=images, do_resize=False, return_tensors="pt")
            ids = out["input_ids"][0].tolist()
        mm_inputs = {k: out[k] for k in self.model_input_keys if k in out and k != "input_ids"}
        return Observation(raw_ids, ids, mm_inputs, images, text, image_ids, opener)

    def _processed(self, images: list[Any], key: tuple[str, ...]) -> dict[str, torch.Tensor]:
        """The image processor's tensors for ``images``, kept by their content ids (``_PIXEL_CACHE``); each call
        gets tensors of its own, so no two observations share one."""
        hit = self._pixels.get(key)
        if hit is None:
            out = self.expansion.image_processor(images=images, do_resize=False, return_tensors="pt")
            hit = {k: v for k, v in out.items() if isinstance(v, torch.Tensor)}
            if len(self._pixels) >= _PIXEL_CACHE:
                self._pixels.clear()
            self._pixels[key] = hit
        return {k: v.clone() for k, v in hit.items()}

    def _text(self, messages: list[dict], after_turn: bool) -> tuple[str, list[int]]:
        """The text of ``messages`` after a turn or the prompt, and its ids for the engine.

        Kept for messages seen before (up to ``_TEXT_CACHE`` of them): tool results repeat (the same picture's
        caption, the same error), and the template and the tokenizer cost about a third of an observation.
        """
        try:
            key = (json.dumps(messages, sort_keys=True), after_turn)
        except (TypeError, ValueError):  # content the template may take but JSON cannot: render it every time
            key = None
        hit = self._texts.get(key) if key is not None else None
        if hit is not None:
            return hit[0], list(hit[1])
        full = self._render([*_SYSTEM, *messages], add_generation_prompt=True)
        if not full.startswith(self.base):
            raise ValueError("the chat template does not render a conversation as its prefix plus the new messages")
        text = (self.end_of_turn if after_turn else "") + full[len(self.base) :]
        raw_ids = self.tokenizer.encode(text, add_special_tokens=False)
        if key is not None:
            if len(self._texts) >= _TEXT_CACHE:
                self._texts.clear()
            self._texts[key] = (text, tuple(raw_ids))
        return text, raw_ids

    def conversation_text(self, messages: list[dict]) -> str:
        """The whole of ``messages`` as the template writes them after a prefix, with no generation prompt."""
        full = self._render([*_SYSTEM, *messages], add_generation_prompt=False)
        if not full.startswith(self.base):
            raise ValueError("the chat template does not render a conversation as its prefix plus the new messages")
        return full[len(self.base) :]


@dataclass(frozen=True)
class _PlaceholderExpansion:
    """The Qwen processors' image expansion, on token ids: each placeholder becomes ``t * h * w / merge**2`` of
    itself, ``(t, h, w)`` being its image's grid from the image processor."""

    image_processor: Any
    image_token_id: int
    merge_size: int

    @classmethod
    def of(cls, processor: Any) -> _PlaceholderExpansion | None:
        """The expansion of ``processor``, or None when it is not a Qwen-style one (a tokenizer, another family)."""
        image_processor = getattr(processor, "image_processor", None)
        token = getattr(processor, "image_token", None)
        merge = getattr(image_processor, "merge_size", None)
        tokenizer = getattr(processor, "tokenizer", None)
        if image_processor is None or not isinstance(token, str) or not isinstance(merge, int) or tokenizer is None:
            return None
        token_id = tokenizer.convert_tokens_to_ids(token)
        if not isinstance(token_id, int) or token_id == tokenizer.unk_token_id:
            return None
        return cls(image_processor, token_id, merge)

    def expand(self, raw_ids: list[int], out: dict[str, torch.Tensor]) -> list[int]:
        """The actor's ids for ``raw_ids``, given the image processor's output ``out`` for its images; the
        placeholders must match the images."""
        counts = (out["image_grid_thw"].prod(dim=-1) // self.merge_size**2).tolist()
        if raw_ids.count(self.image_token_id) != len(counts):
            raise ValueError(
                f"the rendered observation has {raw_ids.count(self.image_token_id)} image placeholder(s) for "
                f"{len(counts)} image(s)"
            )
        ids: list[int] = []
        images_left = iter(counts)
        for token in raw_ids:
            if token == self.image_token_id:
                ids += [token] * next(images_left)
            else:
                ids.append(token)
        return ids


def _content(text: str, images: list[Any]) -> str | list[dict]:
    """A tool message's content: plain text without images (text templates render a string), else items."""
    if not images:
        return text
    return [*({"type": "image"} for _ in images), {"type": "text", "text": text}]


def split_images(messages: list[dict]) -> tuple[list[dict], list[Any]]:
    """An environment's messages with their images (``{"type": "image", "image": PIL}``) taken out, in order."""
    out, images = [], []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            items = []
            for item in content:
                if isinstance(item, dict) and item.get("type") == "image":
                    if item.get("image") is not None:
                        images.append(item["image"])
                    items.append({"type": "image"})
                else:
                    items.append(item)
            message = {**message, "content": items}
        out.append(message)
    return out, images
