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
