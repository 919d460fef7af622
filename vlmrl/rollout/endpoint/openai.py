"""OpenAI's request and reply bodies for the agent endpoint: the sampling options checked, the choices written.

A request that would sample from another distribution than the policy's
(penalties, ``logit_bias``, guided decoding), or whose text would not be its
sampled tokens (``stop`` strings, which vLLM cuts from the text but not from
the ids), is refused with a message that says so: training on it would be
silently wrong. Unknown fields are ignored, as OpenAI-compatible servers do.

A reply's text is the tokenizer's decoding of the sampled ids (so the reply
and the recorded call agree); with tools in the request, the calls read from it
(``vlmrl.rollout.turns.tool_parsers``) become OpenAI ``tool_calls``.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vlmrl.rollout.engine import SampleOutput
from vlmrl.rollout.turns.tool_parsers import ParsedTurn


class EndpointError(Exception):
    """A refusal, answered with HTTP ``status`` and OpenAI's error shape (``body``)."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str,
        kind: str = "invalid_request_error",
        param: str | None = None,
        *,
        close: bool = False,
    ):
        """``close``: the connection is closed after the reply (a body left unread, a client too slow)."""
        super().__init__(message)
        self.status, self.message, self.code, self.kind, self.param = status, message, code, kind, param
        self.close = close

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class Options:
    n: int
    temperature: float | None
    """None: not given; the rollout's default applies (``AgentEndpoint.open_rollout``), else 1."""
    top_p: float
    top_k: int
    max_tokens: int | None
    """None: as many as fit (up to the endpoint's per-call budget)."""
    seed: int | None
    ignore_eos: bool
    log_probs: bool
    """Whether the response carries the sampled tokens' log-probs (they are always recorded)."""


def parse_options(body: dict, *, chat: bool) -> Options:
    """The options of a chat (``chat``) or completion request body; ``EndpointError`` 400 on a refused one."""
    _refuse_if(body.get("stream"), "stream", "streaming is not served; call without stream=true")
    _refuse_if(body.get("stop") not in (None, [], ""), "stop", "stop strings are not served: vLLM would cut the text "
               "but not the sampled tokens, so the trace would not be the reply; end on the model's end of turn "
               "instead")  # fmt: skip
    for name, neutral in (("presence_penalty", 0), ("frequency_penalty", 0), ("repetition_penalty", 1)):
        _refuse_if(body.get(name) not in (None, neutral), name, f"{name} is not served: the tokens would not be "
                   "sampled from the policy that is trained")  # fmt: skip
    _refuse_if(body.get("logit_bias") not in (None, {}), "logit_bias", "logit_bias is not served: the tokens would not "
               "be sampled from the policy that is trained")  # fmt: skip
    response_format = body.get("response_format")
    _refuse_if(response_format not in (None, {"type": "text"}), "response_format", "response_format (guided decoding) "
               "is not served: the tokens would not be sampled from the policy that is trained")  # fmt: skip
    _refuse_if(_number(body, "top_logprobs", 0, int) > 0, "top_logprobs", "top_logprobs are not served; logprobs=true "
               "gives the sampled tokens' log-probs")  # fmt: skip
    if chat:
        log_probs = body.get("logprobs")
        _refuse_if(log_probs not in (None, True, False), "logprobs", "logprobs must be true or false")
        log_probs = bool(log_probs)
    else:
        _refuse_if(body.get("echo"), "echo", "echo is not served")
        _refuse_if(body.get("suffix") not in (None, ""), "suffix", "suffix is not served")
        _refuse_if(body.get("best_of") not in (None, 1), "best_of", "best_of is not served; use n")
        log_probs = body.get("logprobs")
        _refuse_if(log_probs not in (None, 0), "logprobs", "logprobs must be 0 (the sampled tokens') or absent")
        log_probs = log_probs is not None
    max_tokens = body.get("max_completion_tokens") if chat else None
    if max_tokens is None:
        max_tokens = body.get("max_tokens")
    if max_tokens is not None:
        max_tokens = _number({"max_tokens": max_tokens}, "max_tokens", None, int)
        _refuse_if(max_tokens < 1, "max_tokens", "max_tokens must be at least 1")
    temperature = _number(body, "temperature", None, float)
    _refuse_if(temperature is not None and not 0 <= temperature <= 2, "temperature", "temperature must be between 0 and 2")
    top_p = _number(body, "top_p", 1.0, float)
    _refuse_if(not 0 < top_p <= 1, "top_p", "top_p must be in (0, 1]")
    top_k = _number(body, "top_k", -1, int)
    _refuse_if(top_k == 0 or top_k < -1, "top_k", "top_k must be -1 (off) or positive")
    n = _number(body, "n", 1, int)
    _refuse_if(n < 1, "n", "n must be at least 1")
    seed = body.get("seed")
    if seed is not None:
        seed = _number(body, "seed", None, int)
    ignore_eos = body.get("ignore_eos", False)
    _refuse_if(not isinstance(ignore_eos, bool), "ignore_eos", "ignore_eos must be true or false")
    return Options(
        n=n, temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_tokens, seed=seed,
        ignore_eos=ignore_eos, log_probs=log_probs,
    )  # fmt: skip


def _number(body: dict, name: str, default: Any, kind: type) -> Any:
    value = body.get(name)
    if value is None:
        return default
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int:
        ok = ok and float(value).is_integer()
    _refuse_if(not ok, name, f"{name} must be {'an integer' if kind is int else 'a number'}, not {value!r}")
    return kind(value)


def _refuse_if(condition: Any, param: str, message: str) -> None:
    if condition:
        raise EndpointError(400, message, "unsupported_parameter" if "not served" in message else "invalid_parameter",
                            param=param)  # fmt: skip


def reply_text(sample: SampleOutput, tokenizer: Any) -> str:
    """The reply's text: the tokenizer's decoding of the sampled ids, so that the reply and the trace agree
    (vLLM's own text leaves out a character that a length cut split; this writes it as U+FFFD)."""
    return tokenizer.decode(sample.token_ids, skip_special_tokens=True)


def chat_choice(
    index: int, sample: SampleOutput, tokenizer: Any, parse_tools: Callable[[str], ParsedTurn] | None, log_probs: bool
) -> dict:
    """One ``choices`` entry of a chat completion; tool calls read from the text when ``parse_tools`` is given."""
    text = reply_text(sample, tokenizer)
    message: dict[str, Any] = {"role": "assistant", "content": text}
    finish_reason = sample.finish_reason
    calls = parse_tools(text).calls if parse_tools is not None else []
    if calls:
        message["content"] = re.sub(r"<tool_call>.*?</tool_call>", "", text, flags=re.DOTALL).strip() or None
        message["tool_calls"] = [
            {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)}}
            for c in calls
        ]  # fmt: skip
        finish_reason = "tool_calls"
    return {
        "index": index,
        "message": message,
        "finish_reason": finish_reason,
        "logprobs": {"content": _token_log_probs(sample, tokenizer)} if log_probs else None,
    }


def completion_choice(index: int, sample: SampleOutput, tokenizer: Any, log_probs: bool) -> dict:
    """One ``choices`` entry of a (legacy) completion."""
    entries = _token_log_probs(sample, tokenizer) if log_probs else []
    return {
        "index": index,
        "text": reply_text(sample, tokenizer),
        "finish_reason": sample.finish_reason,
        "logprobs": {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries]}
        if log_probs
        else None,
    }


def _token_log_probs(sample: SampleOutput, tokenizer: Any) -> list[dict]:
    out = []
    for token_id, log_prob in zip(sample.token_ids, sample.log_probs or [], strict=True):
        token = tokenizer.decode([token_id])
        out.append({"token": token, "logprob": log_prob, "bytes": list(token.encode()), "top_logprobs": []})
    return out
