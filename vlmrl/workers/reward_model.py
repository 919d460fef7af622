"""The reward model's server: a judge served by vLLM, or a sequence-classification model run by transformers.

``RewardModelServer`` is one role, placed two ways (``worker.reward.reward_model.placement``):

* ``separate``: the driver makes it a Ray actor of its own (``start_reward_model``),
  with its own GPU, or CPUs here, so judging overlaps the policy's passes;
* ``colocated``: every ``HybridWorker`` holds one, and the reward manager's
  requests queue between the driver's calls on that worker: the two take turns,
  as the reference model does. On GPU the judge's engine sleeps and a score
  model waits in host memory between requests, so the policy gets the memory.

Both answer plain requests; what to ask and how to read the answer is the
reward manager's business (``vlmrl.reward.model_service``).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from vlmrl.config import RewardModelConfig, RewardModelKind
from vlmrl.heap import started


def _vllm_messages(conversation: list[dict]) -> list[dict]:
    """HF-style image parts (``{"type": "image", "image": PIL}``) as vLLM's chat takes them."""
    out = []
    for message in conversation:
        content = message.get("content")
        if isinstance(content, list):
            content = [
                {"type": "image_pil", "image_pil": part["image"]} if part.get("type") == "image" else part
                for part in content
            ]
        out.append({**message, "content": content})
    return out


def _text_only(conversation: list[dict]) -> list[dict]:
    """A text model's view of a conversation: each message's text parts joined; image parts left out."""
    out = []
    for message in conversation:
        content = message.get("content")
        if isinstance(content, list):
            content = "".join(part.get("text", "") for part in content if part.get("type") == "text")
        out.append({"role": message["role"], "content": content})
    return out


class RewardModelServer:
    def __init__(self, cfg: RewardModelConfig, device: str, *, min_pixels: int, max_pixels: int, colocated: bool):
        self.cfg = cfg
        self.device = device
        self.kind = RewardModelKind(cfg.kind)
        # Colocated on a GPU, the model gives its memory back between requests.
        self.takes_turns = colocated and device == "cuda"
        if self.kind is RewardModelKind.judge:
            self._build_judge(min_pixels, max_pixels)
        else:
            self._build_scorer()
        started()  # the model and the libraries live as long as this process (vlmrl.heap)

    def ready(self) -> str:
        """What the driver waits on: the model is loaded (a load error surfaces here, naming the model)."""
        return f"{self.kind.value} {self.cfg.model_path}"

    # ------------------------------------------------------------ judge

    def _build_judge(self, min_pixels: int, max_pixels: int) -> None:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process
        from vllm import LLM

        cfg = self.cfg
        on_cpu = self.device != "cuda"
        memory = (
            {"kv_cache_memory_bytes": int(cfg.cpu_kvcache_space_gb * (1 << 30))}
            if on_cpu
            else {"gpu_memory_utilization": cfg.gpu_memory_utilization}
        )
        self.llm = LLM(
            model=cfg.model_path,
            dtype=cfg.dtype.value,
            seed=cfg.seed,
            max_model_len=cfg.max_length,
            enforce_eager=on_cpu,
            # The images arrive as the policy saw them, already on its grid; with the policy's bounds the
            # judge's processor (when it has the same patch size) leaves them as they are.
            mm_processor_kwargs={"min_pixels": min_pixels, "max_pixels": max_pixels},
            enable_chunked_prefill=not on_cpu,
            **({"enable_sleep_mode": True} if self.takes_turns else {}),
            **memory,
        )
        if self.takes_turns:
            self.llm.sleep(level=1)

    def generate(self, conversations: list[list[dict]], sampling: dict[str, Any]) -> tuple[list[str], int]:
        """The judge's text for each conversation, and the tokens it wrote in all."""
        from vllm import SamplingParams

        if not conversations:
            return [], 0
        if self.kind is not RewardModelKind.judge:
            raise ValueError("generate() on a score model; set worker.reward.reward_model.kind=judge")
        params = SamplingParams(
            temperature=sampling.get("temperature", 0.0),
            max_tokens=sampling.get("max_new_tokens", 16),
            seed=sampling.get("seed"),
        )
        if self.takes_turns:
            self.llm.wake_up()
        try:
            outputs = self.llm.chat([_vllm_messages(c) for c in conversations], params, use_tqdm=False)
        finally:
            if self.takes_turns:
                self.llm.sleep(level=1)
        texts = [o.outputs[0].text for o in outputs]
        return texts, sum(len(o.outputs[0].token_ids) for o in outputs)

    # ------------------------------------------------------------ score

    def _build_scorer(self) -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        cfg = self.cfg
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model_path)
        # Right padding: the real tokens keep the positions they have alone, so a batch scores as single calls do.
        self.tokenizer.padding_side = "right"
        self.model = AutoModelForSequenceClassification.from_pretrained(
            cfg.model_path, dtype=getattr(torch, cfg.dtype.value)
        ).eval()
        if self.model.config.pad_token_id is None:  # the classifier reads the last token that is not padding
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.model.to("cpu" if self.takes_turns else self.device)

    @torch.no_grad()
    def score(self, conversations: list[list[dict]]) -> list[float]:
        """The model's scalar (its first logit) for each conversation, ``micro_batch_size`` at a time."""
        if self.kind is not RewardModelKind.score:
            raise ValueError("score() on a judge; the reward manager parses a judge's text instead")
        texts = [self.tokenizer.apply_chat_template(_text_only(c), tokenize=False) for c in conversations]
        lengths = [len(self.tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
        too_long = [i for i, n in enumerate(lengths) if n > self.cfg.max_length]
        if too_long:
            i = too_long[0]
            raise ValueError(
                f"conversation {i} of the request has {lengths[i]} tokens, over worker.reward.reward_model."
                f"max_length={self.cfg.max_length}; raise it (the model's context allowing)"
            )
        if self.takes_turns:
            self.model.to(self.device)
        try:
            scores: list[float] = []
            step = max(1, self.cfg.micro_batch_size)
            for start in range(0, len(texts), step):
                batch = self.tokenizer(
                    texts[start : start + step], return_tensors="pt", padding=True, add_special_tokens=False
                ).to(self.device)
                logits = self.model(**batch).logits
                scores.extend(logits[:, 0].float().cpu().tolist())
        finally:
            if self.takes_turns:
                self.model.to("cpu")
                torch.cuda.empty_cache()
        return scores
