"""The dataset on each tiny model family (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): golden output and an actor pass.

The golden test pins the token ids, positions and image grid of one small
multimodal row. The three tiny families share one tokenizer, and a 56x84 image
lands on a 3x2 grid of merged tokens in each (28-px cells for Qwen2/2.5,
32-px cells for Qwen3 after resizing to 64x96), so the pinned values are the
same for all three; what differs is the pixel layout (14-px patches give rows of
3*2*14*14 = 1176 values, 16-px patches 1536).
"""

from __future__ import annotations

import pytest
import torch
from helpers.media import png, write_parquet, write_video
from transformers import AutoModelForImageTextToText, AutoProcessor

from helpers.trajectories import Response, batch_of
from vlmrl.data.dataset import RLHFDataset
from vlmrl.testing.tiny_vlm import build_tiny_vlm
from vlmrl.train.actor import forward_response
from vlmrl.rollout.engine.sampling import sampling_mask
from vlmrl.models.qwen_vision import SPECIAL_TOKENS as QWEN_MARKERS

FAMILIES = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"]

# "<image>What colour?" rendered with the default system turn; 909 = <|image_pad|> x 6 in input_ids.
SYSTEM = [898, 82, 560, 198, 587, 367, 382, 543, 545, 13, 899, 198]  # <|im_start|>system\n...<|im_end|>\n
USER = [898, 363, 257, 198]  # <|im_start|>user\n
IMAGE = [906, 909, 907]  # <|vision_start|><|image_pad|><|vision_end|>
TEXT_AND_ASSISTANT = [586, 548, 30, 899, 198, 898, 296, 435, 198]  # What colour?<|im_end|>\n<|im_start|>assistant\n
GOLDEN_RAW = SYSTEM + USER + IMAGE + TEXT_AND_ASSISTANT
GOLDEN_IDS = SYSTEM + USER + [906] + [909] * 6 + [907] + TEXT_AND_ASSISTANT
# Text 0..16, then the image from 17: a 3 (rows) x 2 (columns) grid, one temporal step;
# the text after it resumes at 17 + max(3, 2) = 20.
GOLDEN_POSITIONS = [
    list(range(17)) + [17] * 6 + list(range(20, 30)),
    list(range(17)) + [17, 17, 18, 18, 19, 19] + list(range(20, 30)),
    list(range(17)) + [17, 18, 17, 18, 17, 18] + list(range(20, 30)),
]


@pytest.fixture(scope="module")
def model_dirs(tiny_assets, tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {
        "qwen2_5_vl": tiny_assets.model_dir,
        "qwen2_vl": build_tiny_vlm(root / "qwen2_vl", family="qwen2_vl"),
        "qwen3_vl": build_tiny_vlm(root / "qwen3_vl", family="qwen3_vl"),
    }


def family_dataset(model_dir, files: str) -> RLHFDataset:
    processor = AutoProcessor.from_pretrained(model_dir)
    cell = processor.image_processor.patch_size * processor.image_processor.merge_size
    return RLHFDataset(
        files,
        processor,
        prompt_key="problem",
        answer_key="answer",
        image_key="images",
        image_dir=None,
        max_prompt_length=256,
        min_pixels=cell * cell * 4,
        max_pixels=cell * cell * 16,
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_golden_row_per_family(model_dirs, tmp_path, family):
    files = write_parquet(
        tmp_path / "d.parquet", [{"problem": "<image>What colour?", "answer": "red", "images": [png(56, 84)]}]
    )
    sample = family_dataset(model_dirs[family], files)[0]
    assert sample.raw_prompt_ids == GOLDEN_RAW
    assert sample.input_ids == GOLDEN_IDS
    assert sample.mm_inputs["image_grid_thw"].tolist() == [[1, 6, 4]]
    assert sample.mm_inputs["pixel_values"].shape == (24, 1536 if family == "qwen3_vl" else 1176)
    assert sample.position_ids.shape == (3, len(GOLDEN_IDS))
    assert sample.position_ids.tolist() == GOLDEN_POSITIONS
    assert (sample.uid, sample.ground_truth) == (f"{files}:0", "red")


@pytest.mark.parametrize("family", FAMILIES)
def test_outputs_feed_an_actor_forward_of_each_family(model_dirs, tmp_path, family):
    rows = [
        {"problem": "<image> or <image>?", "answer": "a", "images": [png(56, 56), png(84, 56)], "videos": None},
        {"problem": "What moves?", "answer": "b", "images": None, "videos": [write_video(tmp_path / "v.mp4")]},
        {"problem": "Only words.", "answer": "c", "images": None, "videos": None},
    ]
    ds = family_dataset(model_dirs[family], write_parquet(tmp_path / "d.parquet", rows))
    samples = [ds[i] for i in range(3)]
    model = AutoModelForImageTextToText.from_pretrained(model_dirs[family], dtype=torch.float32).eval()

    # For images the dataset's positions are transformers' own.
    image = samples[0]
    hf_positions, _ = model.model.get_rope_index(
        torch.tensor([image.input_ids]),
        mm_token_type_ids=(torch.tensor([image.input_ids]) == model.config.image_token_id).int(),
        image_grid_thw=image.mm_inputs["image_grid_thw"],
    )
    assert torch.equal(hf_positions[:, 0], image.position_ids)

    tokenizer = ds.tokenizer
    response = tokenizer.encode(" red", add_special_tokens=False) + [tokenizer.eos_token_id]
    generations = [Response(s, i, response, "red", None) for i, s in enumerate(samples)]
    batch = batch_of(
        generations, max_prompt_length=128, max_response_length=4, pad_token_id=tokenizer.pad_token_id,
    )
    allowed = sampling_mask(tokenizer, model.config.get_text_config().vocab_size, QWEN_MARKERS)
    with torch.no_grad():
        mixed, _ = forward_response(model, batch, allowed)
        # Each sample alone gives the same log-probs as in the mixed batch: its media went to it.
        alone = [forward_response(model, batch.select([i]), allowed)[0] for i in range(3)]
        # Padding-free: the three sequences packed into one row, each with its own positions.
        packed, _ = forward_response(model, batch, allowed, padding_free=True)
    assert mixed.shape == (3, 4) and torch.isfinite(mixed).all()
    torch.testing.assert_close(mixed, torch.cat(alone), atol=1e-4, rtol=0)
    real = batch.response_mask.bool()
    torch.testing.assert_close(packed[real], mixed[real], atol=1e-4, rtol=0)
