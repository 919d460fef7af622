"""Generate twice with vlmrl's VLLMEngine and seeded requests on more prompt tokens than one engine step holds; print JSON.

Run as a subprocess by tests/test_rollout.py (vLLM patches torch's thread
settings process-wide, so it stays out of the pytest process).
"""

import json
import os

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

from transformers import AutoProcessor  # noqa: E402

from vlmrl.validate import load_config  # noqa: E402
from vlmrl.testing.resolvers import register_resolvers

register_resolvers()  # run as its own process: quickstart.yaml names its model and data as ${tiny:...}
from vlmrl.data.dataset import RLHFDataset  # noqa: E402
from vlmrl.testing.assets import ensure_tiny_assets  # noqa: E402
from vlmrl.rollout.engine import Sampling  # noqa: E402
from vlmrl.rollout.engine.sampling import sampling_mask, seeded_requests  # noqa: E402
from vlmrl.models.qwen_vision import SPECIAL_TOKENS as QWEN_MARKERS
from vlmrl.rollout.engine.vllm import VLLMEngine  # noqa: E402

PROMPTS = 24


def main() -> None:
    assets = ensure_tiny_assets()
    data = load_config(["config=examples/quickstart.yaml"]).data
    processor = AutoProcessor.from_pretrained(assets.model_dir)
    dataset = RLHFDataset(
        str(assets.train_file), processor, prompt_key=data.prompt_key, answer_key=data.answer_key,
        image_key=data.image_key, image_dir=None, max_prompt_length=data.max_prompt_length,
        min_pixels=data.min_pixels, max_pixels=data.max_pixels, format_prompt=data.format_prompt,
    )  # fmt: skip
    prompts = [dataset[i] for i in range(PROMPTS)]
    max_model_len = data.max_prompt_length + data.max_response_length
    engine = VLLMEngine(
        str(assets.model_dir), dtype="float32", seed=1, max_model_len=max_model_len,
        # One engine step holds far fewer tokens than the 24 prompts (~60 tokens each).
        max_num_batched_tokens=max_model_len, enforce_eager=True, gpu_memory_utilization=0.5,
        cpu_kvcache_space_gb=1, min_pixels=data.min_pixels, max_pixels=data.max_pixels,
        allowed_tokens=sampling_mask(processor.tokenizer, len(processor.tokenizer), QWEN_MARKERS),
    )  # fmt: skip
    sampling = Sampling(n=2, temperature=1.0, max_tokens=data.max_response_length, want_log_probs=False)
    ids = list(range(PROMPTS))

    def sample(group_ids: list[int]) -> list[list[int]]:
        outputs = engine.generate(seeded_requests(prompts, group_ids, sampling, engine.seed))
        return [s.token_ids for out in outputs for s in out.samples]

    first, again, shifted = sample(ids), sample(ids), sample([i + 1000 for i in ids])
    # The engine draws the requests' seeds in blocks (vlmrl/rollout/engine/vllm_sampler.py); vLLM's own sampler again:
    blocks = engine.seed_draws_in_blocks
    engine.llm.collective_rpc(_stock_sampler)
    stock = sample(ids)
    print("RESULT " + json.dumps({"first": first, "again": again, "shifted": shifted, "blocks": blocks, "stock": stock}))


def _stock_sampler(worker) -> None:
    sampler = worker.model_runner.sampler.topk_topp_sampler
    sampler.forward = sampler.forward_cpu


if __name__ == "__main__":
    main()
