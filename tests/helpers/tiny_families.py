"""What the tests over every Qwen-VL family share: a family's tiny model with two image prompts, and a count of
the prompt passes ``worker.actor.share_prompts`` runs."""

from __future__ import annotations

from transformers import AutoConfig, AutoProcessor

from vlmrl.data.dataset import RLHFDataset
from vlmrl.rollout.engine.sampling import sampling_mask
from vlmrl.models.qwen_vision import SPECIAL_TOKENS as QWEN_MARKERS
from vlmrl.testing.tiny_vlm import build_tiny_vlm

FAMILIES = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"]


def family_prompts(family: str, directory, train_file):
    """``(path, prompts, allowed)``: the family's tiny model built in ``directory``, the first two image rows of
    ``train_file`` as its dataset prepares them, and the tokens a response may hold."""
    path = build_tiny_vlm(directory, family)
    processor, config = AutoProcessor.from_pretrained(path), AutoConfig.from_pretrained(path)
    dataset = RLHFDataset(
        str(train_file), processor, prompt_key="problem", answer_key="answer", image_key="images",
        image_dir=None, max_prompt_length=2048, min_pixels=3136, max_pixels=12544, model_config=config,
    )  # fmt: skip
    allowed = sampling_mask(processor.tokenizer, config.get_text_config().vocab_size, QWEN_MARKERS)
    return path, [dataset[0], dataset[1]], allowed


def count_prompt_passes(monkeypatch) -> list[int]:
    """From now on, each prompt pass of the shared-prompt forward appends its number of distinct prompts."""
    from vlmrl.train import shared_prompts

    passes: list[int] = []
    original = shared_prompts.prompt_logits_and_cache

    def counted(model, **kwargs):
        passes.append(kwargs["input_ids"].shape[0])
        return original(model, **kwargs)

    monkeypatch.setattr(shared_prompts, "prompt_logits_and_cache", counted)
    return passes


__all__ = ["FAMILIES", "count_prompt_passes", "family_prompts"]


def family_engine(model_dir, allowed, *, dtype: str, min_pixels: int, max_pixels: int, family=None):
    """A family's tiny in-process vLLM engine as the rollout worker builds it, for a module-scoped fixture to
    ``yield from``; torn down after, with torch's thread count put back (vLLM lowers it to 1 for serving).

    An engine of an earlier module left in a reference cycle would, collected while this one runs, tear down the
    parallel state this one set up ("pipeline model parallel group is not initialized"): it is collected first.
    """
    import gc

    import torch
    from vllm.distributed import cleanup_dist_env_and_memory

    from vlmrl.rollout.engine.vllm import VLLMEngine

    threads = torch.get_num_threads()
    gc.collect()
    engine = VLLMEngine(
        str(model_dir), dtype=dtype, seed=0, max_model_len=512, max_num_batched_tokens=512, enforce_eager=True,
        gpu_memory_utilization=0.5, cpu_kvcache_space_gb=1, min_pixels=min_pixels, max_pixels=max_pixels,
        allowed_tokens=allowed,
        **({"engine_weight": family.engine_weight, "recurrent_layers": family.recurrent_layers,
            "hf_overrides": family.engine_overrides(None)} if family else {}),
    )  # fmt: skip
    yield engine
    del engine
    gc.collect()
    cleanup_dist_env_and_memory()
    torch.set_num_threads(threads)
