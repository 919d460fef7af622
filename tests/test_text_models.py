"""Text-only causal LMs as first-class models: the tiny Qwen2 and Qwen3 built locally (vlmrl.testing.tiny_text),
the model kind read from config.json at validation, the dataset without media (and its refusal of media rows),
the actor's and the critic's padded and packed passes, and a real run: GAE with a critic, LoRA on the actor,
padding-free passes, EasyR1's math format prompt and math reward, the resync, a checkpoint and the HF export.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from helpers.configs import CPU, QUICKSTART, problems_of
from helpers.runs import REPO, experiment_dir, read_metrics, run_command, run_main, tail
from helpers.trajectories import Response, batch_of
from transformers import AutoModelForCausalLM, AutoProcessor

from vlmrl.config import ModelKind
from vlmrl.data.dataset import DataError, RLHFDataset
from vlmrl.plan import ModelKindError, model_kind, resolve
from vlmrl.rollout.engine.sampling import sampling_mask
from vlmrl.models.qwen_vision import SPECIAL_TOKENS as QWEN_MARKERS
from vlmrl.testing.assets import ensure_text_assets
from vlmrl.train.actor import compute_log_probs
from vlmrl.train.critic import ValueModel, compute_values
from vlmrl.train.micro_batches import MicroBatching
from vlmrl.train.models import load_processor
from vlmrl.validate import load_config

MATH_PROMPT = "examples/format_prompt/math.jinja"


@pytest.fixture(scope="module")
def text_assets():
    return ensure_text_assets()


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch, quickstart_assets):
    monkeypatch.chdir(REPO)


def text_run(assets, model_dir: Path | None = None) -> list[str]:
    """The quickstart turned into EasyR1's text math setting: problem/answer columns, the math prompt and reward."""
    return [
        f"worker.actor.model.model_path={model_dir or assets.model_dir}",
        f"data.train_files={assets.math_train_file}",
        f"data.val_files={assets.math_val_file}",
        "data.prompt_key=problem",
        "data.answer_key=answer",
        f"data.format_prompt={MATH_PROMPT}",
        "worker.reward.reward_function=reward_functions/math.py:compute_score",
        "worker.reward.reward_function_kwargs.format_weight=0.1",
    ]


def cut_from_a_vl_checkpoint(model_dir: Path, into: Path) -> Path:
    """A copy of a tiny text model whose tokenizer config names the VL processor class, as the tokenizer of a text
    model cut from a Qwen2.5-VL checkpoint does (no preprocessor_config.json beside it)."""
    import shutil

    shutil.copytree(model_dir, into)
    file = into / "tokenizer_config.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), "processor_class": "Qwen2_5_VLProcessor"}))
    return into


# --------------------------------------------------------------------------- the model kind


def test_the_tiny_text_models_are_text_and_the_tiny_vlm_is_not(text_assets, tiny_assets):
    assert model_kind(str(text_assets.model_dir)) is ModelKind.text
    assert model_kind(str(text_assets.qwen3_model_dir)) is ModelKind.text
    assert model_kind(str(tiny_assets.model_dir)) is ModelKind.vision_language
    for path, architecture in ((text_assets.model_dir, "Qwen2ForCausalLM"), (text_assets.qwen3_model_dir, "Qwen3ForCausalLM")):
        assert json.loads((path / "config.json").read_text())["architectures"] == [architecture]
        assert not (path / "preprocessor_config.json").exists()  # a tokenizer alone, no image processor


def test_a_text_model_whose_tokenizer_names_a_vl_processor_loads_its_tokenizer_alone(text_assets, tmp_path, capsys):
    cut = cut_from_a_vl_checkpoint(text_assets.model_dir, tmp_path / "cut")
    with pytest.raises(OSError, match="image processor"):  # what AutoProcessor does with such a directory
        AutoProcessor.from_pretrained(cut)
    processor = load_processor(str(cut), announce=True)
    assert type(processor).__name__ == "Qwen2Tokenizer"
    assert capsys.readouterr().out == (
        f"processor: {cut} names processor_class Qwen2_5_VLProcessor, but the model has no vision config (a text "
        "model): loading its tokenizer alone\n"
    )
    # The same tokenizer as the uncut model's, and no line without announce (the workers) or without the class.
    assert processor(["a b c"]).input_ids == load_processor(str(text_assets.model_dir))(["a b c"]).input_ids
    load_processor(str(cut))
    load_processor(str(text_assets.model_dir), announce=True)
    assert capsys.readouterr().out == ""
    # tokenizer_path: the kind is the model's, the tokenizer the other directory's.
    assert type(load_processor(str(text_assets.qwen3_model_dir), str(cut))).__name__ == "Qwen2Tokenizer"


def test_a_text_config_validates_before_ray_with_no_problems(text_assets):
    config = load_config([QUICKSTART, *text_run(text_assets)], CPU)
    assert resolve(config, CPU).notes == ()


def test_a_model_that_is_neither_kind_is_refused_at_validation_naming_the_key(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertModel"]}))
    with pytest.raises(ModelKindError):
        model_kind(str(tmp_path))
    problems = problems_of(QUICKSTART, f"worker.actor.model.model_path={tmp_path}")
    assert [p for p in problems if p.startswith("worker.actor.model.model_path: model_type 'bert'")], problems


def test_freezing_the_vision_tower_of_a_text_model_is_refused(text_assets):
    problems = problems_of(QUICKSTART, *text_run(text_assets), "worker.actor.model.freeze_vision_tower=true")
    assert problems == [
        f"worker.actor.model.freeze_vision_tower=true but {text_assets.model_dir} is a text-only model (no "
        "vision_config): it has no vision tower; set worker.actor.model.freeze_vision_tower=false"
    ]


# --------------------------------------------------------------------------- data


def _dataset(files, model_dir, **kw) -> RLHFDataset:
    return RLHFDataset(
        str(files), AutoProcessor.from_pretrained(model_dir), prompt_key="problem", answer_key="answer",
        image_key="images", image_dir=None, max_prompt_length=256, min_pixels=3136, max_pixels=12544, **kw,
    )  # fmt: skip


def test_a_text_row_becomes_a_chat_prompt_with_plain_positions(text_assets):
    dataset = _dataset(text_assets.math_train_file, text_assets.model_dir, format_prompt=MATH_PROMPT)
    sample = dataset[0]
    problem = dataset.rows.table[dataset.index[0]]["problem"]
    assert sample.prompt_text.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n")
    assert f"{problem} Reason about the problem step by step inside <think> </think> tags" in sample.prompt_text
    assert sample.prompt_text.endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert sample.images == [] and sample.mm_inputs == {}
    n = len(sample.input_ids)
    assert torch.equal(sample.position_ids, torch.arange(n).expand(3, n))


def test_a_row_with_an_image_is_refused_for_a_text_model_naming_the_row(text_assets, tmp_path):
    rows = [{"problem": "1 + 1?", "answer": "2", "images": []}, {"problem": "what?", "answer": "3", "images": ["a.png"]}]
    path = tmp_path / "mixed.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    with pytest.raises(DataError) as info:
        _dataset(path, text_assets.model_dir)
    assert str(info.value).startswith(
        f"{path} row 1, key 'images': the row has 1 image(s) but the model is text-only (its config.json has no "
        "vision_config)"
    ), str(info.value)
    skipping = _dataset(path, text_assets.model_dir, on_bad_sample="skip")
    assert len(skipping) == 1 and list(skipping.skipped) == [1]


# --------------------------------------------------------------------------- the passes


@pytest.fixture(scope="module", params=["qwen2", "qwen3"])
def text_model_and_batch(request, text_assets):
    model_dir = text_assets.model_dir if request.param == "qwen2" else text_assets.qwen3_model_dir
    processor = AutoProcessor.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    dataset = _dataset(text_assets.math_train_file, model_dir, filter_overlong_prompts=False)
    allowed = sampling_mask(processor, model.config.vocab_size, QWEN_MARKERS)
    allowed_ids = allowed.nonzero().flatten()
    gen = torch.Generator().manual_seed(0)
    lengths = [6, 1, 4, 2, 5, 3]  # ragged responses under prompts of different lengths: padding on both sides
    responses = [
        Response(dataset[i], i, allowed_ids[torch.randint(len(allowed_ids), (lengths[i * 2 + k],), generator=gen)].tolist())
        for i in range(3)
        for k in range(2)
    ]
    batch = batch_of(responses, max_prompt_length=64, max_response_length=6, pad_token_id=processor.pad_token_id)
    return model_dir, model, batch, allowed


def test_text_log_probs_are_the_same_padded_and_packed_and_match_a_plain_forward(text_model_and_batch):
    _, model, batch, allowed = text_model_and_batch
    mask = batch.response_mask.bool()
    padded, _ = compute_log_probs(model, batch, MicroBatching(2), allowed)
    packed, _ = compute_log_probs(model, batch, MicroBatching(4, padding_free=True), allowed)
    torch.testing.assert_close(packed[mask], padded[mask], rtol=0, atol=1e-5)
    # The reference: each row alone, unpadded, through the HF model with its default positions.
    for row in range(len(batch)):
        real = batch.attention_mask[row].bool()
        ids = batch.input_ids[row][real][None]
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0].float()
        logits = logits.masked_fill(~allowed, torch.finfo(logits.dtype).min)
        n = int(batch.response_mask[row].sum())
        expected = torch.log_softmax(logits[-n - 1 : -1], -1).gather(1, ids[0, -n:, None])[:, 0]
        torch.testing.assert_close(padded[row, :n], expected, rtol=0, atol=1e-5)


def test_text_log_probs_are_the_same_with_shared_prompts(text_model_and_batch):
    """``share_prompts`` on a text model: plain (b, S) positions, each prompt once, its two rows on its cache."""
    from vlmrl.train.micro_batches import TokenCount

    _, model, batch, allowed = text_model_and_batch
    mask = batch.response_mask.bool()
    full_tokens, shared_tokens = TokenCount(), TokenCount()
    padded, _ = compute_log_probs(model, batch, MicroBatching(len(batch)), allowed, tokens=full_tokens)
    shared, _ = compute_log_probs(
        model, batch, MicroBatching(len(batch), share_prompts=True), allowed, tokens=shared_tokens
    )
    torch.testing.assert_close(shared[mask], padded[mask], rtol=0, atol=1e-5)
    assert shared_tokens.computed < full_tokens.computed  # three prompts ran once each, not twice


def test_a_text_critic_values_are_the_same_padded_and_packed(text_model_and_batch):
    model_dir, _, batch, _ = text_model_and_batch
    critic = ValueModel.from_pretrained(str(model_dir), torch.float32, trust_remote_code=False)
    torch.nn.init.normal_(critic.value_head.weight, std=0.5, generator=torch.Generator().manual_seed(1))
    mask = batch.response_mask.bool()
    padded = compute_values(critic, batch, MicroBatching(2))
    packed = compute_values(critic, batch, MicroBatching(2, padding_free=True))
    assert padded[mask].abs().min() > 0
    torch.testing.assert_close(packed[mask], padded[mask], rtol=0, atol=1e-5)


# --------------------------------------------------------------------------- a real run

STEPS = 2


@pytest.fixture(scope="module")
def text_e2e(text_assets, tmp_path_factory):
    """The format-tuned tiny Qwen3 for 2 steps of GAE (a critic), LoRA on the actor, padding-free passes, vLLM log-probs,
    EasyR1's math prompt and reward; validation before and after, a checkpoint, then the HF export."""
    out = tmp_path_factory.mktemp("text") / "outputs"
    # Its tokenizer config names the VL processor class (a text model cut from a VL checkpoint): every process
    # that loads the processor must load the tokenizer alone.
    model_dir = cut_from_a_vl_checkpoint(text_assets.qwen3_tuned_model_dir, out.parent / "cut-qwen3")
    proc = run_main(
        out, *text_run(text_assets, model_dir),
        "data.rollout_batch_size=4", "data.max_response_length=24", "data.val_batch_size=8",
        "worker.actor.global_batch_size=4", "worker.actor.micro_batch_size_per_device_for_update=4",
        "worker.rollout.n=2", f"trainer.max_steps={STEPS}", "trainer.val_before_train=true",
        "trainer.logger=[console,file]", "trainer.val_generations_to_log=2",
        "algorithm.adv_estimator=gae", "worker.critic.global_batch_size=4",
        "worker.actor.padding_free=true", "worker.critic.padding_free=true",
        "worker.actor.model.lora.rank=8", "worker.actor.optim.lr=1e-2", "worker.actor.entropy_coeff=0.01",
        "worker.rollout.calculate_log_probs=true",
        # The decoupled PPO loss (issue 20's loss, here in the synchronous step): vLLM's log-probs as behaviour.
        "worker.actor.use_decoupled_loss=true",
        # EasyR1 keys implemented in issue 21, exercised here too: bf16 optimizer states for the actor, the step
        # generated in 2 calls of 2 prompts, and Ray's timeline written at the end.
        "worker.actor.optim.strategy=adamw_bf16", "data.mini_rollout_batch_size=2",
        f"trainer.ray_timeline={out.parent / 'timeline.json'}",
        experiment="text",
    )  # fmt: skip
    assert proc.returncode == 0, tail(proc)
    export_dir = out.parent / "exported"
    checkpoint = experiment_dir(out, "text") / "checkpoints" / f"global_step_{STEPS}"
    exported = run_main_export(checkpoint / "actor", export_dir)
    assert exported.returncode == 0, tail(exported)
    return out, checkpoint, export_dir, proc.stdout, model_dir


def run_main_export(actor_dir: Path, output: Path):
    import sys

    return run_command([sys.executable, "-m", "vlmrl.export", str(actor_dir), "--output", str(output)], timeout=300)


def test_a_text_model_trains_with_a_critic_lora_and_packed_passes(text_e2e):
    out, _, _, stdout, model_dir = text_e2e
    # The driver says once that the tokenizer config's processor class was passed over.
    assert stdout.count(f"processor: {model_dir} names processor_class Qwen2_5_VLProcessor") == 1, stdout
    metrics = read_metrics(out, "text")
    steps = [m for m in metrics if m["step"] >= 1 and "actor/pg_loss" in m]
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:
        assert m["actor/lr"] == 1e-2 and "critic/vf_loss" in m and "reward/overall" in m
        assert m["actor/padding_share"] == 0  # packed: no padding computed
        assert torch.isfinite(torch.tensor(m["actor/grad_norm"])) and m["actor/grad_norm"] > 0
    # Step 2 samples with the weights step 1 trained (lr 1e-2 moves them): vLLM's log-probs equal the actor's
    # only if the resync handed the text model's new (merged LoRA) weights to the engine.
    assert steps[1]["rollout/log_prob_diff_max"] < 1e-3, steps[1]
    # The behaviour weight old / vLLM is 1 up to the engine-actor difference: the loss took vLLM's log-probs.
    for m in steps:
        assert m["actor/behav_weight_mean"] == pytest.approx(1.0, abs=1e-2) and m["actor/behav_weight_capped_frac"] == 0
    assert any(k.startswith("val/") for k in metrics[0]), metrics[0]  # validation before training (step 0)
    assert (out.parent / "timeline.json").is_file()  # trainer.ray_timeline


def test_the_step_was_generated_in_calls_of_mini_rollout_batch_size(text_e2e):
    out, _, _, stdout, _ = text_e2e
    assert "generated 2 prompts at a time" in stdout  # the plan: 4 prompts per step, 2 per call
    for m in read_metrics(out, "text"):
        if "actor/pg_loss" in m:
            # Both calls' rows reach the update: 4 prompts x n=2 = 8 samples in micro-batches of 4.
            assert m["actor/micro_batches"] == 2, m


def test_the_text_runs_reward_function_saw_the_math_prompt_and_text_responses(text_e2e):
    out, _, _, _, _ = text_e2e
    path = experiment_dir(out, "text") / "generations" / f"step_{STEPS}.jsonl"
    generations = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(generations) == 2
    for g in generations:
        assert "Reason about the problem step by step inside <think> </think> tags first." in g["prompt"]
        assert g["prompt"].endswith("<|im_start|>assistant\n") and isinstance(g["response"], str)
        assert set(g["scores"]) >= {"overall", "format", "accuracy"}  # the math reward's sub-scores
    metrics = read_metrics(out, "text")
    assert {"reward/format", "reward/accuracy"} <= set(metrics[-1]), sorted(metrics[-1])
    # The format-tuned start writes EasyR1's format for some samples and not others: the math reward differs
    # within the step, so the update has a reward to follow (a random model scored 0 everywhere).
    first = next(m for m in metrics if m["step"] == 1 and "reward/format" in m)
    assert 0 < first["reward/format"] < 1, first["reward/format"]
    assert first["critic/rewards/max"] > first["critic/rewards/min"], first


def test_the_text_checkpoint_exports_to_a_causal_lm_with_a_tokenizer(text_e2e, text_assets):
    _, checkpoint, export_dir, _, _ = text_e2e
    assert json.loads((checkpoint / "actor" / "lr_scheduler.json").read_text()) == {"steps": STEPS}
    model = AutoModelForCausalLM.from_pretrained(export_dir, dtype=torch.float32)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert not any("lora" in name for name, _ in model.named_parameters())  # merged weights under HF names
    base = AutoModelForCausalLM.from_pretrained(text_assets.qwen3_tuned_model_dir, dtype=torch.float32)
    changed = [n for n, p in model.named_parameters() if not torch.equal(p, base.get_parameter(n))]
    assert changed and all("proj" in n for n in changed), changed  # the LoRA targets moved; norms, embeddings did not
    assert type(load_processor(str(export_dir))).__name__ == "Qwen2Tokenizer"  # the tokenizer came along
