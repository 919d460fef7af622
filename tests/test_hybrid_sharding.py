"""Hybrid sharding (``fsdp.fsdp_size``) trains as FSDP over all workers does, and saves, loads and syncs alike.

Four gloo ranks (torch.multiprocessing) each take one row of a batch of image
prompts and run the actor's real update (``update_policy``: AdamW, gradients
clipped) on the tiny Qwen2.5-VL, sharded by the worker's own code
(``Meshes``, ``shard``) twice: over all 4 ranks (``fsdp_size=-1``, a 1-D
mesh) and in 2 groups of 2 (``fsdp_size=2``, a 2 x 2 mesh). The ranks see
different rows, so the weights after the step agree across the 4 ranks only
if the gradients were reduced over all of them, and agree with FSDP's only
if the reduction and the clipping norm are the same. The same ranks then
stream the full weights for a resync (``BucketedGather``) and save and load a
DCP checkpoint under the 2 x 2 mesh, into the same mesh and into the 1-D one.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard
from transformers import AutoModelForImageTextToText, AutoProcessor

from helpers.trajectories import Response, batch_of
from helpers.ranks import start_ranks
from vlmrl.algos import KLEstimator, LossAvgMode, PolicyLossParams, PolicyLossType
from vlmrl.config import FSDPConfig
from vlmrl.data.dataset import RLHFDataset
from vlmrl.rollout.engine.sampling import sampling_mask
from vlmrl.models.qwen_vision import SPECIAL_TOKENS as QWEN_MARKERS
from vlmrl.train import checkpoint as ckpt
from vlmrl.train.actor import UpdateSettings, compute_log_probs, update_policy
from vlmrl.train.fsdp_options import Meshes, ShardOptions, mesh_shape, shard
from vlmrl.train.micro_batches import MicroBatching
from vlmrl.weight_sync.gather import BucketedGather

WORLD, RESPONSE = 4, 5
MAX_GRAD_NORM = 0.05
"""Small enough that every step clips: the norm is reduced over the mesh, and a wrong one changes the step."""
SETTINGS = UpdateSettings(
    samples_per_update=1,  # one row per rank
    micro_batch_size=1,
    ppo_epochs=1,
    loss_type=PolicyLossType.default,
    loss_params=PolicyLossParams(
        clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_dual=3.0, loss_avg_mode=LossAvgMode.token_mean
    ),
    max_grad_norm=MAX_GRAD_NORM,
    entropy_coeff=0.0,
    use_kl_loss=False,
    kl_estimator=KLEstimator.low_var_kl,
    kl_coef=0.0,
)


def test_fsdp_size_gives_the_mesh_shape():
    assert mesh_shape(4, -1) == mesh_shape(4, 4) == (4,)
    assert mesh_shape(4, 2) == (2, 2)
    assert mesh_shape(8, 2) == (4, 2)
    assert mesh_shape(4, 1) == (4, 1)  # shards of one rank: data parallel with whole replicas
    for bad in (3, 0, -2, 8):
        with pytest.raises(ValueError, match=f"fsdp_size={bad}"):
            mesh_shape(4, bad)


@pytest.fixture(scope="module")
def batch_and_mask(tiny_assets):
    """Four image rows (2 prompts x 2 samples) with ragged responses, old log-probs near the model's own."""
    processor = AutoProcessor.from_pretrained(tiny_assets.model_dir)
    model = AutoModelForImageTextToText.from_pretrained(tiny_assets.model_dir, dtype=torch.float32)
    dataset = RLHFDataset(
        str(tiny_assets.train_file), processor, prompt_key="problem", answer_key="answer", image_key="images",
        image_dir=None, max_prompt_length=128, min_pixels=3136, max_pixels=12544, filter_overlong_prompts=False,
    )  # fmt: skip
    allowed = sampling_mask(processor.tokenizer, model.config.get_text_config().vocab_size, QWEN_MARKERS)
    allowed_ids = allowed.nonzero().flatten()
    gen = torch.Generator().manual_seed(0)
    lengths = [5, 2, 4, 3]
    responses = [
        Response(dataset[i // 2], i // 2, allowed_ids[torch.randint(len(allowed_ids), (n,), generator=gen)].tolist())
        for i, n in enumerate(lengths)
    ]
    batch = batch_of(
        responses, max_prompt_length=128, max_response_length=RESPONSE, pad_token_id=processor.tokenizer.pad_token_id
    )
    log_probs, _ = compute_log_probs(model, batch, MicroBatching(4), allowed)
    batch.old_log_probs = log_probs + 0.3 * torch.randn(log_probs.shape, generator=gen)
    batch.advantages = torch.randn(len(batch), 1, generator=gen).expand(-1, RESPONSE) * batch.response_mask
    return batch, allowed


def _sharded(model_dir: str, meshes: Meshes, fsdp_size: int) -> torch.nn.Module:
    """The actor as the worker builds it: loaded whole, then sharded over the mesh of its ``fsdp_size``."""
    fsdp = FSDPConfig(fsdp_size=fsdp_size)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    return shard(model, list(model._no_split_modules), meshes.of(fsdp), ShardOptions.from_config(fsdp, "cpu"))


def _adamw(model: torch.nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, weight_decay=1e-2)


def _full(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}  # collective


def _rank(rank: int, init_file: str, model_dir: str, batch, allowed, ckpt_dir: str, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    meshes = Meshes("cpu", WORLD)
    mine = batch.select([rank])
    out: dict = {}
    trained = {}
    for name, fsdp_size in (("fsdp", -1), ("hsdp", 2)):
        model = _sharded(model_dir, meshes, fsdp_size)
        before = _full(model)
        optimizer = _adamw(model)
        metrics = update_policy(model, optimizer, mine, SETTINGS, allowed).metrics
        weight = model.model.language_model.layers[0].self_attn.q_proj.weight
        out[name] = {
            "mesh": tuple(weight.device_mesh.shape),
            "placements": tuple(weight.placements),
            "grad_norm": metrics["actor/grad_norm"],
            "moved": any(not torch.equal(before[n], w) for n, w in _full(model).items()),
            "weights": _full(model),
        }
        trained[name] = (model, optimizer)

    model, optimizer = trained["hsdp"]
    # The resync's stream of full weights under the 2-D mesh, in small buckets (several all-gathers).
    gather = BucketedGather(model, bucket_bytes=1 << 16)
    streamed = dict(gather.stream())
    full_state = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
    out["stream_matches"] = streamed.keys() == full_state.keys() and all(
        torch.equal(streamed[k], full_state[k]) for k in full_state
    )
    out["stream_bucketed"] = gather.largest_bucket_bytes > 0

    # Save under 2 x 2, load into a fresh 2 x 2 model (with its optimizer) and into a fresh 1-D one.
    path = Path(ckpt_dir)
    ckpt.save_actor(path, model, optimizer, rank, model_only=False)
    dist.barrier()
    loaded = {}
    for name, fsdp_size in (("hsdp", 2), ("fsdp", -1)):
        fresh = _sharded(model_dir, meshes, fsdp_size)
        fresh_optimizer = _adamw(fresh)
        restored_optimizer = ckpt.load_actor(path, fresh, fresh_optimizer, rank)
        loaded[name] = {"optimizer": restored_optimizer, "weights": _full(fresh)}
        if name == "hsdp":
            states = [(a, b) for a, b in zip(optimizer.state.values(), fresh_optimizer.state.values())]
            loaded[name]["adam_states_equal"] = len(states) > 0 and all(
                torch.equal(a[k].to_local() if hasattr(a[k], "to_local") else a[k],
                            b[k].to_local() if hasattr(b[k], "to_local") else b[k])
                for a, b in states for k in ("exp_avg", "exp_avg_sq")
            )  # fmt: skip
    out["loaded"] = loaded
    results[rank] = out
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tiny_assets, batch_and_mask, tmp_path_factory):
    import torch.multiprocessing as mp

    tmp = tmp_path_factory.mktemp("hsdp")
    batch, allowed = batch_and_mask
    with mp.Manager() as manager:
        results = manager.dict()
        args = (str(tmp / "init"), str(tiny_assets.model_dir), batch, allowed, str(tmp / "ckpt"), results)
        start_ranks(_rank, args, WORLD)
        return dict(results)


def test_hybrid_sharding_shards_within_groups_and_replicates_across_them(ranks):
    for rank in range(WORLD):
        assert ranks[rank]["fsdp"]["mesh"] == (4,) and ranks[rank]["fsdp"]["placements"] == (Shard(0),)
        assert ranks[rank]["hsdp"]["mesh"] == (2, 2)
        assert ranks[rank]["hsdp"]["placements"] == (Replicate(), Shard(0))


def test_hybrid_sharding_makes_the_same_update_as_fsdp_over_all_ranks(ranks):
    fsdp, hsdp = ranks[0]["fsdp"], ranks[0]["hsdp"]
    assert fsdp["moved"] and hsdp["moved"]
    # The clipping norm is the norm of the gradient averaged over all 4 ranks' rows, and it clipped.
    assert fsdp["grad_norm"] > MAX_GRAD_NORM
    assert hsdp["grad_norm"] == pytest.approx(fsdp["grad_norm"], rel=1e-5)
    for n, w in fsdp["weights"].items():
        torch.testing.assert_close(hsdp["weights"][n], w, msg=lambda m, k=n: f"{k}: {m}")
    # Every rank, in either replica group, holds the same weights: the groups' gradients were all-reduced.
    for rank in range(1, WORLD):
        for n, w in hsdp["weights"].items():
            assert torch.equal(ranks[rank]["hsdp"]["weights"][n], w), (rank, n)


def test_hybrid_sharded_weights_stream_whole_for_the_resync(ranks):
    for rank in range(WORLD):
        assert ranks[rank]["stream_matches"], rank
        assert ranks[rank]["stream_bucketed"], rank  # gathered in buckets within a group, not tensor by tensor


def test_a_hybrid_sharded_checkpoint_loads_into_either_mesh(ranks):
    trained = ranks[0]["hsdp"]["weights"]
    for rank in range(WORLD):
        loaded = ranks[rank]["loaded"]
        assert loaded["hsdp"]["optimizer"] and loaded["hsdp"]["adam_states_equal"], rank
        for name in ("hsdp", "fsdp"):  # fsdp_size may change between a save and a resume
            for n, w in trained.items():
                assert torch.equal(loaded[name]["weights"][n], w), (rank, name, n)
