"""The reward manager's side of a reward model: batch the reward processes' asks, send them, count.

The reward function's handle (``vlmrl.reward.model_client``) asks the manager;
the sandbox hands each ask to ``ModelService.__call__`` in a thread of its own.
Asks that arrive within ``COALESCE_S`` of each other are merged into one
request, so a sequential reward function over several processes still sends
the model batches, not one conversation at a time. A request is shared out
over the servers (one separate actor, or every training worker when
colocated) in contiguous slices, and the answers are put back in order.

The service renders the judge's question and parses its verdict, so that the
servers stay plain engines: ``generate(conversations, sampling) -> (texts,
tokens)`` and ``score(conversations) -> scores``.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from vlmrl.config.options import JudgeParse, TimeoutPolicy
from vlmrl.reward.judging import (
    compile_template,
    describe,
    judge_conversation,
    parse_verdict,
    scored_conversation,
)
from vlmrl.reward.model_client import RewardModelError

log = logging.getLogger(__name__)

COALESCE_S = 0.02
"""How long the first ask of a batch waits for others to join it."""


@dataclass
class ModelLink:
    """Everything the manager needs to reach the reward model; built by the driver, sent to the manager actor."""

    servers: list[Any]
    """Ray actor handles that serve the model."""
    method_prefix: str
    """"" for the separate actor; "reward_model_" for the training workers, which have other methods too."""
    kind: str
    """"judge" or "score"."""
    template: str = ""
    """The judge's question template, as text."""
    parse: JudgeParse = JudgeParse.yes_no
    max_score: float = 10.0
    sampling: dict[str, Any] = field(default_factory=dict)
    """The judge's temperature, max_new_tokens and seed."""
    timeout: float | None = None
    on_timeout: TimeoutPolicy = TimeoutPolicy.error
    on_invalid: TimeoutPolicy = TimeoutPolicy.error


class _Counters:
    def __init__(self):
        self.seconds = 0.0
        self.requests = 0
        self.items = 0
        self.tokens = 0
        self.invalid = 0
        self.timeouts = 0
        self.scores: list[float] = []


class ModelService:
    """``service(method, args)`` for the sandbox: ``generate`` (conversations) or ``score`` (reward inputs)."""

    def __init__(self, link: ModelLink):
        self.link = link
        self.template = compile_template(link.template) if link.kind == "judge" else None
        self._cond = threading.Condition()
        self._waiting: list[tuple[str, list, Future]] = []
        self._counters = _Counters()
        self._lock = threading.Lock()  # the counters
        threading.Thread(target=self._loop, name="vlmrl-reward-model", daemon=True).start()

    # ------------------------------------------------------------ the sandbox's entry point

    def __call__(self, method: str, args: Any) -> Any:
        if method not in ("generate", "score"):
            raise RewardModelError(f"the reward model has no method {method!r}")
        future: Future = Future()
        with self._cond:
            self._waiting.append((method, list(args), future))
            self._cond.notify()
        return future.result()

    def take_metrics(self, prefix: str = "reward_model") -> dict[str, float]:
        """The counters since the last call, as metrics; they start again from 0."""
        with self._lock:
            c, self._counters = self._counters, _Counters()
        if not c.requests:
            return {}
        metrics = {
            f"{prefix}/seconds": c.seconds,
            f"{prefix}/requests": float(c.requests),
            f"{prefix}/items": float(c.items),
            f"{prefix}/invalid": float(c.invalid),
            f"{prefix}/timeouts": float(c.timeouts),
        }
        if self.link.kind == "judge":
            metrics[f"{prefix}/tokens_per_s"] = c.tokens / c.seconds if c.seconds > 0 else 0.0
        if c.scores:
            metrics.update({
                f"{prefix}/score_mean": sum(c.scores) / len(c.scores),
                f"{prefix}/score_max": max(c.scores),
                f"{prefix}/score_min": min(c.scores),
            })  # fmt: skip
        return metrics

    # ------------------------------------------------------------ batching

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._waiting:
                    self._cond.wait()
            time.sleep(COALESCE_S)  # let the other processes' asks of this moment join
            with self._cond:
                batch, self._waiting = self._waiting, []
            for method in ("generate", "score"):
                asks = [(items, f) for m, items, f in batch if m == method]
                if asks:
                    self._serve(method, asks)

    def _serve(self, method: str, asks: list[tuple[list, Future]]) -> None:
        items = [x for chunk, _ in asks for x in chunk]
        try:
            results = self._generate(items) if method == "generate" else self._score(items)
        except BaseException as e:  # each waiting call gets the error, and the loop goes on
            for _, future in asks:
                future.set_exception(e if isinstance(e, Exception) else RewardModelError(str(e)))
            return
        start = 0
        for chunk, future in asks:
            future.set_result(results[start : start + len(chunk)])
            start += len(chunk)

    # ------------------------------------------------------------ the requests

    def _request(self, method: str, conversations: list, *extra) -> list:
        """Send ``conversations`` to the servers in contiguous slices; their answers in order."""
        import ray

        servers = self.link.servers
        size = max(1, math.ceil(len(conversations) / len(servers)))
        slices = [conversations[i : i + size] for i in range(0, len(conversations), size)]
        refs = [
            getattr(server, self.link.method_prefix + method).remote(part, *extra)
            for server, part in zip(servers, slices)
        ]
        started = time.perf_counter()
        try:
            answers = ray.get(refs, timeout=self.link.timeout)
        except ray.exceptions.GetTimeoutError:
            with self._lock:
                self._counters.seconds += time.perf_counter() - started
                self._counters.requests += 1
            raise _Timeout(len(conversations)) from None
        except ray.exceptions.RayActorError as e:
            raise RewardModelError(f"the reward model's actor died: {e}") from None
        except ray.exceptions.RayTaskError as e:
            raise RewardModelError(f"the reward model failed on a request of {len(conversations)}: {e.cause}") from None
        with self._lock:
            self._counters.seconds += time.perf_counter() - started
            self._counters.requests += 1
            self._counters.items += len(conversations)
        return answers

    def _generate(self, conversations: list) -> list[str]:
        """Raw texts for the user's own conversations: a timeout is an error whatever on_timeout says (a
        text cannot be "scored 0"; the reward function may catch RewardModelError itself)."""
        try:
            return self._generate_raw(conversations)
        except _Timeout as t:
            raise self._timeout_error(t.count) from None

    def _score(self, inputs: list) -> list[float]:
        is_input = [isinstance(x, dict) for x in inputs]
        try:
            if self.link.kind == "judge":
                conversations = [
                    judge_conversation(self.template, x, describe(x, i)) if d else x
                    for i, (x, d) in enumerate(zip(inputs, is_input))
                ]
                texts = self._generate_raw(conversations)
                scores = [parse_verdict(t, self.link.parse, self.link.max_score) for t in texts]
            else:
                conversations = [scored_conversation(x) if d else x for x, d in zip(inputs, is_input)]
                texts = None
                scores = [s for part in self._request("score", conversations) for s in part]
                scores = [s if isinstance(s, float) and math.isfinite(s) else None for s in scores]
        except _Timeout as t:
            if self.link.on_timeout is TimeoutPolicy.zero:
                with self._lock:
                    self._counters.timeouts += t.count
                log.warning("reward model: a request of %d ran past %ss and scored 0", t.count, self.link.timeout)
                return [0.0] * len(inputs)
            raise self._timeout_error(t.count) from None
        bad = [i for i, s in enumerate(scores) if s is None]
        if bad and self.link.on_invalid is TimeoutPolicy.error:
            i = bad[0]
            where = describe(inputs[i], i) if is_input[i] else f"conversation {i} of the request"
            what = f"wrote {texts[i]!r}, which does not parse as parse={self.link.parse.value}" if texts else (
                "gave a score that is not a finite number"
            )
            raise RewardModelError(
                f"the reward model ({self.link.kind}) {what} on {where} ({len(bad)} of {len(inputs)} invalid); "
                "fix the prompt template or the parse mode, or set worker.reward.reward_model.on_invalid=zero "
                "to score such samples 0"
            )
        out = [0.0 if s is None else float(s) for s in scores]
        with self._lock:
            self._counters.invalid += len(bad)
            self._counters.scores.extend(out)
        return out

    def _generate_raw(self, conversations: list) -> list[str]:
        answers = self._request("generate", conversations, dict(self.link.sampling))
        with self._lock:
            self._counters.tokens += sum(tokens for _, tokens in answers)
        return [text for part_texts, _ in answers for text in part_texts]

    def _timeout_error(self, count: int) -> RewardModelError:
        return RewardModelError(
            f"a request of {count} to the reward model ran past worker.reward.reward_model.timeout="
            f"{self.link.timeout}s; raise it, or set worker.reward.on_timeout=zero to score such requests 0"
        )


class _Timeout(Exception):
    def __init__(self, count: int):
        self.count = count
