"""Greedy-decode dataset rows with a fresh vLLM engine and print tokens and log-probs as JSON.

Run as a subprocess by the end-to-end test, so that the engine (which patches
torch's thread settings process-wide) stays out of the pytest process.

    python tests/helpers/vllm_greedy.py MODEL_DIR[,MODEL_DIR...] DATA_FILE ROW:MAX_TOKENS [ROW:MAX_TOKENS ...]

Several comma-separated model directories: each is decoded by its own fresh engine, one after the other
in this one process (the first torn down before the next starts), and each prints its RESULT line, in
the order given. One process saves the second start-up of Python, torch and vLLM.
"""

import gc
import json
import os
import sys

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

from transformers import AutoProcessor  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402

from vlmrl.validate import load_config  # noqa: E402
from vlmrl.testing.resolvers import register_resolvers

register_resolvers()  # run as its own process: quickstart.yaml names its model and data as ${tiny:...}
from vlmrl.data.dataset import RLHFDataset  # noqa: E402
from vlmrl.rollout.engine.sampling import sampling_mask  # noqa: E402
from vlmrl.models.qwen_vision import SPECIAL_TOKENS as QWEN_MARKERS


def main() -> None:
    model_dirs, data_file, *requests = sys.argv[1:]
    # The dataset settings are the quickstart's, which the end-to-end run also used.
    data = load_config(["config=examples/quickstart.yaml"]).data
    for model_dir in model_dirs.split(","):
        print("RESULT " + json.dumps(greedy(model_dir, data_file, requests, data)), flush=True)


def greedy(model_dir: str, data_file: str, requests: list[str], data) -> list[dict]:
    """Greedy tokens and log-probs of each ROW:MAX_TOKENS request from a fresh engine on ``model_dir``."""
    processor = AutoProcessor.from_pretrained(model_dir)
    dataset = RLHFDataset(
        data_file,
        processor,
        prompt_key=data.prompt_key,
        answer_key=data.answer_key,
        image_key=data.image_key,
        image_dir=None,
        max_prompt_length=data.max_prompt_length,
        min_pixels=data.min_pixels,
        max_pixels=data.max_pixels,
        format_prompt=data.format_prompt,
    )
    llm = LLM(
        model=model_dir,
        dtype="float32",
        enforce_eager=True,
        max_model_len=data.max_prompt_length + data.max_response_length,
        kv_cache_memory_bytes=1 << 30,
        mm_processor_kwargs={"min_pixels": data.min_pixels, "max_pixels": data.max_pixels},
        logprobs_mode="processed_logprobs",
    )
    vocab_size = llm.llm_engine.model_config.get_vocab_size()
    allowed = sampling_mask(processor.tokenizer, vocab_size, QWEN_MARKERS).nonzero().flatten().tolist()
    results = []
    for request in requests:
        row, max_tokens = (int(x) for x in request.split(":"))
        sample = dataset.sample(row)
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=0, allowed_token_ids=allowed)
        prompt = {"prompt_token_ids": sample.raw_prompt_ids, "multi_modal_data": {"image": sample.images}}
        out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        ids = list(out.token_ids)
        results.append({"row": row, "ids": ids, "log_probs": [lp[t].logprob for lp, t in zip(out.logprobs, ids)]})
    from vllm.distributed import cleanup_dist_env_and_memory

    del llm
    gc.collect()
    cleanup_dist_env_and_memory()  # so that the next model's engine starts fresh in this process
    return results


if __name__ == "__main__":
    main()
