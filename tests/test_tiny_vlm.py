"""The locally built tiny Qwen2.5-VL loads and runs in transformers and in vLLM."""

from __future__ import annotations

import gc
import hashlib
import json
import subprocess
import sys

import pytest
import torch
from PIL import Image
from helpers.runs import joined
from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor, AutoTokenizer, GenerationConfig

from vlmrl.testing.tiny_vlm import QWEN_SPECIAL_TOKENS, build_tiny_vlm

ONE_IMAGE_MESSAGES = [
    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is the shape?"}]}
]
# Hand-written expectation of the Qwen2-VL layout: default system turn, the
# image as one placeholder (expanded later by the processor), open assistant turn.
ONE_IMAGE_RENDERED = (
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What colour is the shape?<|im_end|>\n"
    "<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def processor(tiny_assets):
    return AutoProcessor.from_pretrained(tiny_assets.model_dir)


@pytest.fixture(scope="module")
def hf_model(tiny_assets):
    return AutoModelForImageTextToText.from_pretrained(tiny_assets.model_dir, dtype=torch.float32).eval()


def _image(width: int, height: int, colour=(220, 30, 30)) -> Image.Image:
    return Image.new("RGB", (width, height), colour)


def test_special_token_ids_match_model_config(tiny_assets):
    tokenizer = AutoTokenizer.from_pretrained(tiny_assets.model_dir)
    config = AutoConfig.from_pretrained(tiny_assets.model_dir)
    generation = GenerationConfig.from_pretrained(tiny_assets.model_dir)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_SPECIAL_TOKENS}

    # Every special is one token of its own, with distinct, consecutive ids.
    for token, token_id in ids.items():
        assert tokenizer.encode(token, add_special_tokens=False) == [token_id], token
    assert sorted(ids.values()) == list(range(min(ids.values()), min(ids.values()) + len(ids)))

    assert config.image_token_id == ids["<|image_pad|>"]
    assert config.video_token_id == ids["<|video_pad|>"]
    assert config.vision_start_token_id == ids["<|vision_start|>"]
    assert config.vision_end_token_id == ids["<|vision_end|>"]
    text = config.text_config
    assert text.vocab_size == len(tokenizer)
    assert (text.bos_token_id, text.eos_token_id, text.pad_token_id) == (
        ids["<|endoftext|>"],
        ids["<|im_end|>"],
        ids["<|endoftext|>"],
    )
    assert text.image_token_id == config.image_token_id and text.video_token_id == config.video_token_id

    assert (tokenizer.eos_token, tokenizer.pad_token, tokenizer.bos_token) == ("<|im_end|>", "<|endoftext|>", None)
    assert tokenizer.eos_token_id == ids["<|im_end|>"] and tokenizer.pad_token_id == ids["<|endoftext|>"]
    assert generation.eos_token_id == [ids["<|im_end|>"], ids["<|endoftext|>"]]
    assert generation.pad_token_id == ids["<|endoftext|>"]


def test_tokenizer_round_trips_and_matches_its_tokenizer_json(tiny_assets):
    from tokenizers import Tokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_assets.model_dir)
    raw = Tokenizer.from_file(str(tiny_assets.model_dir / "tokenizer.json"))
    text = "The shape is yellow. <answer>yellow</answer> 3 + 4 = 7? Ünïcode ok, 😀!"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    # transformers rebuilds Qwen2Tokenizer's pipeline in Python; it must agree
    # with the serialised one that other readers (vLLM, tokenizers) may use.
    assert raw.encode(text, add_special_tokens=False).ids == ids
    # The task words are in the vocabulary, not spelled out byte by byte.
    assert len(tokenizer.encode(" red", add_special_tokens=False)) == 1


def test_chat_template_renders_qwen_vl_layout(processor):
    tokenizer = processor.tokenizer
    assert processor.apply_chat_template(ONE_IMAGE_MESSAGES, add_generation_prompt=True, tokenize=False) == (
        ONE_IMAGE_RENDERED
    )
    assert tokenizer.apply_chat_template(ONE_IMAGE_MESSAGES, add_generation_prompt=True, tokenize=False) == (
        ONE_IMAGE_RENDERED
    )
    with_system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert tokenizer.apply_chat_template(with_system, tokenize=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
    )
    video = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "x"}]}]
    assert "<|vision_start|><|video_pad|><|vision_end|>x<|im_end|>" in tokenizer.apply_chat_template(
        video, tokenize=False
    )


@pytest.mark.parametrize(("width", "height"), [(56, 56), (56, 84), (112, 112), (500, 300)])
def test_processor_expands_image_pad_to_grid(processor, tiny_assets, width, height):
    config = AutoConfig.from_pretrained(tiny_assets.model_dir)
    prompt = processor.apply_chat_template(ONE_IMAGE_MESSAGES, add_generation_prompt=True, tokenize=False)
    batch = processor(text=[prompt], images=[_image(width, height)], return_tensors="pt")

    t, h, w = batch["image_grid_thw"][0].tolist()
    merge = config.vision_config.spatial_merge_size
    ids = batch["input_ids"][0]
    assert int((ids == config.image_token_id).sum()) == t * h * w // merge**2
    assert int((ids == config.vision_start_token_id).sum()) == 1
    assert batch["pixel_values"].shape[0] == t * h * w
    # Small pixel budget: 4..64 image tokens whatever the input size.
    assert 4 <= t * h * w // merge**2 <= 64
    if (width, height) == (56, 84):  # multiples of 28 are kept as they are
        assert (h, w) == (6, 4)


def test_hf_forward_sees_the_image(processor, hf_model):
    prompt = processor.apply_chat_template(ONE_IMAGE_MESSAGES, add_generation_prompt=True, tokenize=False)
    logits = []
    for colour in [(220, 30, 30), (30, 60, 220)]:
        batch = processor(text=[prompt], images=[_image(84, 84, colour)], return_tensors="pt")
        with torch.no_grad():
            out = hf_model(**batch)
        assert out.logits.shape == (1, batch["input_ids"].shape[1], len(processor.tokenizer))
        assert torch.isfinite(out.logits).all()
        logits.append(out.logits[0, -1])
    # The vision tower feeds the language model: another image, other logits.
    assert not torch.allclose(logits[0], logits[1])


def test_build_is_deterministic_in_seed(tmp_path):
    def digest(path):
        return {
            name: hashlib.sha256((path / name).read_bytes()).hexdigest()
            for name in ("model.safetensors", "tokenizer.json", "config.json")
        }

    first = digest(build_tiny_vlm(tmp_path / "a", seed=0))
    assert digest(build_tiny_vlm(tmp_path / "b", seed=0)) == first
    other = digest(build_tiny_vlm(tmp_path / "c", seed=1))
    assert other["model.safetensors"] != first["model.safetensors"]
    assert other["tokenizer.json"] == first["tokenizer.json"]
    assert json.loads((tmp_path / "a" / "config.json").read_text())["model_type"] == "qwen2_5_vl"


def test_unknown_family_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="qwen2_5_vl"):
        build_tiny_vlm(tmp_path, family="llava")


def test_an_unknown_asset_group_is_refused_naming_the_groups_before_anything_is_built(tmp_path, capsys):
    from vlmrl.testing.assets import main

    with pytest.raises(SystemExit) as exit_:
        main(["--cache-dir", str(tmp_path), "--build", "agent", "agnet"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--build agnet: unknown group; choose from tiny, quickstart, text, agent" in err, err
    assert list(tmp_path.iterdir()) == []  # not even the tiny model was built


def test_concurrent_asset_builds_share_one_copy(tmp_path):
    # Two processes race on an empty cache: one via --cache-dir, one via the
    # environment variable. Both must get the same complete directory.
    # Forks of the session's fork server (helpers/runs.py), with torch and transformers imported already.
    cmd = [sys.executable, "-m", "vlmrl.testing.assets"]
    with_flag, plain = joined(cmd + ["--cache-dir", str(tmp_path)]), joined(cmd, {"VLMRL_CACHE_DIR": str(tmp_path)})
    cmd, env = plain
    procs = [
        subprocess.Popen(with_flag[0], stdout=subprocess.PIPE, text=True, env=with_flag[1]),
        subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env),
    ]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert outputs[0] == outputs[1]
    paths = dict(line.split("=", 1) for line in outputs[0].splitlines())
    assert set(paths) == {"model_dir", "train_file", "val_file"}
    built = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert len(built) == 1 and not built[0].name.startswith(".")  # temp dir renamed, none left over
    marker = built[0] / "COMPLETE"
    assert marker.is_file() and all(str(built[0]) in path for path in paths.values())
    assert (built[0] / "tiny-qwen2_5_vl" / "model.safetensors").is_file()

    # A later call reuses the copy instead of rebuilding it.
    stamp = marker.stat().st_mtime_ns
    assert subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout == outputs[0]
    assert marker.stat().st_mtime_ns == stamp


def test_vllm_generates_on_image_prompt_and_agrees_with_hf(tiny_assets, processor, hf_model, monkeypatch):
    # Engine core in this process (as in an FSDP worker) with a small KV cache.
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.distributed import cleanup_dist_env_and_memory

    config = AutoConfig.from_pretrained(tiny_assets.model_dir)
    prompt = processor.apply_chat_template(ONE_IMAGE_MESSAGES, add_generation_prompt=True, tokenize=False)
    image = _image(56, 84)
    threads = torch.get_num_threads()
    llm = LLM(model=str(tiny_assets.model_dir), dtype="float32", max_model_len=1024, seed=0, enforce_eager=True)
    try:
        params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=0, ignore_eos=True)
        (result,) = llm.generate([{"prompt": prompt, "multi_modal_data": {"image": [image]}}], params, use_tqdm=False)
    finally:
        del llm
        gc.collect()
        cleanup_dist_env_and_memory()  # frees the world-size-1 process group vLLM made
        torch.set_num_threads(threads)  # vLLM lowers it to 1 for serving

    batch = processor(text=[prompt], images=[image], return_tensors="pt")
    # vLLM expanded the image placeholder exactly as the HF processor does.
    assert list(result.prompt_token_ids) == batch["input_ids"][0].tolist()
    assert (torch.tensor(result.prompt_token_ids) == config.image_token_id).sum() == 6

    output = result.outputs[0]
    assert len(output.token_ids) == 4
    assert all(0 <= t < len(processor.tokenizer) for t in output.token_ids)
    # Same weights, same maths: HF's log-probs of vLLM's tokens match vLLM's
    # own (seen: ~1e-6 in fp32). Wrong mrope positions move them by ~0.1.
    n = len(result.prompt_token_ids)
    ids = torch.tensor([list(result.prompt_token_ids) + list(output.token_ids)])
    with torch.no_grad():
        logits = hf_model(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            pixel_values=batch["pixel_values"],
            image_grid_thw=batch["image_grid_thw"],
            # Without mm_token_type_ids transformers 5.19 silently falls back
            # to 1-D positions for Qwen2.5-VL (then log-probs differ by ~0.1).
            mm_token_type_ids=torch.nn.functional.pad(batch["mm_token_type_ids"], (0, len(output.token_ids))),
        ).logits
    hf_logprobs = torch.log_softmax(logits[0, n - 1 : -1], dim=-1)
    for step, token in enumerate(output.token_ids):
        assert abs(output.logprobs[step][token].logprob - hf_logprobs[step, token].item()) < 1e-4
        # Greedy decoding picked HF's argmax.
        assert hf_logprobs[step].max().item() - hf_logprobs[step, token].item() < 1e-4
