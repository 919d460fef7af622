"""The OpenAI-compatible agent endpoint on the real in-process vLLM (tiny model), over real HTTP.

- An agent written with the official ``openai`` client makes several chat calls in one rollout, one with an
  image as a data URL, one with tools, and a completion: each recorded call holds the prompt ids the actor
  would get for those messages (the chat template and the processor run here independently, each image's
  placeholder expanded to its patch tokens), response ids that decode to the returned text, and finite
  log-probs, one per token, equal to those the response returned. No response holds a vision token.
- Agents call at once, each under its own rollout; each rollout gets its own calls only.
- Security: the endpoint listens on 127.0.0.1 only; a missing or wrong token gets 401, an unknown or ended
  rollout 404 / 410 naming it, all in OpenAI's error shape (that a key serves its own rollout only is
  tests/test_agent_endpoint_bounds.py's); a call in flight when its rollout closes is aborted and not
  recorded; after ``close`` the port refuses connections.
- A call over the length budget (max_tokens over the per-call budget, or prompt + max_tokens over the
  context) gets 400 in that shape and is not recorded; so do options that would make the recorded tokens
  something else than the policy's samples (stream, stop strings, logit_bias) and images that are not data URLs.
- Tool calls in a reply come out as OpenAI ``tool_calls``; sent back with their results, they are rendered
  as Qwen writes them for a template without tools.
- Pause and drain: a call in flight when ``pause`` is asked finishes before ``drain`` returns, on the old
  version; a call made during the pause waits, and after the weights load and ``resume`` is served by the
  new version, which its response says.
"""

from __future__ import annotations

import base64
import io
import json
import math
import socket
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor

from vlmrl.data.chat import tools_system_message
from vlmrl.rollout.endpoint.openai import chat_choice
from vlmrl.rollout.endpoint.render import ChatRenderer
from vlmrl.rollout.endpoint.server import VERSION_HEADER, AgentEndpoint
from vlmrl.rollout.engine import SampleOutput
from vlmrl.models import family_at
from vlmrl.models.qwen_vision import SPECIAL_TOKENS as QWEN_MARKERS
from vlmrl.rollout.turns.tool_parsers import parse_qwen

from helpers import agent_endpoint  # noqa: E402
MAX_MODEL_LEN, MAX_TOKENS = 512, 256
ZOOM = {"type": "object", "properties": {"x": {"type": "integer"}}}
TOOLS = [{"type": "function", "function": {"name": "zoom", "description": "Zoom in.", "parameters": ZOOM}}]


@pytest.fixture(scope="module")
def processor(tiny_assets):
    return AutoProcessor.from_pretrained(tiny_assets.model_dir)


def _resize(processor):
    return agent_endpoint.resize(processor)


@pytest.fixture(scope="module")
def engine(tiny_assets, processor):
    with agent_endpoint.tiny_engine(tiny_assets.model_dir, processor, MAX_MODEL_LEN) as engine:
        yield engine


def _endpoint(engine, processor) -> AgentEndpoint:
    return agent_endpoint.new_endpoint(engine, processor, MAX_MODEL_LEN, MAX_TOKENS)


@pytest.fixture(scope="module")
def endpoint(engine, processor):
    with _endpoint(engine, processor).start() as endpoint:
        yield endpoint


def _client(endpoint, rollout_id: str) -> openai.OpenAI:
    # No retries: a refusal must reach the test as it was sent.
    return openai.OpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key(rollout_id), max_retries=0, timeout=120)


def _data_url(image: Image.Image) -> str:
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _image() -> Image.Image:
    g = torch.Generator().manual_seed(0)
    pixels = torch.randint(0, 256, (70, 90, 3), generator=g, dtype=torch.uint8).numpy()
    return Image.fromarray(pixels, "RGB")


def _actor_ids(processor, messages: list[dict], images: list[Image.Image]) -> list[int]:
    """What the actor gets for ``messages`` (template format): the dataset's way, rendered here on its own."""
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if not images:
        return processor.tokenizer.encode(text, add_special_tokens=False)
    images = [_resize(processor)(image) for image in images]
    return processor(text=[text], images=images, do_resize=False, return_tensors="pt")["input_ids"][0].tolist()


def _post(endpoint, path: str, body: dict, key: str | None) -> tuple[int, dict]:
    """A raw HTTP call (the status and the whole JSON body, as a client that is not the SDK sees them)."""
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(endpoint.base_url + path, json.dumps(body).encode(), headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _assert_error_shape(body: dict, code: str, *mentions: str) -> None:
    assert set(body) == {"error"}, body
    error = body["error"]
    assert {"message", "type", "code"} <= set(error), error
    assert error["code"] == code, error
    assert isinstance(error["message"], str) and all(m in error["message"] for m in mentions), error


# ---------------------------------------------------------------------------------------------------- calls


def test_an_openai_agent_is_recorded_as_the_actor_sees_its_calls(endpoint, processor):
    tokenizer = processor.tokenizer
    image = _image()
    endpoint.open_rollout("agent-0")
    client = _client(endpoint, "agent-0")

    # The agent: look at the image, answer, get told to try again, then use a tool; a completion last.
    system = {"role": "system", "content": "You answer with one colour."}
    look = {"role": "user", "content": [
        {"type": "text", "text": "Which colour is this? "},
        {"type": "image_url", "image_url": {"url": _data_url(image)}},
    ]}  # fmt: skip
    first = client.chat.completions.with_raw_response.create(
        model="policy", messages=[system, look], max_tokens=8, logprobs=True, seed=1
    )
    assert first.headers[VERSION_HEADER] == "0"
    first = first.parse()
    answer = first.choices[0].message.content
    again = [system, look, {"role": "assistant", "content": answer}, {"role": "user", "content": "Not quite. Again?"}]
    second = client.chat.completions.create(model="policy", messages=again, max_tokens=8, seed=2)
    third = client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": "Zoom in."}], tools=TOOLS, max_tokens=8, seed=3
    )
    fourth = client.completions.create(model="policy", prompt="The colour is", max_tokens=6, seed=4)
    calls = endpoint.close_rollout("agent-0")

    assert [c.index for c in calls] == [0, 1, 2, 3]
    assert all(c.rollout_id == "agent-0" and c.version == 0 for c in calls)
    assert [r.vlmrl_version for r in (first, second, third, fourth)] == [0, 0, 0, 0]
    # The prompts, in the actor's view, as the template and the processor make them for the same messages.
    template_look = {"role": "user", "content": [{"type": "text", "text": "Which colour is this? "}, {"type": "image"}]}
    expected = [
        _actor_ids(processor, [system, template_look], [image]),
        _actor_ids(
            processor,
            [
                system,
                template_look,
                {"role": "assistant", "content": answer},
                {"role": "user", "content": "Not quite. Again?"},
            ],
            [image],
        ),
        _actor_ids(
            processor,
            [{"role": "system", "content": tools_system_message(TOOLS)}, {"role": "user", "content": "Zoom in."}],
            [],
        ),
        tokenizer.encode("The colour is", add_special_tokens=False),
    ]
    for call, ids in zip(calls, expected, strict=True):
        assert list(call.prompt_ids) == ids, call.index
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    resized = _resize(processor)(image)
    patches = (resized.width // 14) * (resized.height // 14) // 4  # merge 2x2
    assert [list(c.prompt_ids).count(pad) for c in calls] == [patches, patches, 0, 0]  # expanded, not one placeholder
    assert [len(c.images) for c in calls] == [1, 1, 0, 0] and calls[0].images[0] == resized
    # The responses: ids that decode to the returned text, finite log-probs one per token.
    texts = [first.choices[0].message.content, second.choices[0].message.content, third.choices[0].message.content,
             fourth.choices[0].text]  # fmt: skip
    vision = {tokenizer.convert_tokens_to_ids(t) for t in QWEN_MARKERS} - {tokenizer.unk_token_id}
    for call, text in zip(calls, texts, strict=True):
        assert call.response_ids and tokenizer.decode(call.response_ids, skip_special_tokens=True) == text, call.index
        assert len(call.log_probs) == len(call.response_ids)
        assert all(math.isfinite(x) and x <= 0 for x in call.log_probs)
        assert not vision & set(call.response_ids), call.index  # the engine forbids them
        assert call.temperature == 1.0 and call.finish_reason in ("stop", "length")
    returned = [t.logprob for t in first.choices[0].logprobs.content]
    assert returned == pytest.approx(list(calls[0].log_probs), abs=1e-6)
    assert first.usage.prompt_tokens == len(calls[0].prompt_ids)


def test_agents_calling_at_once_each_get_their_own_calls(endpoint):
    ids = [f"many-{i}" for i in range(4)]
    for rollout_id in ids:
        endpoint.open_rollout(rollout_id)
    errors: list[BaseException] = []

    def agent(rollout_id: str) -> None:
        try:
            client = _client(endpoint, rollout_id)
            for turn in range(2):
                client.chat.completions.create(
                    model="policy", messages=[{"role": "user", "content": f"{rollout_id} turn {turn}"}], max_tokens=6
                )
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=agent, args=(i,)) for i in ids]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    for rollout_id in ids:
        calls = endpoint.close_rollout(rollout_id)
        assert [c.index for c in calls] == [0, 1] and all(c.rollout_id == rollout_id for c in calls)
        # Each call's prompt is its own agent's message.
        prompts = [endpoint.renderer.tokenizer.decode(c.prompt_ids) for c in calls]
        assert [f"{rollout_id} turn {turn}" in p for turn, p in enumerate(prompts)] == [True, True]


# ---------------------------------------------------------------------------------------------------- security


def test_only_loopback_listens(endpoint):
    assert endpoint.base_url.startswith("http://127.0.0.1:")
    # The kernel's table of listening TCP sockets: this port, bound to 127.0.0.1 only.
    listening = []
    with open("/proc/net/tcp") as table:
        lines = table.read().splitlines()[1:]
    for line in lines:
        local, state = line.split()[1], line.split()[3]
        address, port = local.split(":")
        if state == "0A" and int(port, 16) == endpoint.port:
            listening.append(address)
    assert listening == ["0100007F"], listening  # 127.0.0.1, little-endian hex


def test_a_missing_or_wrong_token_is_refused(endpoint):
    endpoint.open_rollout("guarded")
    body = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    status, reply = _post(endpoint, "/chat/completions", body, key=None)
    assert status == 401
    _assert_error_shape(reply, "missing_api_key")
    status, reply = _post(endpoint, "/chat/completions", body, key="not-the-token:guarded")
    assert status == 401
    _assert_error_shape(reply, "invalid_api_key")
    # The rollout's credential without its rollout id does not serve a call either; /v1/models needs the token too.
    status, reply = _post(endpoint, "/chat/completions", body, key=endpoint.api_key("guarded").split(":")[0])
    assert status == 401
    with pytest.raises(openai.AuthenticationError) as e:
        openai.OpenAI(base_url=endpoint.base_url, api_key="wrong:guarded", max_retries=0).models.list()
    assert e.value.status_code == 401
    assert [m.id for m in _client(endpoint, "guarded").models.list().data] == ["vlmrl"]
    assert endpoint.close_rollout("guarded") == []  # nothing was served


def test_unknown_and_ended_rollouts_are_refused_by_name(endpoint):
    body = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    credential = endpoint.open_rollout("probe").partition(":")[0]  # a valid token (and another rollout's secret)
    status, reply = _post(endpoint, "/chat/completions", body, key=f"{credential}:never-opened")
    assert status == 404
    _assert_error_shape(reply, "rollout_not_found", "never-opened")
    assert endpoint.close_rollout("probe") == []
    endpoint.open_rollout("short")
    status, _ = _post(endpoint, "/chat/completions", body, key=endpoint.api_key("short"))
    assert status == 200
    assert len(endpoint.close_rollout("short")) == 1
    status, reply = _post(endpoint, "/completions", {"prompt": "hi", "max_tokens": 4}, key=endpoint.api_key("short"))
    assert status == 410
    _assert_error_shape(reply, "rollout_ended", "short")
    with pytest.raises(ValueError, match="used once"):
        endpoint.open_rollout("short")


def test_rewards_reported_mid_rollout_reach_their_calls(endpoint):
    from vlmrl.api import AgentLLM

    body = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    key = endpoint.open_rollout("rewarded")
    status, reply = _post(endpoint, "/rewards", {"reward": 1.0}, key=key)
    assert status == 400  # nothing to reward before the first call
    _assert_error_shape(reply, "invalid_call", "rewarded")
    for _ in range(3):
        assert _post(endpoint, "/chat/completions", body, key=key)[0] == 200
    llm = AgentLLM(endpoint.base_url, key)
    llm.emit_reward(0.25, call=0)
    llm.emit_reward(0.5, call=0)  # rewards for one call add up
    llm.emit_reward(-1.0)  # the latest call by default
    for bad, code in [({"reward": "high"}, "invalid_reward"), ({"reward": float("nan")}, "invalid_reward"),
                      ({"reward": True}, "invalid_reward"), ({"reward": 1.0, "call": 7}, "invalid_call")]:  # fmt: skip
        status, reply = _post(endpoint, "/rewards", bad, key=key)
        assert status == 400, bad
        _assert_error_shape(reply, code)
    # Another rollout's key cannot reward this rollout's calls.
    other = endpoint.open_rollout("intruder").partition(":")[0]
    assert _post(endpoint, "/rewards", {"reward": 9.0}, key=f"{other}:rewarded")[0] == 403
    with pytest.raises(RuntimeError, match="invalid_reward"):
        llm.emit_reward(float("inf"))
    calls = endpoint.close_rollout("rewarded")
    assert [c.reward for c in calls] == [0.75, 0.0, -1.0]
    assert endpoint.close_rollout("intruder") == []
    assert _post(endpoint, "/rewards", {"reward": 1.0}, key=key)[0] == 410  # ended


def test_closing_a_rollout_aborts_its_call_in_flight(endpoint):
    endpoint.open_rollout("cut")
    status: list[int] = []
    body = {"messages": [{"role": "user", "content": "go on"}], "max_tokens": MAX_TOKENS, "ignore_eos": True}
    agent = threading.Thread(
        target=lambda: status.append(_post(endpoint, "/chat/completions", body, endpoint.api_key("cut")))
    )
    agent.start()
    _wait(lambda: endpoint.in_flight() == 1, "the call never reached the engine")
    assert endpoint.close_rollout("cut") == []  # the call had not finished: nothing recorded
    agent.join(60)
    code, reply = status[0]
    assert code == 410
    _assert_error_shape(reply, "rollout_ended", "cut")
    _wait(lambda: endpoint.in_flight() == 0, "the aborted call stayed in the engine")


def test_the_port_is_closed_after_close(engine, processor):
    endpoint = _endpoint(engine, processor).start()
    port = endpoint.port
    with socket.create_connection(("127.0.0.1", port), timeout=5):
        pass
    endpoint.close()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


# ---------------------------------------------------------------------------------------------------- budget


def test_a_call_over_the_length_budget_is_refused_not_cut(endpoint, processor):
    endpoint.open_rollout("long")
    key = endpoint.api_key("long")
    short = [{"role": "user", "content": "hi"}]
    status, reply = _post(endpoint, "/chat/completions", {"messages": short, "max_tokens": MAX_TOKENS + 1}, key)
    assert status == 400
    _assert_error_shape(reply, "max_tokens_exceeded", str(MAX_TOKENS + 1), str(MAX_TOKENS))
    # A prompt that fits alone, but not with its max_tokens: refused, with both numbers.
    words = " ".join(["colour"] * 400)
    prompt_length = len(_actor_ids(processor, [{"role": "user", "content": words}], []))
    assert prompt_length < MAX_MODEL_LEN < prompt_length + MAX_TOKENS
    body = {"messages": [{"role": "user", "content": words}], "max_tokens": MAX_TOKENS}
    status, reply = _post(endpoint, "/chat/completions", body, key)
    assert status == 400
    _assert_error_shape(reply, "context_length_exceeded", str(prompt_length), str(MAX_MODEL_LEN))
    with pytest.raises(openai.BadRequestError) as e:
        _client(endpoint, "long").chat.completions.create(
            model="policy", messages=body["messages"], max_tokens=MAX_TOKENS
        )
    assert e.value.status_code == 400
    assert endpoint.close_rollout("long") == []


def test_what_would_train_on_other_tokens_is_refused(endpoint):
    endpoint.open_rollout("odd")
    key = endpoint.api_key("odd")
    hi = [{"role": "user", "content": "hi"}]
    refused = [
        ({"messages": hi, "stream": True}, "unsupported_parameter", "stream"),
        ({"messages": hi, "stop": ["\n"]}, "unsupported_parameter", "stop"),
        ({"messages": hi, "logit_bias": {"5": 3}}, "unsupported_parameter", "logit_bias"),
        ({"messages": hi, "temperature": "hot"}, "invalid_parameter", "temperature"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/a.png"}}]}]},
         "invalid_prompt", "data:image"),
        ({"messages": [{"role": "user", "content": "<|vision_start|><|image_pad|><|vision_end|>"}]}, "invalid_prompt",
         "vision tokens"),
    ]  # fmt: skip
    for body, code, mention in refused:
        status, reply = _post(endpoint, "/chat/completions", body, key)
        assert status == 400, body
        _assert_error_shape(reply, code, mention)
    assert endpoint.close_rollout("odd") == []


def test_tool_calls_go_out_as_openai_calls_and_come_back_as_the_models_text(processor):
    tokenizer = processor.tokenizer
    text = 'Let me look.<tool_call>\n{"name": "zoom", "arguments": {"x": 3}}\n</tool_call>'
    ids = tokenizer.encode(text, add_special_tokens=False)
    choice = chat_choice(0, SampleOutput(ids, "", [-0.5] * len(ids), "stop"), tokenizer, parse_qwen, False)
    message = choice["message"]
    assert choice["finish_reason"] == "tool_calls" and message["content"] == "Let me look."
    assert [c["function"] for c in message["tool_calls"]] == [{"name": "zoom", "arguments": '{"x": 3}'}]
    # The agent sends the call back with two results; a template without tools gets them as Qwen writes them.
    renderer = ChatRenderer(processor, resize=_resize(processor), tools_message=tools_system_message,
                            family=family_at(processor.tokenizer.name_or_path))  # fmt: skip
    results = [{"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": r} for r in ("3x", "done")]
    rendered, images = renderer.template_messages([{"role": "user", "content": "Zoom."}, message, *results], TOOLS)
    assert images == []
    assert rendered == [
        {"role": "system", "content": tools_system_message(TOOLS)},
        {"role": "user", "content": "Zoom."},
        {
            "role": "assistant",
            "content": 'Let me look.\n<tool_call>\n{"name": "zoom", "arguments": {"x": 3}}\n</tool_call>',
        },
        {"role": "user", "content": "<tool_response>\n3x\n</tool_response>\n<tool_response>\ndone\n</tool_response>"},
    ]


# ---------------------------------------------------------------------------------------------------- weight syncs


def test_pause_drains_in_flight_calls_and_holds_new_ones_for_the_new_version(endpoint, tiny_assets):
    weights = AutoModelForImageTextToText.from_pretrained(tiny_assets.model_dir, dtype=torch.float32).state_dict()
    endpoint.open_rollout("sync")
    client = _client(endpoint, "sync")
    replies: dict[str, object] = {}

    def call(name: str) -> None:
        replies[name] = client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": name}], max_tokens=MAX_TOKENS,
            extra_body={"ignore_eos": True},
        )  # fmt: skip

    before = threading.Thread(target=call, args=("before",))
    before.start()
    _wait(lambda: endpoint.in_flight() == 1, "the first call never reached the engine")
    endpoint.pause()
    assert endpoint.in_flight() == 1  # 256 tokens take far longer than this line (else the drain proves nothing)
    during = threading.Thread(target=call, args=("during",))
    during.start()
    _wait(lambda: endpoint.queued() == 1, "the call made during the pause was not held")
    assert endpoint.drain(timeout=120)
    # Drained: the call that was in flight has finished; the held one has not started.
    assert endpoint.in_flight() == 0 and endpoint.queued() == 1 and during.is_alive()
    before.join(60)
    assert replies["before"].vlmrl_version == 0
    assert len(replies["before"].choices) == 1 and replies["before"].usage.completion_tokens == MAX_TOKENS
    version = endpoint.call_engine(lambda engine: engine.version) + 1
    endpoint.call_engine(lambda engine: engine.load_weights(weights.items(), version))
    time.sleep(0.2)
    assert during.is_alive() and endpoint.queued() == 1  # still held until resume
    endpoint.resume()
    during.join(120)
    assert replies["during"].vlmrl_version == version
    calls = endpoint.close_rollout("sync")
    assert [(c.index, c.version) for c in calls] == [(0, 0), (1, version)]
    # The endpoint's own sync does the same in one call.
    endpoint.load_weights(weights.items(), version + 1)
    assert endpoint.call_engine(lambda engine: engine.version) == version + 1


def _wait(condition, message: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(message)
        time.sleep(0.005)
