"""OpenAI chat requests as token ids: the engine's view and the actor's, with the images resized to the grid.

The agent endpoint (``vlmrl.rollout.endpoint``) gets conversations in the
OpenAI format; this module turns one into what an engine request needs and
what the trace records:

- the messages are converted to the processor's chat-template format
  (``image_url`` parts become ``{"type": "image"}`` items, their data URLs
  decoded to PIL images and resized to the processor's grid by the injected
  ``resize``, as the dataset resizes its images);
- the template renders the whole conversation with its generation prompt;
- the engine view is that text tokenized (one placeholder per image, which the
  engine expands); the actor view is the processor's output on the same text and
  images (each placeholder expanded to its patch tokens), as ``Trajectory``
  holds prompts.

Tools: a template that renders ``tools=`` gets them and the assistant messages'
``tool_calls`` as they are (arguments as objects); for one that does not (Qwen2-VL
and Qwen2.5-VL's, the tiny test model's) the tools go into the system message
written by the injected ``tools_message`` and the calls and results are written
as Qwen writes them, ``<tool_call>`` blocks in the assistant's text and
``<tool_response>`` blocks in a user turn, as the built-in agent loop does
(``vlmrl.rollout.turns.observations``).

Deliberate limits: only ``data:`` image URLs are taken (the endpoint fetches
nothing over the network), and no audio or file parts. Every refusal is a
``RenderError`` whose message says what to change; the endpoint answers it with
HTTP 400.

Budget (``RenderBudget``): a call's text is counted before the template and the
tokenizer run, and a call whose text is longer than the context could hold is
refused unread (every string of the messages and tools counts, image URLs
aside), and a prompt over the context's tokens is refused before the processor
expands its images into patches. Each image's size is read from its header before its pixels
are decoded: an image over ``max_image_pixels``, or one that takes the call
over ``max_call_pixels`` or ``max_images``, is refused (``OverBudget``, naming
the limit and its ``worker.rollout.agent_options`` key) before it is decoded,
and each image is resized as soon as it is decoded, so at most one image of
full size is held at a time.

Threads: ``chat`` and ``completion`` may run on several threads at once. The
images are decoded and resized concurrently; the template, the tokenizer and
the processor run under ``lock`` (a processor and a fast tokenizer are not
thread-safe), which every other user of ``tokenizer`` must hold too.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from PIL import Image

from vlmrl.models import Family

_DATA_URL = re.compile(r"data:image/[\w.+-]+;base64,(.*)", re.DOTALL)
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


CONFIG_KEY = "worker.rollout.agent_options"
"""Where the budget's limits are set; refusals name the key."""


class RenderError(ValueError):
    """A request the renderer cannot turn into tokens; the message is for the agent's author."""


class OverBudget(RenderError):
    """A request over one of the ``RenderBudget`` limits; ``code`` and ``param`` as the endpoint answers them."""

    def __init__(self, message: str, code: str, param: str = "messages"):
        super().__init__(message)
        self.code, self.param = code, param


@dataclass(frozen=True)
class RenderBudget:
    """What one call may carry, checked while it is rendered, before the costly work."""

    max_images: int = 16
    """Images in one call."""
    max_image_pixels: int = 16_777_216
    """Pixels of one image as its header declares them (width x height), checked before it is decoded."""
    max_call_pixels: int = 33_554_432
    """Pixels of all of one call's images together, as their headers declare them."""
    max_text_chars: int | None = None
    """Characters of a call's text (every string of its messages and tools but image URLs: contents, tool
    schemas, tool calls' arguments; a completion's prompt); None: not counted. The endpoint sets it to what its
    context could hold (``CHARS_PER_TOKEN`` per token), so a longer text is refused before it is tokenized."""
    max_prompt_tokens: int | None = None
    """Tokens of the prompt, images expanded to their patch tokens; None: not counted here. Checked before the
    processor expands the images (from their resized sizes, for processors with a ``patch_size`` and a
    ``merge_size``) and before a prompt given as ids is decoded, so a call over the context costs neither."""


@dataclass(frozen=True)
class RenderedPrompt:
    text: str
    """The chat template's output, generation prompt included."""
    engine_ids: list[int]
    """For the engine: one placeholder token per image."""
    actor_ids: list[int]
    """For the actor and the trace: each image's placeholder expanded to its patch tokens."""
    images: list[Image.Image]
    """The prompt's images, resized to the processor's grid, in placeholder order."""


class ChatRenderer:
    """Renders OpenAI chat messages and completion prompts with a model's processor and chat template."""

    def __init__(
        self,
        processor: Any,
        *,
        resize: Callable[[Image.Image], Image.Image],
        chat_template: str | None = None,
        template_has_tools: bool = False,
        tools_message: Callable[[list[dict]], str] | None = None,
        family: Family,
    ):
        """
        Args:
            processor: the model's processor (a tokenizer alone for a text model).
            resize: an image -> the image on the processor's grid (the dataset's ``resize_to_grid`` with the
                run's pixel bounds); the processor is then called with ``do_resize=False``, as the dataset does.
            chat_template: a template to use instead of the processor's own.
            template_has_tools: whether the template renders ``tools=`` (``vlmrl.data.chat.template_has_tools``).
            tools_message: tools -> the system message that shows them, for templates that do not render them
                (``vlmrl.data.chat.tools_system_message``); without it such a template refuses requests with tools.
            family: the model's family: the placeholder the template writes per image, and the tokens a
                completion prompt given as ids may not hold (it carries no images).
        """
        self.processor = processor
        self.tokenizer = getattr(processor, "tokenizer", processor)
        self.lock = threading.Lock()
        """Held around every use of the processor and the tokenizer (neither is thread-safe)."""
        self.resize = resize
        self.chat_template = chat_template
        self.template_has_tools = template_has_tools
        self.tools_message = tools_message
        vocab = self.tokenizer.get_vocab()
        self.image_token_id = vocab.get(family.image_token) if family.image_token is not None else None
        self.vision_token_ids = frozenset(vocab[t] for t in family.banned_tokens if t in vocab)

    # ------------------------------------------------------------------ prompts

    def chat(
        self, messages: list[dict], tools: list[dict] | None = None, budget: RenderBudget | None = None
    ) -> RenderedPrompt:
        """An OpenAI ``messages`` list (and ``tools``) as the prompt of the model's next assistant turn."""
        budget = budget or RenderBudget()
        _check_text(_text_chars([messages, tools]), budget, "messages")
        hf_messages, images = self.template_messages(messages, tools, budget)
        kwargs: dict[str, Any] = {}
        if tools and self.template_has_tools:
            kwargs["tools"] = tools
        with self.lock:
            try:
                text = self.processor.apply_chat_template(
                    hf_messages, tokenize=False, add_generation_prompt=True, chat_template=self.chat_template, **kwargs
                )
            except Exception as e:  # jinja's errors (a role or a content the template refuses) are the request's
                raise RenderError(f"the chat template cannot render these messages ({type(e).__name__}: {e})") from e
            engine_ids = self.tokenizer.encode(text, add_special_tokens=False)
            placeholders = engine_ids.count(self.image_token_id) if self.image_token_id is not None else 0
            if placeholders != len(images):
                raise RenderError(
                    f"the rendered prompt holds {placeholders} image placeholders for {len(images)} images; the text "
                    "must not contain the model's own vision tokens"
                )
            if not images:
                _check_tokens(len(engine_ids), budget, "messages")
                return RenderedPrompt(text, engine_ids, list(engine_ids), [])
            patch_tokens = self._patch_tokens(images)
            if patch_tokens is not None:
                _check_tokens(len(engine_ids) - len(images) + patch_tokens, budget, "messages")
            try:
                out = self.processor(text=[text], images=images, do_resize=False, return_tensors="pt")
            except Exception as e:
                raise RenderError(f"the processor rejected the images ({type(e).__name__}: {e})") from e
        return RenderedPrompt(text, engine_ids, out["input_ids"][0].tolist(), images)

    def completion(self, prompt: Any, budget: RenderBudget | None = None) -> RenderedPrompt:
        """A ``/v1/completions`` prompt: one string, or one list of token ids; no images."""
        budget = budget or RenderBudget()
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            _check_text(len(prompt), budget, "prompt")
            with self.lock:
                ids = self.tokenizer.encode(prompt, add_special_tokens=False)
            text = prompt
        elif (
            isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        ):
            ids = list(prompt)
            _check_tokens(len(ids), budget, "prompt")
            with self.lock:
                text = self.tokenizer.decode(ids)
        else:
            raise RenderError("prompt must be one string or one non-empty list of token ids (batches are not served)")
        if not ids:
            raise RenderError("the prompt is empty")
        vision = sorted(self.vision_token_ids.intersection(ids))
        if vision:
            raise RenderError(f"a completion prompt carries no images, but it holds vision tokens {vision}")
        return RenderedPrompt(text, ids, list(ids), [])

    # ------------------------------------------------------------------ messages

    def template_messages(
        self, messages: list[dict], tools: list[dict] | None, budget: RenderBudget | None = None
    ) -> tuple[list[dict], list[Image.Image]]:
        """``messages`` in the chat template's format, and their images decoded and resized, in order."""
        if not isinstance(messages, list) or not messages:
            raise RenderError("messages must be a non-empty list")
        out: list[dict] = []
        images = _Images(budget or RenderBudget(), self._resize)
        merging_tools = False  # the last message out is a user turn made of tool results
        for n, message in enumerate(messages):
            if not isinstance(message, dict) or message.get("role") not in _ROLES:
                raise RenderError(f"messages[{n}]: a message needs a role among {sorted(_ROLES)}")
            role = _ROLES[message["role"]]
            content = self._content(message.get("content"), images, n)
            if role != "tool":
                merging_tools = False
            if role == "assistant" and message.get("tool_calls"):
                calls = [_tool_call(c, n) for c in message["tool_calls"]]
                if self.template_has_tools:
                    out.append(
                        {
                            "role": role,
                            "content": content,
                            "tool_calls": [{"type": "function", "function": c} for c in calls],
                        }
                    )
                    continue
                blocks = "\n".join(f"<tool_call>\n{json.dumps(c, ensure_ascii=False)}\n</tool_call>" for c in calls)
                content = _append_text(content, blocks)
            if role == "tool" and not self.template_has_tools:
                # Qwen2.5's text template's form: <tool_response> blocks in one user turn per run of results.
                wrapped = _concat(_concat("<tool_response>\n", content), "\n</tool_response>")
                if merging_tools:
                    out[-1]["content"] = _concat(_concat(out[-1]["content"], "\n"), wrapped)
                else:
                    out.append({"role": "user", "content": wrapped})
                merging_tools = True
                continue
            out.append({"role": role, "content": content})
        if tools:
            if not isinstance(tools, list):
                raise RenderError("tools must be a list of tool schemas")
            if not self.template_has_tools:
                if self.tools_message is None:
                    raise RenderError("this model's chat template does not render tools; the endpoint was given no "
                                      "system message for them")  # fmt: skip
                system = self.tools_message(tools)
                if out[0]["role"] == "system":
                    out[0] = {"role": "system", "content": _prepend_text(system + "\n\n", out[0]["content"])}
                else:
                    out.insert(0, {"role": "system", "content": system})
        return out, images.images

    def _content(self, content: Any, images: _Images, n: int) -> str | list[dict]:
        """A message's content in the template's format: a string without images, items with them."""
        if content is None:
            return ""
        if isinstance(content, str):
            return content
        if not isinstance(content, list):
            raise RenderError(f"messages[{n}].content must be a string or a list of parts")
        items: list[dict] = []
        for k, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                items.append({"type": "text", "text": part["text"]})
            elif kind == "image_url":
                url = part.get("image_url")
                url = url.get("url") if isinstance(url, dict) else url
                images.add(url, f"messages[{n}].content[{k}]")
                items.append({"type": "image"})
            else:
                raise RenderError(f"messages[{n}].content[{k}]: only text and image_url parts are served, not {kind!r}")
        if not any(item["type"] == "image" for item in items):
            return "".join(item["text"] for item in items)  # text templates render a string content only
        return items

    def _patch_tokens(self, images: list[Image.Image]) -> int | None:
        """The tokens the processor will expand ``images`` (resized to its grid) to; None if it does not say."""
        processor = getattr(self.processor, "image_processor", None)
        patch, merge = getattr(processor, "patch_size", None), getattr(processor, "merge_size", None)
        if not isinstance(patch, int) or not isinstance(merge, int):
            return None
        return sum((image.height // patch) * (image.width // patch) // (merge * merge) for image in images)

    def _resize(self, image: Image.Image, n: int) -> Image.Image:
        try:
            return self.resize(image)
        except Exception as e:
            raise RenderError(f"image {n} cannot be used ({type(e).__name__}: {e})") from e


CHARS_PER_TOKEN = 32
"""Characters of text a token is taken to stand for at most when a call's text is counted before tokenizing:
far more than any tokenizer's average, so a text refused for its length could not have fit."""


def _text_chars(value: Any) -> int:
    """Characters of every string in ``value`` (JSON: dicts, lists, strings), keys included, but an
    ``image_url`` part's URL: what the template and the tokenizer would read. Iterative: depth costs no stack."""
    total, stack = 0, [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, dict):
            for key, child in item.items():
                if key == "image_url" and item.get("type") == "image_url":
                    continue
                total += len(key) if isinstance(key, str) else 0
                stack.append(child)
    return total


def _check_tokens(tokens: int, budget: RenderBudget, param: str) -> None:
    if budget.max_prompt_tokens is not None and tokens > budget.max_prompt_tokens:
        raise OverBudget(
            f"the prompt is {tokens} tokens (images expanded to their patch tokens), over the "
            f"{budget.max_prompt_tokens} the model's context leaves for it; shorten the conversation or send fewer or "
            "smaller images",
            "context_length_exceeded", param,
        )  # fmt: skip


def _check_text(chars: int, budget: RenderBudget, param: str) -> None:
    if budget.max_text_chars is not None and chars > budget.max_text_chars:
        raise OverBudget(
            f"the call's text is {chars} characters, more than the model's context could hold as tokens "
            f"({budget.max_text_chars} characters at most); shorten the conversation",
            "context_length_exceeded", param,
        )  # fmt: skip


class _Images:
    """A call's images, each checked against the budget from its header, then decoded and resized at once."""

    def __init__(self, budget: RenderBudget, resize: Callable[[Image.Image, int], Image.Image]):
        self.budget, self.resize = budget, resize
        self.images: list[Image.Image] = []
        self.pixels = 0

    def add(self, url: Any, where: str) -> None:
        budget = self.budget
        if len(self.images) >= budget.max_images:
            raise OverBudget(
                f"{where}: the call carries more than {budget.max_images} images, this endpoint's limit per call "
                f"({CONFIG_KEY}.max_images_per_call); send fewer images, or raise the limit",
                "too_many_images",
            )  # fmt: skip
        image = _open_image(url, where)
        width, height = image.size  # from the header: nothing is decoded yet
        pixels = width * height
        if pixels > budget.max_image_pixels:
            raise OverBudget(
                f"{where}: the image is {width}x{height} = {pixels} pixels, over this endpoint's limit of "
                f"{budget.max_image_pixels} per image ({CONFIG_KEY}.max_image_pixels); send it smaller",
                "image_too_large",
            )  # fmt: skip
        if self.pixels + pixels > budget.max_call_pixels:
            raise OverBudget(
                f"{where}: the call's images come to {self.pixels + pixels} pixels with this one, over this "
                f"endpoint's limit of {budget.max_call_pixels} per call ({CONFIG_KEY}.max_call_pixels); send fewer or "
                "smaller images",
                "too_many_pixels",
            )  # fmt: skip
        self.pixels += pixels
        try:
            image.load()
            if image.mode == "RGB":  # no copy: one image of full size is held at a time
                rgb = image
            else:
                rgb = image.convert("RGB")
                image.close()
        except (OSError, ValueError, Image.DecompressionBombError) as e:
            image.close()
            raise RenderError(f"{where}: the data URL is not a readable image ({type(e).__name__}: {e})") from e
        self.images.append(self.resize(rgb, len(self.images)))
        del rgb, image


def _open_image(url: Any, where: str) -> Image.Image:
    """The image of a data URL, opened (its header read) but not decoded."""
    if not isinstance(url, str):
        raise RenderError(f"{where}: image_url needs a url")
    match = _DATA_URL.fullmatch(url.strip())
    if match is None:
        raise RenderError(f"{where}: only data:image/...;base64 URLs are served (the endpoint fetches nothing)")
    try:
        return Image.open(io.BytesIO(base64.b64decode(match.group(1), validate=True)))
    except Image.DecompressionBombError as e:  # Pillow's own cap, read from the header as ours is
        raise OverBudget(
            f"{where}: the image is over this endpoint's limit per image ({CONFIG_KEY}.max_image_pixels) and "
            f"Pillow's ({e}); send it smaller", "image_too_large",
        ) from e  # fmt: skip
    except (binascii.Error, OSError, ValueError) as e:
        raise RenderError(f"{where}: the data URL is not a readable image ({type(e).__name__}: {e})") from e


def _tool_call(call: Any, n: int) -> dict:
    """An OpenAI tool call as ``{"name", "arguments"}`` with the arguments as an object where they parse."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise RenderError(f"messages[{n}].tool_calls: each call needs function.name")
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            pass  # kept as the model wrote it
    return {"name": function["name"], "arguments": arguments}


def _append_text(content: str | list[dict], text: str, sep: str = "\n") -> str | list[dict]:
    if isinstance(content, str):
        return f"{content}{sep}{text}" if content else text
    return [*content, {"type": "text", "text": sep + text}]


def _prepend_text(text: str, content: str | list[dict]) -> str | list[dict]:
    if isinstance(content, str):
        return text + content
    return [{"type": "text", "text": text}, *content]


def _concat(a: str | list[dict], b: str | list[dict]) -> str | list[dict]:
    if isinstance(a, str) and isinstance(b, str):
        return a + b
    as_items = lambda c: [{"type": "text", "text": c}] if isinstance(c, str) else c
    return [*as_items(a), *as_items(b)]
