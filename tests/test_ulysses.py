"""Ulysses sequence parallelism (``vlmrl.train.ulysses``) computes what one rank computes alone.

One spawn of two gloo ranks forms one SP group of 2 (``ulysses_size=2``,
data parallel degree 1): both ranks hold the same batch, each runs the
decoder stack on half of every packed row, with the all-to-alls around the
attention. The reference is this process running the same passes on the
whole model, without SP. Compared, on the tiny Qwen2.5-VL in float32, on one
batch holding a text row, an image row, a two-image row and a second text
row with ragged responses, in micro-batches of two rows whose packed lengths
are odd (so the row is padded to split):

- the log-probs and entropy of ``compute_log_probs`` (the old and reference
  log-prob passes);
- one ``update_policy`` step with plain SGD at lr 1 (the weights move by
  exactly minus the gradient, so a gradient off by a factor shows, as it
  would not under Adam), with an entropy bonus so the entropy's gradient
  also crosses the gather: the loss metrics, the gradient norm and the
  weights after the step;
- that each rank's vision tower encodes its share of the images;
- the critic's values and one ``update_critic`` SGD step (its value head
  random, so the backbone's gradients are not zero);
- Qwen3-VL's log-probs and entropy on two image rows (its deepstack image
  features go to the rank holding their tokens), and a text causal LM's on
  three text rows (its decoder embeds the tokens itself);
- the log-probs of video rows, and that each rank encodes a share of their frames (a video is cut between the ranks frame by frame);
- a LoRA actor (adapters on the decoder's linear layers, made from the same seed in every process): its
  log-probs and one SGD step of its adapters.

Why the gradients must agree (``ulysses`` module docstring): the update loop
scales each micro-batch's loss by ``world * w / W`` with ``W`` summed over
both ranks' rows, ``2 w_total`` since the rows are the same, so by
``w / w_total``, as alone. Each rank back-propagates through its own tokens
(the gather's backward times 2), the two partial gradients sum to twice the
whole gradient, and FSDP averages over the 2 ranks: the whole gradient.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers.media import png, write_parquet, write_video
from helpers.tiny_families import family_prompts
from helpers.ranks import start_ranks
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoProcessor

from vlmrl.algos import KLEstimator, LossAvgMode, PolicyLossParams, PolicyLossType
from vlmrl.config import FSDPConfig, LoraConfig
from vlmrl.data.dataset import RLHFDataset
from vlmrl.models.qwen_vision import SPECIAL_TOKENS as QWEN_MARKERS
from vlmrl.records import Trajectory
from vlmrl.records.views import to_batch
from vlmrl.rollout.engine.sampling import sampling_mask
from vlmrl.testing.assets import ensure_text_assets
from vlmrl.train import packing, ulysses
from vlmrl.train.actor import UpdateSettings, compute_log_probs, update_policy
from vlmrl.train.critic import CriticSettings, ValueModel, compute_values, update_critic
from vlmrl.train.fsdp_options import Meshes, ShardOptions, shard
from vlmrl.train.lora import add_lora
from vlmrl.train.micro_batches import MicroBatching

SP, RESPONSE = 2, 5
SETTINGS = UpdateSettings(
    samples_per_update=4,
    micro_batch_size=2,
    ppo_epochs=1,
    loss_type=PolicyLossType.default,
    loss_params=PolicyLossParams(
        clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_dual=3.0, loss_avg_mode=LossAvgMode.token_mean
    ),
    max_grad_norm=1e6,  # no clipping: the step is the gradient itself
    entropy_coeff=0.01,
    use_kl_loss=False,
    kl_estimator=KLEstimator.low_var_kl,
    kl_coef=0.0,
    padding_free=True,
)
CRITIC = CriticSettings(
    samples_per_update=4, micro_batch_size=2, ppo_epochs=1, cliprange_value=0.5,
    loss_avg_mode=LossAvgMode.token_mean, max_grad_norm=1e6, norm_len=RESPONSE, padding_free=True,
)  # fmt: skip


@pytest.fixture(scope="module")
def batch_and_mask(tiny_assets, tmp_path_factory):
    """Text, image, two-image and text rows, responses of 5, 3, 4 and 2 tokens, old log-probs near the model's."""
    tmp = tmp_path_factory.mktemp("ulysses")
    rows = [
        {"problem": "Plain text, a question.", "answer": "a", "images": None},
        {"problem": "What colour is <image>?", "answer": "b", "images": [png(56, 56)]},
        {"problem": "Compare <image> and <image>.", "answer": "c", "images": [png(56, 56), png(84, 56, (0, 90, 200))]},
        {"problem": "Text only, and a little longer than the first.", "answer": "d", "images": None},
    ]
    processor = AutoProcessor.from_pretrained(tiny_assets.model_dir)
    dataset = RLHFDataset(
        write_parquet(tmp / "rows.parquet", rows), processor, prompt_key="problem", answer_key="answer",
        image_key="images", image_dir=None, max_prompt_length=256, min_pixels=3136, max_pixels=12544,
    )  # fmt: skip
    model = AutoModelForImageTextToText.from_pretrained(tiny_assets.model_dir, dtype=torch.float32)
    allowed = sampling_mask(processor.tokenizer, model.config.get_text_config().vocab_size, QWEN_MARKERS)
    allowed_ids = allowed.nonzero().flatten()
    gen = torch.Generator().manual_seed(0)
    responses = [allowed_ids[torch.randint(len(allowed_ids), (n,), generator=gen)].tolist() for n in (5, 3, 4, 2)]
    trajectories = [Trajectory.single_turn(dataset[i], i, 0, r, "", 1.0) for i, r in enumerate(responses)]
    batch = to_batch(trajectories, max_prompt_length=256, max_response_length=RESPONSE, pad_token_id=0)
    log_probs, _ = compute_log_probs(model, batch, MicroBatching(4, padding_free=True), allowed)
    batch.old_log_probs = log_probs + 0.3 * torch.randn(log_probs.shape, generator=gen)
    batch.advantages = torch.randn(len(batch), 1, generator=gen).expand(-1, RESPONSE) * batch.response_mask
    batch.values = torch.randn(batch.responses.shape, generator=gen) * batch.response_mask
    batch.returns = batch.values + torch.randn(batch.responses.shape, generator=gen) * batch.response_mask
    return batch, allowed


@pytest.fixture(scope="module")
def video_batch(tiny_assets, tmp_path_factory):
    """A video row and a video-and-image row on the tiny Qwen2.5-VL, responses of 3 and 2 tokens: 3 temporal
    patches and 1, so that the group of 2 cuts the first video's frames between its ranks."""
    tmp = tmp_path_factory.mktemp("ulysses_video")
    rows = [
        {"problem": "What happens in <video>?", "answer": "a", "images": None,
         "videos": [write_video(tmp / "v.mp4", frames=6, fps=2)]},
        {"problem": "Clip then a picture.", "answer": "b", "images": [png(56, 56)],
         "videos": [write_video(tmp / "short.mp4", frames=2, fps=2)]},
    ]  # fmt: skip
    processor = AutoProcessor.from_pretrained(tiny_assets.model_dir)
    dataset = RLHFDataset(
        write_parquet(tmp / "rows.parquet", rows), processor, prompt_key="problem", answer_key="answer",
        image_key="images", image_dir=None, max_prompt_length=512, min_pixels=3136, max_pixels=12544, video_fps=2.0,
    )  # fmt: skip
    trajectories = [Trajectory.single_turn(dataset[i], i, 0, [100 + i] * n, "", 1.0) for i, n in enumerate((3, 2))]
    return to_batch(trajectories, max_prompt_length=512, max_response_length=3, pad_token_id=0)


@pytest.fixture(scope="module")
def qwen3_vl(tiny_assets, tmp_path_factory):
    """Qwen3-VL's tiny model (its deepstack adds image features inside the first decoder layers) and a batch of
    its two image prompts with responses of 3 and 4 tokens."""
    path, prompts, allowed = family_prompts("qwen3_vl", tmp_path_factory.mktemp("qwen3_vl"), tiny_assets.train_file)
    allowed_ids = allowed.nonzero().flatten()
    gen = torch.Generator().manual_seed(2)
    rows = [
        Trajectory.single_turn(p, g, 0, allowed_ids[torch.randint(len(allowed_ids), (n,), generator=gen)].tolist(),
                               "", 1.0)
        for g, (p, n) in enumerate(zip(prompts, (3, 4)))
    ]  # fmt: skip
    return str(path), to_batch(rows, max_prompt_length=2048, max_response_length=4, pad_token_id=0), allowed


@pytest.fixture(scope="module")
def text_lm():
    """The tiny text causal LM (Qwen2; its decoder is given token ids, not embeddings) and three math prompts with
    responses of 5, 2 and 4 tokens."""
    assets = ensure_text_assets()
    processor = AutoProcessor.from_pretrained(assets.model_dir)
    dataset = RLHFDataset(
        str(assets.math_train_file), processor, prompt_key="problem", answer_key="answer", image_key="images",
        image_dir=None, max_prompt_length=256, min_pixels=3136, max_pixels=12544,
    )  # fmt: skip
    vocab = AutoModelForCausalLM.from_pretrained(assets.model_dir).config.vocab_size
    allowed = sampling_mask(processor, vocab, QWEN_MARKERS)
    allowed_ids = allowed.nonzero().flatten()
    gen = torch.Generator().manual_seed(3)
    responses = [allowed_ids[torch.randint(len(allowed_ids), (n,), generator=gen)].tolist() for n in (5, 2, 4)]
    rows = [Trajectory.single_turn(dataset[i], i, 0, r, "", 1.0) for i, r in enumerate(responses)]
    return str(assets.model_dir), to_batch(rows, max_prompt_length=256, max_response_length=5, pad_token_id=0), allowed


def _critic(model_dir: str) -> ValueModel:
    """The critic with a random value head (the same in every process), so the backbone gets gradients too."""
    critic = ValueModel.from_pretrained(model_dir, torch.float32, False)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        critic.value_head.weight.copy_(torch.randn(critic.value_head.weight.shape, generator=gen))
    return critic


def _critic_passes(critic: ValueModel, batch, sequence) -> dict:
    """The value pass, then one SGD step of the critic update; what each gave."""
    values = compute_values(critic, batch, MicroBatching(2, padding_free=True), sequence)
    optimizer = torch.optim.SGD([p for p in critic.parameters() if p.requires_grad], lr=1.0)
    before = _full(critic)
    metrics = update_critic(critic, optimizer, batch, CRITIC, sequence)
    return {"values": values, "metrics": metrics, "step": {n: w - before[n] for n, w in _full(critic).items()}}


def _passes(model: torch.nn.Module, batch, allowed, sequence) -> dict:
    """The log-prob pass, then one SGD step of the policy update; what each gave, and the images the vision
    tower encoded in each of its calls."""
    images: list[int] = []
    model.model.visual.register_forward_hook(
        lambda _module, _args, kwargs, _out: images.append(len(kwargs["grid_thw"])), with_kwargs=True
    )
    log_probs, entropy = compute_log_probs(
        model, batch, MicroBatching(2, padding_free=True), allowed, sequence=sequence
    )
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
    before = _full(model)
    metrics = update_policy(model, optimizer, batch, SETTINGS, allowed, sequence=sequence).metrics
    step = {n: w - before[n] for n, w in _full(model).items()}
    return {"log_probs": log_probs, "entropy": entropy, "metrics": metrics, "step": step, "images": images}


def _lora_model(model_dir: str) -> torch.nn.Module:
    """The tiny model with LoRA adapters, the same in every process. peft starts each B at zero, so the log-probs
    are the base model's and the first step moves the B matrices alone: the step is the adapters' gradient."""
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(5)
    return add_lora(model, LoraConfig(rank=4, alpha=8))


def _full(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in model.named_parameters()
    }


def _tower_frames(model: torch.nn.Module) -> tuple[list[int], object]:
    """The frames (temporal patches) the vision tower encodes in each of its calls, and the hook's handle."""
    frames: list[int] = []
    handle = model.model.visual.register_forward_hook(
        lambda _module, _args, kwargs, _out: frames.append(int(kwargs["grid_thw"][:, 0].sum())), with_kwargs=True
    )
    return frames, handle


def _rank(rank: int, init_file: str, model_dir: str, batch, allowed, qwen3_vl, text_lm, videos, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=SP)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    ulysses.check_model(model, SP, "worker.actor.ulysses_size")
    ulysses.install(model)
    fsdp = FSDPConfig()
    mesh = Meshes("cpu", SP).of(fsdp)
    model = shard(model, list(model._no_split_modules), mesh, ShardOptions.from_config(fsdp, "cpu"))
    # As the worker does with enable_gradient_checkpointing: the layers run again in the backward (alone does not).
    model.gradient_checkpointing_enable()
    group = ulysses.SequenceGroup.of_world(SP)
    frames, hook = _tower_frames(model)
    videos = compute_log_probs(model, videos, MicroBatching(2, padding_free=True), allowed, sequence=group)
    hook.remove()
    out = {"group": (group.size, group.rank), "videos": videos, "video_frames": frames}
    out |= _passes(model, batch, allowed, group)
    lora = _lora_model(model_dir)
    ulysses.install(lora)
    lora = shard(lora, list(lora._no_split_modules), mesh, ShardOptions.from_config(fsdp, "cpu"))
    out["lora"] = _passes(lora, batch, allowed, group)
    critic = _critic(model_dir)
    ulysses.install(critic.backbone)
    critic = shard(critic, critic.no_split_modules, mesh, ShardOptions.from_config(fsdp, "cpu"))
    out["critic"] = _critic_passes(critic, batch, group)
    path, family_batch, family_allowed = qwen3_vl  # log-probs only, on the unsharded model
    family_model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    ulysses.install(family_model)
    out["qwen3_vl"] = compute_log_probs(
        family_model, family_batch, MicroBatching(2, padding_free=True), family_allowed, sequence=group
    )
    path, text_batch, text_allowed = text_lm
    text_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ulysses.install(text_model)
    out["text_lm"] = compute_log_probs(
        text_model, text_batch, MicroBatching(3, padding_free=True), text_allowed, sequence=group
    )
    results[rank] = out
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tiny_assets, batch_and_mask, qwen3_vl, text_lm, video_batch, tmp_path_factory):
    """``{"alone": ..., 0: ..., 1: ...}``: this process without SP, and the two ranks of the SP group."""
    import torch.multiprocessing as mp

    batch, allowed = batch_and_mask
    model_dir = str(tiny_assets.model_dir)
    alone = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    frames, hook = _tower_frames(alone)
    out = {"videos": compute_log_probs(alone, video_batch, MicroBatching(2, padding_free=True), allowed)}
    hook.remove()
    out["video_frames"] = frames
    out |= {"alone": _passes(alone, batch, allowed, None), "critic": _critic_passes(_critic(model_dir), batch, None)}
    out["lora"] = _passes(_lora_model(model_dir), batch, allowed, None)
    path, family_batch, family_allowed = qwen3_vl
    family_model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    out["qwen3_vl"] = compute_log_probs(family_model, family_batch, MicroBatching(2, padding_free=True), family_allowed)
    path, text_batch, text_allowed = text_lm
    text_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    out["text_lm"] = compute_log_probs(text_model, text_batch, MicroBatching(3, padding_free=True), text_allowed)
    tmp = tmp_path_factory.mktemp("ulysses_ranks")
    with mp.Manager() as manager:
        results = manager.dict()
        args = (str(tmp / "init"), model_dir, batch, allowed, qwen3_vl, text_lm, video_batch, results)
        start_ranks(_rank, args, SP)
        out |= dict(results)
    return out


def test_the_batch_covers_text_image_and_two_image_rows_and_odd_packed_lengths(batch_and_mask):
    batch, _ = batch_and_mask
    images = [len(mm.get("image_grid_thw", [])) for mm in batch.mm_inputs]
    assert images == [0, 1, 2, 0]
    for rows in MicroBatching(2, padding_free=True).groups(batch):
        # Every micro-batch's packed row has an odd length: it is padded by one token to split over 2 ranks.
        assert packing.pack(batch.select(rows)).input_ids.shape[1] % SP == 1


def test_sequence_parallel_log_probs_and_entropy_match_one_rank(runs):
    alone = runs["alone"]
    for rank in range(SP):
        assert runs[rank]["group"] == (SP, rank)
        torch.testing.assert_close(runs[rank]["log_probs"], alone["log_probs"], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(runs[rank]["entropy"], alone["entropy"], atol=1e-5, rtol=1e-5)


def test_each_rank_of_a_group_encodes_its_share_of_the_images(runs):
    # Two passes (log-probs, update) over two micro-batches: one holds the one-image row, the other the
    # two-image row. Alone the tower encodes 1 and 2 images per pass; in the group each rank encodes one image
    # of the two-image micro-batch, and the lone image (fewer images than ranks) on both ranks.
    assert sorted(runs["alone"]["images"]) == [1, 1, 2, 2]
    for rank in range(SP):
        assert runs[rank]["images"] == [1, 1, 1, 1], rank


def test_sequence_parallel_update_makes_the_same_step_as_one_rank(runs):
    alone = runs["alone"]
    for rank in range(SP):
        metrics = runs[rank]["metrics"]
        for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm"):
            assert metrics[key] == pytest.approx(alone["metrics"][key], rel=1e-4, abs=1e-6), key
        assert metrics["actor/micro_batches"] == alone["metrics"]["actor/micro_batches"] == 2
    assert alone["metrics"]["actor/grad_norm"] > 0
    moved = 0
    for name, step in alone["step"].items():
        moved += bool(step.abs().max() > 0)
        for rank in range(SP):
            torch.testing.assert_close(
                runs[rank]["step"][name], step, atol=2e-6, rtol=1e-4, msg=lambda m, k=name: f"{k}: {m}"
            )
    assert moved > 0


def test_sequence_parallel_splits_qwen3_vl_deepstack_features_with_their_tokens(runs, qwen3_vl):
    _, batch, _ = qwen3_vl
    assert all("image_grid_thw" in mm for mm in batch.mm_inputs)  # an image in each half of the packed row
    log_probs, entropy = runs["qwen3_vl"]
    for rank in range(SP):
        torch.testing.assert_close(runs[rank]["qwen3_vl"][0], log_probs, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(runs[rank]["qwen3_vl"][1], entropy, atol=1e-5, rtol=1e-5)


def test_sequence_parallel_video_rows_match_one_rank(runs, video_batch):
    assert all("video_grid_thw" in mm for mm in video_batch.mm_inputs)
    log_probs, entropy = runs["videos"]
    for rank in range(SP):
        torch.testing.assert_close(runs[rank]["videos"][0], log_probs, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(runs[rank]["videos"][1], entropy, atol=1e-5, rtol=1e-5)


def test_each_rank_of_a_group_encodes_its_share_of_the_video_frames(runs, video_batch):
    # One micro-batch holds both rows. Its image (one frame: fewer than the ranks) is encoded on both ranks; the
    # videos' 3 + 1 temporal patches are cut 2 | 2, so the first video's frames are split between the ranks,
    # and each frame is encoded once in the group (the log-probs above match one rank's).
    assert [int(mm["video_grid_thw"][:, 0].sum()) for mm in video_batch.mm_inputs] == [3, 1]
    assert runs["video_frames"] == [1, 4]  # alone: the image, then the videos
    for rank in range(SP):
        assert runs[rank]["video_frames"] == [1, 2], rank


def test_sequence_parallel_text_lm_log_probs_match_one_rank(runs):
    log_probs, entropy = runs["text_lm"]
    for rank in range(SP):
        torch.testing.assert_close(runs[rank]["text_lm"][0], log_probs, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(runs[rank]["text_lm"][1], entropy, atol=1e-5, rtol=1e-5)


def test_sequence_parallel_critic_gives_the_same_values_and_step_as_one_rank(runs):
    alone = runs["critic"]
    assert alone["metrics"]["critic/grad_norm"] > 0
    names = sorted(alone["step"])
    whole = torch.cat([alone["step"][n].flatten() for n in names])
    for rank in range(SP):
        mine = runs[rank]["critic"]
        torch.testing.assert_close(mine["values"], alone["values"], atol=1e-5, rtol=1e-5)
        for key in ("critic/vf_loss", "critic/grad_norm"):
            assert mine["metrics"][key] == pytest.approx(alone["metrics"][key], rel=1e-4, abs=1e-6), key
        # A random value head makes values of order 10 and the gradient large, so the float noise of a weight's
        # step is up to about 1e-5: compared as one vector (a wrong gather factor would double the step).
        step = torch.cat([mine["step"][n].flatten() for n in names])
        assert float((step - whole).norm()) < 1e-5 * float(whole.norm()), rank


def test_models_the_attention_cannot_split_are_refused_naming_the_key(tiny_assets):
    model = AutoModelForImageTextToText.from_pretrained(tiny_assets.model_dir, dtype=torch.float32)
    config = model.get_decoder().config
    ulysses.check_model(model, config.num_attention_heads, "worker.actor.ulysses_size")  # 2 heads split 2 ways
    with pytest.raises(ValueError, match=r"worker.actor.ulysses_size=3: the model has 2 attention heads"):
        ulysses.check_model(model, 3, "worker.actor.ulysses_size")
    config.layer_types = ["linear_attention", "full_attention"]  # a hybrid decoder such as Qwen3.5's
    with pytest.raises(ValueError, match=r"ulysses_size=2: the model's decoder has linear_attention layers"):
        ulysses.check_model(model, 2, "worker.actor.ulysses_size")


def test_the_workers_of_a_group_share_a_shard_and_their_results_come_back_once(batch_and_mask):
    from types import SimpleNamespace

    from vlmrl.workers.group import WorkerGroup

    batch, _ = batch_and_mask
    group = WorkerGroup.__new__(WorkerGroup)  # the split alone: no workers started
    group.world_size = 4
    group.config = SimpleNamespace(worker=SimpleNamespace(actor=SimpleNamespace(ulysses_size=SP)))
    parts = group._parts(batch)  # 2 shards of 2 rows, each given to the 2 workers of its group
    assert len(parts) == 4 and parts[0] == parts[1] and parts[2] == parts[3]
    assert sorted(parts[0] + parts[2]) == list(range(len(batch))) and len(parts[0]) == 2
    results = [batch.response_mask[p].float() * 10 + r // SP for r, p in enumerate(parts)]  # a group's copies agree
    shard_of_row = {i: r // SP for r, p in enumerate(parts) for i in p}
    expected = batch.response_mask.float() * 10 + torch.tensor([shard_of_row[i] for i in range(len(batch))])[:, None]
    assert torch.equal(WorkerGroup.gather(results, parts), expected)
    metrics = group.balance_metrics(batch)  # per shard: 2 shards, not 4 workers
    assert metrics["global_seqlen/balanced_max"] <= metrics["global_seqlen/max"]


def test_a_ulysses_group_counts_as_one_share_of_the_update(quickstart_assets, monkeypatch):
    from helpers.configs import CPU, QUICKSTART, problems_of

    from vlmrl.validate import load_config

    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    # 2 x 2 samples per update: 2 per worker, but 4 per Ulysses group of the 2 workers (a micro-batch of 4 fits).
    base = [
        QUICKSTART, "trainer.n_gpus_per_node=2", "worker.actor.padding_free=true", "data.rollout_batch_size=2",
        "worker.actor.global_batch_size=2", "worker.rollout.n=2",
        "worker.actor.micro_batch_size_per_device_for_update=4",
    ]  # fmt: skip
    assert load_config([*base, "worker.actor.ulysses_size=2"], CPU).worker.actor.ulysses_size == 2  # no problem
    assert problems_of(*base, cluster=CPU) == [
        "worker.actor.micro_batch_size_per_device_for_update=4 does not divide the 2 samples each worker gets per "
        "update (global_batch_size x n / workers); pick a divisor of 2"
    ]


def test_a_padded_pass_with_a_group_is_refused(batch_and_mask):
    from vlmrl.train.actor import forward_response

    batch, allowed = batch_and_mask
    group = ulysses.SequenceGroup(None, SP, 0)  # never reached: the pass is refused first
    with pytest.raises(ValueError, match="the pass must be padding-free"):
        forward_response(torch.nn.Linear(1, 1), batch, allowed, padding_free=False, sequence=group)


def test_the_stall_watch_counts_the_optimizer_steps_of_a_group():
    from types import SimpleNamespace

    from vlmrl.driver.loop import TrainingLoop

    # 8 rows, 4 samples per update and worker share, 2 workers in one Ulysses group: the group holds all 8 rows,
    # so each worker makes 2 optimizer steps (8 / 4), not 1 (8 / 2 workers / 4).
    loop = TrainingLoop.__new__(TrainingLoop)  # the count alone: no workers
    loop.plan = SimpleNamespace(world_size=2, trains_actor=lambda step: True)
    loop.config = SimpleNamespace(worker=SimpleNamespace(actor=SimpleNamespace(ulysses_size=SP)))
    loop.actor_settings = SimpleNamespace(samples_per_update=4, ppo_epochs=1)
    loop.critic_settings = None
    assert loop._optimizer_steps(8, step=1) == {"actor": 2}


def test_sequence_parallel_lora_gives_the_same_log_probs_and_adapter_step_as_one_rank(runs):
    alone = runs["lora"]
    adapters = [name for name in alone["step"] if ".lora_" in name]
    moved = [name for name in adapters if alone["step"][name].abs().max() > 0]
    assert moved and all(".lora_B." in name for name in moved)  # B starts at zero: only B moves in one step
    for rank in range(SP):
        mine = runs[rank]["lora"]
        torch.testing.assert_close(mine["log_probs"], alone["log_probs"], atol=1e-5, rtol=1e-5)
        assert mine["metrics"]["actor/grad_norm"] == pytest.approx(alone["metrics"]["actor/grad_norm"], rel=1e-4)
        for name in adapters:
            torch.testing.assert_close(
                mine["step"][name], alone["step"][name], atol=2e-6, rtol=1e-4, msg=lambda m, k=name: f"{k}: {m}"
            )


def test_the_attention_keeps_no_whole_row_mask_and_attends_within_each_packed_sequence():
    """Three packed sequences (lengths 5, 3 and 4, then 2 tokens of padding to split 2 ways) through the Ulysses
    attention of a group of one: each sequence's output is SDPA's causal attention over that sequence alone, and
    nothing autograd keeps for the backward is T x T (a dense mask, which SDPA copies to float per layer, would
    be; at 32k tokens that is 4 GiB a layer)."""
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3]])
    inputs = {"input_ids": torch.zeros(1, 12, dtype=torch.long), "position_ids": positions}
    group = ulysses.SequenceGroup(None, 2, 0)
    padded, shard = ulysses.split(inputs, torch.tensor([3, 6, 10]), group)
    assert shard.length == 12 and shard.sequences == ((0, 5), (5, 8), (8, 12))
    padded, shard = ulysses.split({**inputs, "input_ids": inputs["input_ids"][:, :11],
                                   "position_ids": positions[:, :11]}, torch.tensor([3]), group)  # fmt: skip
    assert shard.length == 12 and shard.sequences == ((0, 5), (5, 8), (8, 11), (11, 12))  # the padding's own
    alone = ulysses.SequenceGroup(None, 1, 0)
    _, shard = ulysses.split(inputs, torch.tensor([3, 6, 10]), alone)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 12, 4, generator=gen, requires_grad=True) for _ in range(3))
    shapes = []
    before, ulysses._active = ulysses._active, shard
    try:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(tuple(t.shape)) or t, lambda t: t):
            out, _ = ulysses._attention(None, q, k, v, None)  # (b, t, H, d)
    finally:
        ulysses._active = before
    assert not [s for s in shapes if s[-2:] == (12, 12)], shapes
    sdpa = torch.nn.functional.scaled_dot_product_attention
    for a, b in shard.sequences:
        expected = sdpa(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=True).transpose(1, 2)
        torch.testing.assert_close(out[:, a:b], expected)
