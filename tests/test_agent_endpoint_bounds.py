"""The agent endpoint's trust bounds, over real HTTP on loopback, with a stub engine and the tiny processor.

- Each rollout has its own key: a key serves the rollout it was made for and no other (a guessed or cached
  rollout id under another rollout's key is refused with 403 in OpenAI's shape, and nothing is recorded).
- A pixel budget: an image's size is read from its header and checked before it is decoded, per image and per
  call, and so is the count of images; each refusal is a 400 naming the limit and its config key. The image
  count has a finite default.
- Slow clients: a connection that sends nothing (or half its headers) is closed after the header timeout; a body
  that stalls gets 408; a body over the bound the limits derive is refused with 413 from its declared length,
  before it is read; connections past the cap get 503 and are closed.
- A slow render of one call (its images held in a resize hook) does not hold up another call's reply.
"""

from __future__ import annotations

import base64
import io
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager

import pytest
from PIL import Image, ImageFile
from transformers import AutoProcessor

from vlmrl.config import AgentOptionsConfig
from vlmrl.data.chat import tools_system_message
from vlmrl.models import family_at
from vlmrl.rollout.endpoint.render import ChatRenderer
from vlmrl.rollout.endpoint.server import AgentEndpoint, EndpointLimits, body_bound

from helpers import agent_endpoint  # noqa: E402

MAX_MODEL_LEN, MAX_TOKENS = 512, 16
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def processor(tiny_assets):
    return AutoProcessor.from_pretrained(tiny_assets.model_dir)


@contextmanager
def _endpoint(processor, resize=None, **limits):
    """A started endpoint over a stub engine; ``resize`` wraps the tiny model's resize (a test hook)."""
    base = agent_endpoint.resize(processor)
    renderer = ChatRenderer(
        processor, resize=(lambda image: resize(image, base)) if resize else base, tools_message=tools_system_message,
        family=family_at(processor.tokenizer.name_or_path),
    )  # fmt: skip
    engine = agent_endpoint.EchoEngine(processor.tokenizer.encode("red", add_special_tokens=False))
    limits = EndpointLimits(max_model_len=MAX_MODEL_LEN, max_tokens=MAX_TOKENS, **limits)
    with AgentEndpoint(engine, renderer, limits).start() as endpoint:
        yield endpoint


def _post(endpoint, body: dict, key: str | None, path: str = "/chat/completions", timeout: float = 30):
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(endpoint.base_url + path, json.dumps(body).encode(), headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _assert_error(body: dict, code: str, *mentions: str) -> None:
    assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"]), body
    assert body["error"]["code"] == code, body
    assert all(m in body["error"]["message"] for m in mentions), body


def _png(width: int, height: int, colour=(200, 30, 30)) -> str:
    """A one-colour PNG as a data URL: a few kB however many pixels it declares."""
    buf = io.BytesIO()
    Image.new("RGB", (width, height), colour).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _with_images(*urls: str) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return [{"role": "user", "content": [{"type": "text", "text": "Which colour? "}, *parts]}]


def _connect(endpoint) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", endpoint.port), timeout=10)
    sock.settimeout(10)
    return sock


def _read_all(sock: socket.socket) -> bytes:
    """What the server sends until it closes the connection (socket.timeout if it does not within 10 s)."""
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


# ---------------------------------------------------------------------------------------------------- keys


def test_a_rollout_key_serves_its_own_rollout_and_no_other(processor):
    with _endpoint(processor) as endpoint:
        # Rollout ids as the worker makes them: predictable, so the key must not be derivable from them.
        key_a, key_b = endpoint.open_rollout("7:0#0"), endpoint.open_rollout("7:1#0")
        assert key_a == endpoint.api_key("7:0#0") and key_b == endpoint.api_key("7:1#0")
        credential_a, credential_b = key_a.partition(":")[0], key_b.partition(":")[0]
        token, _, secret_a = credential_a.partition(".")
        assert credential_b.partition(".")[0] == token  # one token per endpoint ...
        assert secret_a != credential_b.partition(".")[2] and len(secret_a) >= 32  # ... and a secret per rollout
        # A's key naming B (a guessed id, or a client cached from another rollout), or the token alone naming B:
        # refused, and B records nothing.
        for forged in (f"{credential_a}:7:1#0", f"{token}:7:1#0", f"{token}.{'x' * 32}:7:1#0"):
            status, reply = _post(endpoint, {"messages": HI}, forged)
            assert status == 403, forged
            _assert_error(reply, "wrong_rollout_key", "7:1#0", "own key")
            assert reply["error"]["type"] == "permission_error"
        assert _post(endpoint, {"messages": HI}, key_a)[0] == 200
        assert _post(endpoint, {"prompt": "hi"}, key_b, "/completions")[0] == 200
        assert [c.rollout_id for c in endpoint.close_rollout("7:1#0")] == ["7:1#0"]
        assert [c.rollout_id for c in endpoint.close_rollout("7:0#0")] == ["7:0#0"]
        # An ended rollout: 410 to its own key, still 403 to another's.
        status, reply = _post(endpoint, {"messages": HI}, key_b)
        assert status == 410
        _assert_error(reply, "rollout_ended", "7:1#0")
        assert _post(endpoint, {"messages": HI}, f"{credential_a}:7:1#0")[0] == 403
        with pytest.raises(KeyError, match="never opened"):
            endpoint.api_key("7:2#0")


# ---------------------------------------------------------------------------------------------------- pixels


def test_images_over_the_pixel_budget_are_refused_from_their_header_before_decoding(processor, monkeypatch):
    decoded: list[tuple[int, int]] = []  # the sizes of the images whose pixels were decoded
    load = ImageFile.ImageFile.load

    def counting_load(image):
        if not getattr(image, "counted_by_test", False):  # load may run more than once on one image
            image.counted_by_test = True
            decoded.append(image.size)
        return load(image)

    monkeypatch.setattr(ImageFile.ImageFile, "load", counting_load)
    with _endpoint(processor, max_images=3, max_image_pixels=64 * 64, max_call_pixels=64 * 64 + 48 * 48) as endpoint:
        key = endpoint.open_rollout("pixels")
        # One image over the per-image cap: 4000 x 4000 declared in a few kB, refused unread.
        status, reply = _post(endpoint, {"messages": _with_images(_png(4000, 4000))}, key)
        assert status == 400
        _assert_error(
            reply, "image_too_large", "16000000", str(64 * 64), "worker.rollout.agent_options.max_image_pixels"
        )
        assert decoded == []
        # Two images, each under the per-image cap, over the per-call cap together: the second is not decoded.
        status, reply = _post(endpoint, {"messages": _with_images(_png(64, 64), _png(64, 64))}, key)
        assert status == 400
        _assert_error(reply, "too_many_pixels", str(64 * 64 + 48 * 48), "worker.rollout.agent_options.max_call_pixels")
        assert decoded == [(64, 64)]
        # More images than the count allows: refused at the first one over, which is not decoded.
        decoded.clear()
        status, reply = _post(endpoint, {"messages": _with_images(*[_png(20, 20)] * 4)}, key)
        assert status == 400
        _assert_error(reply, "too_many_images", "3", "worker.rollout.agent_options.max_images_per_call")
        assert decoded == [(20, 20)] * 3
        # Within every cap: served, and the call records its images.
        status, _ = _post(endpoint, {"messages": _with_images(_png(64, 64), _png(40, 40))}, key)
        assert status == 200
        [call] = endpoint.close_rollout("pixels")
        assert len(call.images) == 2


def test_a_prompt_over_the_context_is_refused_before_the_processor_expands_its_images(processor, monkeypatch):
    expanded: list[int] = []  # images the processor was called on
    call = type(processor).__call__

    def counting_call(self, *args, **kwargs):
        expanded.append(len(kwargs.get("images") or []))
        return call(self, *args, **kwargs)

    monkeypatch.setattr(type(processor), "__call__", counting_call)
    # Kept at their size (on the grid: 28 px a merged patch): 672 px square is (672 / 14)^2 / 2^2 = 576 patch
    # tokens, over the 511 a context of 512 leaves; 336 px square is 144 and fits.
    with _endpoint(processor, resize=lambda image, base: image) as endpoint:
        key = endpoint.open_rollout("context")
        status, reply = _post(endpoint, {"messages": _with_images(_png(672, 672))}, key)
        assert status == 400
        _assert_error(reply, "context_length_exceeded", f"over the {MAX_MODEL_LEN - 1}")
        assert expanded == []
        status, reply = _post(endpoint, {"messages": _with_images(_png(336, 336))}, key)
        assert status == 200 and expanded == [1]
        assert 144 < reply["usage"]["prompt_tokens"] < MAX_MODEL_LEN - MAX_TOKENS
        assert len(endpoint.close_rollout("context")) == 1


def test_an_image_over_pillows_own_cap_is_refused_as_too_large(processor, monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # Pillow refuses at open past twice this: 64 x 64 is
    with _endpoint(processor) as endpoint:
        key = endpoint.open_rollout("bomb")
        status, reply = _post(endpoint, {"messages": _with_images(_png(64, 64))}, key)
        assert status == 400
        _assert_error(reply, "image_too_large", "worker.rollout.agent_options.max_image_pixels")
        endpoint.close_rollout("bomb")


def test_the_image_budget_is_finite_by_default():
    limits = EndpointLimits(max_model_len=MAX_MODEL_LEN, max_tokens=MAX_TOKENS)
    options = AgentOptionsConfig()
    for count, per_image, per_call in (
        (limits.max_images, limits.max_image_pixels, limits.max_call_pixels),
        (options.max_images_per_call, options.max_image_pixels, options.max_call_pixels),
    ):
        assert 1 <= count <= 64 and 1 <= per_image <= per_call <= 64 * 4096 * 4096


# ---------------------------------------------------------------------------------------------------- slow clients


def test_a_connection_that_sends_nothing_or_half_its_headers_is_closed_after_the_timeout(processor):
    with _endpoint(processor, header_timeout_s=1.0) as endpoint:
        for sent in (b"", b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"):
            with _connect(endpoint) as sock:
                sock.sendall(sent)
                start = time.monotonic()
                assert _read_all(sock) == b""  # closed, not timed out on this side
                assert time.monotonic() - start < 8


def test_a_body_that_stalls_gets_408_and_its_connection_closed(processor):
    with _endpoint(processor, body_timeout_s=1.0) as endpoint:
        key = endpoint.open_rollout("stall")
        with _connect(endpoint) as sock:
            head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
                    "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n")  # fmt: skip
            sock.sendall(head.encode() + b'{"messages": ')
            reply = _read_all(sock)
        assert reply.startswith(b"HTTP/1.1 408")
        _assert_error(json.loads(reply.split(b"\r\n\r\n", 1)[1]), "request_timeout", "1 s")
        assert endpoint.close_rollout("stall") == []


def test_a_body_over_the_bound_is_refused_from_its_length_before_it_is_read(processor):
    small = EndpointLimits(max_model_len=MAX_MODEL_LEN, max_tokens=MAX_TOKENS, max_call_pixels=64 * 64)
    bound = body_bound(small)
    # Derived from the context and the image budget: more of either, a larger bound; far under 64 MiB here.
    assert bound < 2 << 20
    longer = EndpointLimits(max_model_len=2 * MAX_MODEL_LEN, max_tokens=MAX_TOKENS, max_call_pixels=64 * 64)
    more_pixels = EndpointLimits(max_model_len=MAX_MODEL_LEN, max_tokens=MAX_TOKENS, max_call_pixels=10**6)
    assert body_bound(longer) > bound and body_bound(more_pixels) > bound
    with _endpoint(processor, max_call_pixels=64 * 64, max_image_pixels=64 * 64) as endpoint:
        key = endpoint.open_rollout("big")
        with _connect(endpoint) as sock:
            # Declares 32 MiB (a body the fixed 64 MiB bound took), sends 1 kB of it and waits for the answer.
            head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
                    f"Content-Type: application/json\r\nContent-Length: {32 << 20}\r\n\r\n")  # fmt: skip
            sock.sendall(head.encode() + b" " * 1024)
            reply = _read_all(sock)  # answered and closed without the other 32 MiB
        assert reply.startswith(b"HTTP/1.1 413")
        _assert_error(json.loads(reply.split(b"\r\n\r\n", 1)[1]), "request_too_large", str(32 << 20), str(bound),
                      "max_call_pixels")  # fmt: skip
        # A body under the bound is served as before.
        assert _post(endpoint, {"messages": HI}, key)[0] == 200
        assert len(endpoint.close_rollout("big")) == 1


def test_connections_past_the_cap_are_answered_503_and_closed(processor):
    with _endpoint(processor, max_connections=2, header_timeout_s=30.0) as endpoint:
        key = endpoint.open_rollout("crowd")
        held = [_connect(endpoint), _connect(endpoint)]
        try:
            time.sleep(0.2)  # both accepted
            with _connect(endpoint) as sock:
                reply = _read_all(sock)
            assert reply.startswith(b"HTTP/1.1 503")
            _assert_error(json.loads(reply.split(b"\r\n\r\n", 1)[1]), "too_many_connections",
                          "worker.rollout.agent_options.max_connections")  # fmt: skip
        finally:
            for sock in held:
                sock.close()
        # Once they have gone (the server sees them close a moment later), a call is served again.
        deadline = time.monotonic() + 10
        while (status := _post(endpoint, {"messages": HI}, key)[0]) == 503 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert status == 200
        endpoint.close_rollout("crowd")


# ---------------------------------------------------------------------------------------------------- rendering


def test_text_in_tools_and_tool_calls_counts_against_the_context_before_tokenizing(processor, monkeypatch):
    long = "word " * (MAX_MODEL_LEN * 32 // 5 + 1)  # over the context's 32 characters a token
    tool = {"type": "function", "function": {"name": "f", "description": long, "parameters": {"type": "object"}}}
    call = {"id": "1", "type": "function", "function": {"name": "f", "arguments": json.dumps({"x": long})}}
    with _endpoint(processor) as endpoint:
        key = endpoint.open_rollout("text")
        encoded: list[int] = []  # lengths of the texts the tokenizer was given from here on
        encode = type(processor.tokenizer).encode
        monkeypatch.setattr(type(processor.tokenizer), "encode",
                            lambda self, text, *a, **k: encoded.append(len(text)) or encode(self, text, *a, **k))  # fmt: skip
        for body in (
            {"messages": HI, "tools": [tool]},
            {"messages": [*HI, {"role": "assistant", "content": "", "tool_calls": [call]},
                          {"role": "tool", "tool_call_id": "1", "content": "ok"}]},
        ):  # fmt: skip
            status, reply = _post(endpoint, body, key)
            assert status == 400
            _assert_error(reply, "context_length_exceeded", "characters", str(MAX_MODEL_LEN * 32))
        assert encoded == []  # refused before anything was tokenized
        endpoint.close_rollout("text")



def test_a_slow_render_does_not_hold_up_another_calls_reply(processor):
    entered, release = threading.Event(), threading.Event()

    def slow_for_40px(image, base):
        if image.size == (40, 40):  # the slow call's image only: held until the test lets it go
            entered.set()
            release.wait(30)
        return base(image)

    with _endpoint(processor, resize=slow_for_40px) as endpoint:
        slow_key, quick_key = endpoint.open_rollout("slow"), endpoint.open_rollout("quick")
        slow: list = []
        caller = threading.Thread(
            target=lambda: slow.append(_post(endpoint, {"messages": _with_images(_png(40, 40))}, slow_key, timeout=60))
        )
        caller.start()
        try:
            assert entered.wait(30), "the slow call's render never started"
            start = time.monotonic()
            status, _ = _post(endpoint, {"messages": HI}, quick_key, timeout=20)
            waited = time.monotonic() - start
            # Answered while the slow render is still held: it did not wait for it (which would take 30 s).
            assert status == 200 and waited < 15 and caller.is_alive() and not release.is_set()
        finally:
            release.set()
            caller.join(60)
        assert slow and slow[0][0] == 200
        assert len(endpoint.close_rollout("slow")) == 1 and len(endpoint.close_rollout("quick")) == 1
