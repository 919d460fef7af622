"""The model-family registry (``vlmrl.models``): every family has an adapter that answers, a tiny builder, and a
position function equal to its model's own; a model of another family is refused at validation."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers.configs import CPU, QUICKSTART, problems_of
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoProcessor, AutoTokenizer

from vlmrl.models import FAMILIES, UnsupportedFamily, family, family_at
from vlmrl.models.qwen_vision import SPECIAL_TOKENS
from vlmrl.testing import tiny_qwen3_5, tiny_text, tiny_vlm
from vlmrl.testing.assets import ensure_text_assets
from vlmrl.validate import load_config

VISION = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"]
TEXT = ["qwen2", "qwen3"]
OTHER = ["glm4v", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"]  # tested in their own modules: tests/test_family_<model_type>.py


def test_the_registry_lists_every_family_by_its_model_type():
    assert sorted(FAMILIES) == sorted(VISION + TEXT + OTHER)
    for model_type, adapter in FAMILIES.items():
        assert adapter.model_type == model_type and family(model_type) is adapter


def test_the_engine_gets_the_familys_config_with_the_users_override_on_top():
    # GLM-4.1V tells vLLM to build its attention biases (vlmrl/models/glm4v.py); a user's override_config adds to
    # a nested config key by key, and wins where both set the same key.
    glm = family("glm4v")
    assert glm.engine_overrides(None) == {"text_config": {"attention_bias": True}}
    user = {"text_config": {"rope_theta": 5.0}, "max_position_embeddings": 64}
    assert glm.engine_overrides(user) == {
        "text_config": {"attention_bias": True, "rope_theta": 5.0}, "max_position_embeddings": 64,
    }  # fmt: skip
    off = {"text_config": {"attention_bias": False}}
    assert glm.engine_overrides(off) == off
    assert glm.engine_config == {"text_config": {"attention_bias": True}}  # the family's own is left as it was
    assert family("qwen2_5_vl").engine_overrides(user) == user


def test_an_unknown_model_type_is_refused_naming_it_and_the_families():
    with pytest.raises(UnsupportedFamily) as info:
        family("gemma3")
    assert "'gemma3'" in str(info.value)
    assert all(model_type in str(info.value) for model_type in FAMILIES)


def test_each_family_has_a_tiny_builder():
    # Adding a family is its adapter, one registry line and a tiny builder: the tests build it on CPU.
    assert set(FAMILIES) == set(tiny_vlm.FAMILIES) | set(tiny_text.TEXT_FAMILIES) | set(tiny_qwen3_5.BUILDERS)


@pytest.mark.parametrize("model_type", VISION)
def test_a_vision_family_answers_its_tokens_tower_and_exclusions(model_type):
    adapter = family(model_type)
    assert adapter.vision
    assert (adapter.image_token, adapter.video_token) == ("<|image_pad|>", "<|video_pad|>")
    assert {adapter.image_token, adapter.video_token} <= set(adapter.banned_tokens)
    assert adapter.vision_tower == "visual" and adapter.lora_exclude == r".*visual.*"


@pytest.mark.parametrize("model_type", TEXT)
def test_a_text_family_has_no_media_and_bans_the_qwen_markers(model_type, tiny_assets):
    adapter = family(model_type)
    assert not adapter.vision and adapter.vision_tower is None and adapter.lora_exclude is None
    # The Qwen text tokenizers hold the vision markers too; a response may not hold them either.
    assert adapter.banned_tokens == SPECIAL_TOKENS
    assert adapter.media_pad_ids(AutoTokenizer.from_pretrained(tiny_assets.model_dir)) == (-1, -1)
    assert adapter.positions(None).positions([5, 6, 7], {}).tolist() == [[0, 1, 2]] * 3
    with pytest.raises(ValueError, match="text family"):
        adapter.sizes(None, 1, 2)


@pytest.fixture(scope="module")
def text_assets():
    return ensure_text_assets()


@pytest.fixture(scope="module")
def vision_dirs(tiny_assets, tmp_path_factory):
    root = tmp_path_factory.mktemp("family-models")
    return {
        "qwen2_5_vl": tiny_assets.model_dir,
        "qwen2_vl": tiny_vlm.build_tiny_vlm(root / "qwen2_vl", family="qwen2_vl"),
        "qwen3_vl": tiny_vlm.build_tiny_vlm(root / "qwen3_vl", family="qwen3_vl"),
    }


@pytest.mark.parametrize("model_type", VISION)
def test_a_vision_familys_positions_are_its_models_own(vision_dirs, model_type):
    path = vision_dirs[model_type]
    adapter = family_at(str(path))
    assert adapter is family(model_type)
    config = AutoConfig.from_pretrained(path)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    assert adapter.tower(model) is model.model.visual  # what freeze_vision_tower freezes
    # Two images of different grids between text: each run starts after the text, the text resumes past it.
    grids = torch.tensor([[1, 4, 6], [1, 6, 4]])
    merged = [int(g.prod()) // config.vision_config.spatial_merge_size**2 for g in grids]
    image = config.image_token_id
    ids = [1, 2, 3, config.vision_start_token_id] + [image] * merged[0] + [4, 5] + [image] * merged[1] + [6, 7]
    ours = adapter.positions(config).positions(ids, {"image_grid_thw": grids})
    theirs, _ = model.model.get_rope_index(
        torch.tensor([ids]), mm_token_type_ids=(torch.tensor([ids]) == image).int(), image_grid_thw=grids
    )
    assert torch.equal(theirs[:, 0], ours)


@pytest.mark.parametrize("model_type", TEXT)
def test_a_text_familys_positions_are_its_models_own(text_assets, model_type):
    path = text_assets.model_dir if model_type == "qwen2" else text_assets.qwen3_model_dir
    adapter = family_at(str(path))
    assert adapter is family(model_type)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([[5, 9, 11, 13, 17, 19]])
    ours = adapter.positions(model.config).positions(ids[0].tolist(), {})
    with torch.no_grad():
        default = model(input_ids=ids).logits
        given = model(input_ids=ids, position_ids=ours[:1]).logits
    assert torch.equal(default, given)


def test_a_model_of_another_family_is_refused_at_validation(tiny_assets, tmp_path):
    # A real tiny model's directory whose config.json says gemma3: only the config is read, no weights load.
    model_dir = tmp_path / "other-family"
    shutil.copytree(tiny_assets.model_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "model_type": "gemma3"}))
    problems = problems_of(QUICKSTART, f"worker.actor.model.model_path={model_dir}")
    [problem] = [p for p in problems if p.startswith(f"worker.actor.model.model_path={model_dir}: model_type")]
    assert "model_type 'gemma3' is not a supported model family" in problem
    assert all(f"{model_type} (" in problem for model_type in FAMILIES), problem


def test_the_routers_balancing_loss_is_refused_where_nothing_routes_and_where_its_logits_are_not_collected(
    tiny_assets, tmp_path
):
    # The quickstart's dense model has no router; a mixture-of-experts config (only config.json is read) does, but
    # the shared-prompt forward does not collect router logits; a negative weight is refused whatever the model.
    problems = problems_of(QUICKSTART, "worker.actor.router_aux_loss_coef=0.01")
    [dense] = [p for p in problems if p.startswith("worker.actor.router_aux_loss_coef=0.01 with")]
    assert "(Qwen2.5-VL)" in dense and "no router" in dense and "router_aux_loss_coef=0" in dense
    moe_dir = tmp_path / "moe"
    shutil.copytree(tiny_assets.model_dir, moe_dir)
    config = json.loads((moe_dir / "config.json").read_text())
    (moe_dir / "config.json").write_text(json.dumps({**config, "model_type": "qwen3_vl_moe"}))
    moe = [f"worker.actor.model.model_path={moe_dir}", "worker.actor.router_aux_loss_coef=0.01"]
    assert load_config([QUICKSTART, *moe], CPU).worker.actor.router_aux_loss_coef == 0.01  # no problem
    [shared] = [p for p in problems_of(QUICKSTART, *moe, "worker.actor.share_prompts=true") if "router_aux" in p]
    assert "share_prompts=false" in shared
    [negative] = [p for p in problems_of(QUICKSTART, "worker.actor.router_aux_loss_coef=-1") if "router_aux" in p]
    assert negative == "worker.actor.router_aux_loss_coef=-1.0: must be 0 (off) or more"


def test_a_dense_model_asked_for_the_balancing_loss_fails_naming_the_key(tiny_assets):
    # A Hub id escapes validation's family check (only a local config.json is read there): the pass says so.
    from helpers.tiny_families import random_batch

    from vlmrl.data.dataset import RLHFDataset
    from vlmrl.rollout.engine.sampling import sampling_mask
    from vlmrl.train.actor import forward_response

    processor = AutoProcessor.from_pretrained(tiny_assets.model_dir)
    model = AutoModelForImageTextToText.from_pretrained(tiny_assets.model_dir, dtype=torch.float32)
    ds = RLHFDataset(
        str(tiny_assets.train_file), processor, prompt_key="problem", answer_key="answer", image_key="images",
        image_dir=None, max_prompt_length=2048, min_pixels=3136, max_pixels=12544,
    )  # fmt: skip
    batch = random_batch([ds[0]], [3], processor.tokenizer.pad_token_id, max_response_length=3)
    allowed = sampling_mask(processor.tokenizer, model.config.get_text_config().vocab_size, SPECIAL_TOKENS)
    with pytest.raises(ValueError, match="worker.actor.router_aux_loss_coef=0"):
        forward_response(model, batch, allowed, padding_free=True, router_losses=[])

