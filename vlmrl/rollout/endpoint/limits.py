"""What the agent endpoint bounds: a call's images and text, request bodies, connections and slow clients.

``EndpointLimits`` holds the numbers (``worker.rollout.agent_options`` sets them);
``body_bound`` derives the largest body worth reading from the context and the
image budget, so that nothing larger is read; ``Refused`` answers a connection
past the cap.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

from vlmrl.rollout.endpoint.openai import EndpointError
from vlmrl.rollout.endpoint.render import CHARS_PER_TOKEN, RenderBudget


@dataclass(frozen=True)
class EndpointLimits:
    """The endpoint's bounds; the image budget's defaults are ``RenderBudget``'s."""

    max_model_len: int
    """The engine's context: a call's prompt (patch tokens expanded) plus its max_tokens must fit."""
    max_tokens: int
    """The most tokens one call may sample; a call that gives no max_tokens gets up to this."""
    max_images: int = RenderBudget.max_images
    """The most images one call may carry, counted before any is decoded."""
    max_image_pixels: int = RenderBudget.max_image_pixels
    """The most pixels of one image (its header's width x height), checked before it is decoded."""
    max_call_pixels: int = RenderBudget.max_call_pixels
    """The most pixels of one call's images together, as their headers declare them."""
    max_n: int = 16
    """The most samples one call may ask for (``n``)."""
    max_body_bytes: int | None = None
    """The largest request body (images arrive base64-encoded in it); None: ``body_bound`` of these limits."""
    header_timeout_s: float = 60.0
    """Seconds a connection may take to send a request's headers, from its opening or its last reply; past them
    it is closed (so an idle kept-alive connection is closed after as long)."""
    body_timeout_s: float = 120.0
    """Seconds a request's body may take to arrive once its headers have; past them: 408, connection closed."""
    max_connections: int = 256
    """Connections open at once; one more is answered 503 and closed."""

    def budget(self) -> RenderBudget:
        """What the renderer checks of one call: its images, and its text against the context."""
        return RenderBudget(
            max_images=self.max_images, max_image_pixels=self.max_image_pixels, max_call_pixels=self.max_call_pixels,
            max_text_chars=self.max_model_len * CHARS_PER_TOKEN, max_prompt_tokens=self.max_model_len - 1,
        )  # fmt: skip

    def body_bytes(self) -> int:
        """The largest body read: ``max_body_bytes``, else ``body_bound``."""
        return self.max_body_bytes if self.max_body_bytes is not None else body_bound(self)


ENCODED_BYTES_PER_PIXEL = 1.0
"""Bytes of an encoded image per declared pixel that a request body is sized for: several times a JPEG photo's or
a PNG screenshot's; a PNG of a photo at the full pixel budget may not fit, and is answered 413 saying so."""
BODY_OVERHEAD = 1 << 20
"""Bytes of a body besides its text and images: JSON, tool schemas, roles, data URL prefixes."""


def body_bound(limits: EndpointLimits) -> int:
    """The largest body worth reading: a context's worth of text (``CHARS_PER_TOKEN`` characters a token, each
    up to 6 bytes as a JSON escape is), the per-call image budget base64-encoded at ``ENCODED_BYTES_PER_PIXEL``,
    and ``BODY_OVERHEAD``."""
    text = limits.max_model_len * CHARS_PER_TOKEN * 6
    images = int(limits.max_call_pixels * ENCODED_BYTES_PER_PIXEL * 4 / 3)
    return text + images + BODY_OVERHEAD


class Refused(asyncio.Protocol):
    """A connection past the cap: answered 503 in OpenAI's shape and closed before anything is read."""

    def __init__(self, cap: int):
        self.cap = cap

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        error = EndpointError(503, f"this endpoint has {self.cap} connections open, its limit "
                              "(worker.rollout.agent_options.max_connections); retry later", "too_many_connections",
                              "server_error")  # fmt: skip
        body = json.dumps(error.body()).encode()
        head = f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        assert isinstance(transport, asyncio.WriteTransport)
        transport.write(head.encode() + b"Connection: close\r\n\r\n" + body)
        transport.close()
