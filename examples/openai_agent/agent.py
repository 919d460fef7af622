"""A two-call agent written with the official ``openai`` package alone: look, then answer.

vlmrl runs ``solve`` once per rollout (``worker.rollout.agent=examples/openai_agent/agent.py:solve``)
against an OpenAI-compatible server that its own vLLM engine serves; every call below is recorded,
token ids and log-probs, and trained on. Nothing here imports vlmrl: the same file runs against any
OpenAI-compatible server that takes images.

1. Look: the row's picture (a base64 PNG data URL) and its question; the model replies.
2. Answer: the conversation so far, the reply included as it came back, and a follow-up asking for
   the colour word alone; the model answers.

The second call's messages are the first call's plus two, so its prompt starts with the first call's
prompt and response: ``algorithm.trace_aggregation=trajectory`` trains both replies as one row. The
agent returns None, so the run's reward function scores the final answer (the last call's reply).
"""

import asyncio
import base64
import io

import openai

MAX_TOKENS = 8  # per call: a colour word and the end of the turn (the quickstart's response budget)
FOLLOW_UP = "Answer with one word: red, green, blue or yellow."


def data_url(image) -> str:
    """A PIL image as a ``data:image/png;base64,...`` URL (the endpoint fetches nothing over the network)."""
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


_http_clients: dict = {}


def http_client():
    """One HTTP client per event loop, shared by every rollout's ``AsyncOpenAI``.

    Each rollout has a key of its own, so each needs a client of its own; made without ``http_client``, each
    would build an HTTP client and an SSL context (about 30 ms of CPU, even for ``http://``) on the machine that
    runs the engine. Connections belong to the loop that opened them, hence one per loop; it is never closed.
    """
    loop = asyncio.get_running_loop()
    if loop not in _http_clients:
        _http_clients[loop] = openai.DefaultAsyncHttpxClient()
    return _http_clients[loop]


async def solve(task, llm):
    """``task``: the row's fields and ``images`` (PIL); ``llm``: ``base_url``, ``api_key``, ``model``."""
    question = task["prompt"].replace("<image>", "").strip()  # the dataset's placeholder; the image goes first
    pictures = [{"type": "image_url", "image_url": {"url": data_url(image)}} for image in task["images"]]
    messages = [{"role": "user", "content": [*pictures, {"type": "text", "text": question}]}]
    client = openai.AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0, http_client=http_client())

    async def chat():
        # No temperature: the trainer's applies (its rollouts' when training, greedy when validating).
        # No stop strings: the server refuses them (the text would not be the sampled tokens).
        reply = await client.chat.completions.create(model=llm.model, messages=messages, max_tokens=MAX_TOKENS)
        return reply.choices[0].message.content

    look = await chat()
    # The reply goes back exactly as it came (no strip): the prompt must stay append-only.
    messages += [{"role": "assistant", "content": look}, {"role": "user", "content": FOLLOW_UP}]
    await chat()
    return None  # the reward function scores the last reply
