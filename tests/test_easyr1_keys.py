"""The EasyR1 keys that were refused before issue 21, each now implemented: optim.strategy=adamw_bf16,
data.mini_rollout_batch_size, worker.rollout.limit_images, model.override_config, model.tokenizer_path,
worker.hybrid_engine and trainer.ray_timeline.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from helpers.configs import CPU, QUICKSTART, problems_of

from vlmrl.config import OptimConfig, OptimizerStrategy
from vlmrl.data.dataset import DataError, RLHFDataset
from vlmrl.train.models import load_pretrained
from vlmrl.train.optimizers import BF16StateAdamW, build_optimizer
from vlmrl.validate import load_config


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch, quickstart_assets):
    from helpers.runs import REPO

    monkeypatch.chdir(REPO)


# --------------------------------------------------------------------------- adamw_bf16


def _steps(optimizer_cls, params, grads, **kw):
    opt = optimizer_cls(params, lr=1e-2, betas=(0.9, 0.999), weight_decay=0.1, **kw)
    for g in grads:
        for p, gp in zip(params, g):
            p.grad = gp.clone()
        opt.step()
    return opt


def test_with_float32_states_the_bf16_adamw_is_torchs_adamw():
    # The same update rule as torch.optim.AdamW (decoupled decay, bias corrections, eps outside the sqrt).
    gen = torch.Generator().manual_seed(0)
    start = [torch.randn(5, 3, generator=gen), torch.randn(7, generator=gen)]
    grads = [[torch.randn(5, 3, generator=gen), torch.randn(7, generator=gen)] for _ in range(4)]
    ours = [torch.nn.Parameter(t.clone()) for t in start]
    theirs = [torch.nn.Parameter(t.clone()) for t in start]
    _steps(BF16StateAdamW, ours, grads, state_dtype=torch.float32)
    _steps(torch.optim.AdamW, theirs, grads)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_bf16_states_halve_the_moments_and_stay_close_to_float32_adamw():
    gen = torch.Generator().manual_seed(1)
    start = [torch.randn(64, 32, generator=gen)]
    grads = [[torch.randn(64, 32, generator=gen)] for _ in range(5)]
    ours = [torch.nn.Parameter(start[0].clone())]
    theirs = [torch.nn.Parameter(start[0].clone())]
    opt = _steps(BF16StateAdamW, ours, grads)
    _steps(torch.optim.AdamW, theirs, grads)
    state = opt.state[ours[0]]
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16
    assert "compensation" not in state  # float32 weights need no Kahan buffer
    # 5 steps of lr 1e-2 move each weight by up to ~5e-2; bf16 moments (8-bit mantissa, relative error 2^-9)
    # change each step's update by well under 1 %.
    moved = (theirs[0] - start[0]).abs().max()
    assert (ours[0] - theirs[0]).abs().max() < 0.02 * moved


def test_kahan_summation_keeps_bf16_updates_below_the_last_bit():
    # A bf16 weight at 1.0 has a spacing of 2^-7 = 0.0078 above 1 (8 bits of mantissa, 7 stored). A constant
    # gradient gives Adam an update of exactly lr per step (m_hat / sqrt(v_hat) = 1), so 100 steps of lr = 1e-4
    # move the weight down by 100 x 1e-4 = 0.01 in exact arithmetic. Each step alone (1e-4) is under half a
    # spacing below 1 (2^-9 = 0.00195), so plain bf16 rounding keeps 1.0 forever; with Kahan summation the
    # dropped parts add up and the weight lands on the bf16 value nearest 0.99, 0.98828125 (= 1 - 3 x 2^-8).
    kahan = torch.nn.Parameter(torch.ones(1, dtype=torch.bfloat16))
    opt = BF16StateAdamW([kahan], lr=1e-4, weight_decay=0.0)
    plain = torch.ones(1, dtype=torch.bfloat16)
    for _ in range(100):
        kahan.grad = torch.ones(1, dtype=torch.bfloat16)
        opt.step()
        plain = (plain.float() - 1e-4).to(torch.bfloat16)
    assert plain.item() == 1.0
    assert kahan.item() == 0.98828125
    assert opt.state[kahan]["compensation"].dtype == torch.bfloat16


def test_optim_strategy_picks_the_optimizer_and_validates():
    p = [torch.nn.Parameter(torch.zeros(2))]
    assert type(build_optimizer(p, OptimConfig())) is torch.optim.AdamW
    bf16 = build_optimizer(p, OptimConfig(strategy=OptimizerStrategy.adamw_bf16, lr=3e-6, weight_decay=0.0))
    assert type(bf16) is BF16StateAdamW and bf16.param_groups[0]["lr"] == 3e-6
    load_config([QUICKSTART, "worker.actor.optim.strategy=adamw_bf16"], CPU)


# --------------------------------------------------------------------------- mini_rollout_batch_size


def test_mini_rollout_batch_size_must_divide_the_step_and_split_over_the_engines():
    load_config([QUICKSTART, "data.mini_rollout_batch_size=8"], CPU)  # 16 prompts in 2 calls of 8
    assert problems_of(QUICKSTART, "data.mini_rollout_batch_size=5") == [
        "data.mini_rollout_batch_size=5 does not divide data.rollout_batch_size=16: a step is generated in calls of "
        "mini_rollout_batch_size prompts; pick a divisor, or null to generate the step at once"
    ]
    problems = problems_of(
        QUICKSTART, "trainer.n_gpus_per_node=2", "worker.actor.micro_batch_size_per_device_for_update=16",
        "data.mini_rollout_batch_size=1",
    )  # fmt: skip
    assert problems == [
        "data.mini_rollout_batch_size=1 does not split over the 2 vLLM engine(s) (workers / "
        "worker.rollout.tensor_parallel_size): each call gives every engine the same number of prompts; make it a "
        "multiple of 2"
    ]


# --------------------------------------------------------------------------- limit_images


def test_a_row_with_more_images_than_limit_images_is_refused_naming_the_row(tiny_assets, tmp_path):
    from PIL import Image
    from transformers import AutoProcessor

    image = tmp_path / "a.png"
    Image.new("RGB", (56, 56), "red").save(image)
    rows = [{"problem": "one", "answer": "a", "images": [str(image)]},
            {"problem": "two", "answer": "b", "images": [str(image), str(image)]}]  # fmt: skip
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    processor = AutoProcessor.from_pretrained(tiny_assets.model_dir)
    kw = dict(prompt_key="problem", answer_key="answer", image_key="images", image_dir=None,
              max_prompt_length=256, min_pixels=3136, max_pixels=12544)  # fmt: skip
    with pytest.raises(DataError) as info:
        RLHFDataset(str(path), processor, limit_images=1, **kw)
    assert str(info.value).startswith(
        f"{path} row 1, key 'images': the row has 2 images, over worker.rollout.limit_images=1"
    ), str(info.value)
    assert len(RLHFDataset(str(path), processor, limit_images=2, **kw)) == 2


# --------------------------------------------------------------------------- override_config, hybrid_engine


def test_override_config_replaces_entries_of_the_models_config(tiny_assets):
    # Qwen2.5-VL keeps attention_dropout in its text_config, where AutoConfig's kwargs do not reach.
    model = load_pretrained(str(tiny_assets.model_dir), torch.float32, False, {"attention_dropout": 0.25})
    assert model.config.text_config.attention_dropout == 0.25
    assert load_pretrained(str(tiny_assets.model_dir), torch.float32, False).config.text_config.attention_dropout == 0.0
    load_config([QUICKSTART, "worker.actor.model.override_config.attention_dropout=0.1"], CPU)
    with pytest.raises(ValueError, match="model.override_config.no_such_entry: the model's config has no entry"):
        load_pretrained(str(tiny_assets.model_dir), torch.float32, False, {"no_such_entry": 1})


def test_hybrid_engine_false_is_refused_and_ray_timeline_is_accepted(tmp_path):
    assert problems_of(QUICKSTART, "worker.hybrid_engine=false") == [
        "worker.hybrid_engine=false: vlmrl always runs the actor and its vLLM engine in the same worker (the "
        "weights move in process); set worker.hybrid_engine=true"
    ]
    config = load_config([QUICKSTART, f"trainer.ray_timeline={tmp_path / 'timeline.json'}"], CPU)
    assert config.trainer.ray_timeline == str(tmp_path / "timeline.json")


def test_an_override_config_entry_the_model_does_not_have_is_refused_at_validation(tiny_assets):
    problems = problems_of(QUICKSTART, "worker.actor.model.override_config.attention_dropot=0.1")
    assert [p for p in problems if p.startswith(
        "worker.actor.model.override_config.attention_dropot: "
    ) and "has no entry 'attention_dropot' (nor its text_config)" in p], problems
