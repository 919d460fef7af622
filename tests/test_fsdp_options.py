"""The FSDP memory options change where tensors live, not what trains.

Each option shards the tiny Qwen2.5-VL with FSDP2 on a one-rank gloo group in
this process (the worker's ``shard`` with the option's ``ShardOptions``) and
runs two real policy updates (AdamW) on a batch of image prompts; the losses,
gradient norms and weights must equal the default's within fp32 tolerance.
Mixed precision computes in bf16 and keeps fp32 master weights. A two-rank
run (torch.multiprocessing) checks the options and a bf16 gradient reduction
over gloo, where the reduce-scatter really crosses processes.
"""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from transformers import AutoModelForImageTextToText, AutoProcessor

from helpers.trajectories import Response, batch_of
from helpers.ranks import start_ranks
from vlmrl.config import Config, DType, FSDPConfig, OffloadConfig
from vlmrl.data.dataset import RLHFDataset
from vlmrl.algos import KLEstimator, LossAvgMode, PolicyLossParams, PolicyLossType
from vlmrl.train.actor import UpdateSettings, compute_log_probs, update_policy
from vlmrl.train.micro_batches import MicroBatching
from vlmrl.train.fsdp_options import (
    Offloader,
    ShardOptions,
    move_model,
    move_optimizer_states,
    offloaders,
    shard,
    with_host_collectives,
)
from vlmrl.rollout.engine.sampling import sampling_mask
from vlmrl.models.qwen_vision import SPECIAL_TOKENS as QWEN_MARKERS

PROMPTS, N, RESPONSE = 1, 2, 5
SETTINGS = UpdateSettings(
    samples_per_update=PROMPTS * N,
    micro_batch_size=1,
    ppo_epochs=1,
    loss_type=PolicyLossType.default,
    loss_params=PolicyLossParams(
        clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_dual=3.0, loss_avg_mode=LossAvgMode.token_mean
    ),
    max_grad_norm=1e9,  # no clipping: the gradients left on the parameters are the raw ones
    entropy_coeff=0.0,
    use_kl_loss=False,
    kl_estimator=KLEstimator.low_var_kl,
    kl_coef=0.0,

)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def mesh():
    """A one-rank gloo group for this module (the group another module left, if any)."""
    own = not dist.is_initialized()
    if own:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    if own:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def batch_and_mask(tiny_assets):
    """Image prompts with ragged responses, old log-probs off the model's own and random advantages."""
    processor = AutoProcessor.from_pretrained(tiny_assets.model_dir)
    model = load(tiny_assets)
    dataset = RLHFDataset(
        str(tiny_assets.train_file), processor, prompt_key="problem", answer_key="answer", image_key="images",
        image_dir=None, max_prompt_length=128, min_pixels=3136, max_pixels=12544, filter_overlong_prompts=False,
    )  # fmt: skip
    allowed = sampling_mask(processor.tokenizer, model.config.get_text_config().vocab_size, QWEN_MARKERS)
    allowed_ids = allowed.nonzero().flatten()
    gen = torch.Generator().manual_seed(0)
    lengths = [5, 2]
    generations = [
        Response(dataset[i], i, allowed_ids[torch.randint(len(allowed_ids), (lengths[i * N + k],), generator=gen)].tolist(), "", None)
        for i in range(PROMPTS)
        for k in range(N)
    ]  # fmt: skip
    batch = batch_of(
        generations, max_prompt_length=128, max_response_length=RESPONSE,
        pad_token_id=processor.tokenizer.pad_token_id,
    )  # fmt: skip
    log_probs, _ = compute_log_probs(model, batch, MicroBatching(8), allowed)
    batch.old_log_probs = log_probs + 0.3 * torch.randn(log_probs.shape, generator=gen)
    batch.advantages = torch.randn(len(batch), 1, generator=gen).expand(-1, RESPONSE) * batch.response_mask
    return batch, allowed


def load(tiny_assets) -> torch.nn.Module:
    return AutoModelForImageTextToText.from_pretrained(tiny_assets.model_dir, dtype=torch.float32)


def sharded(tiny_assets, mesh, fsdp: FSDPConfig) -> torch.nn.Module:
    model = load(tiny_assets)
    return shard(model, list(model._no_split_modules), mesh, ShardOptions.from_config(fsdp, "cpu"))


def adamw(model: torch.nn.Module) -> torch.optim.AdamW:
    # As the worker builds it: the trainable parameters only.
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, weight_decay=1e-2)


def local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()


def train(model, batch_and_mask, between=None, steps=2):
    """``steps`` updates; ``between(model, optimizer)`` runs after each (an offload round trip)."""
    batch, allowed = batch_and_mask
    optimizer = adamw(model)
    metrics = []
    for _ in range(steps):
        metrics.append(update_policy(model, optimizer, batch, SETTINGS, allowed).metrics)
        if between is not None:
            between(model, optimizer)
    weights = {name: local(p) for name, p in model.named_parameters()}
    grads = {name: local(p.grad) for name, p in model.named_parameters() if p.grad is not None}
    return metrics, weights, grads


def assert_same_training(got, want):
    (got_metrics, got_weights, got_grads), (want_metrics, want_weights, want_grads) = got, want
    for g, w in zip(got_metrics, want_metrics):
        for key in ("actor/pg_loss", "actor/grad_norm"):
            assert g[key] == pytest.approx(w[key], rel=1e-5), key
    assert got_weights.keys() == want_weights.keys() and got_grads.keys() == want_grads.keys()
    for name, w in want_weights.items():
        torch.testing.assert_close(got_weights[name], w, msg=lambda m, n=name: f"{n}: {m}")
    for name, g in want_grads.items():
        torch.testing.assert_close(got_grads[name], g, msg=lambda m, n=name: f"{n}: {m}")


@pytest.fixture(scope="module")
def default_training(tiny_assets, mesh, batch_and_mask):
    model = sharded(tiny_assets, mesh, FSDPConfig())
    initial = {name: local(p) for name, p in model.named_parameters()}
    result = train(model, batch_and_mask)
    assert any(not torch.equal(initial[n], w) for n, w in result[1].items())  # the updates moved the weights
    return result


# ------------------------------------------------------------------ two ranks (first: no group yet)


def _two_rank_worker(rank: int, init_file: str, model_dir: str, results: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(10, 200, (2, 24), generator=gen)[rank : rank + 1]  # each rank its own row
    variants = {
        "default": FSDPConfig(),
        "no_full_shard": FSDPConfig(enable_full_shard=False),
        "cpu_offload_policy": FSDPConfig(enable_cpu_offload=True),
        "bf16_reduce_bf16": FSDPConfig(mp_param_dtype=DType("bf16"), mp_reduce_dtype=DType("bf16")),
    }
    out = {}
    for name, fsdp in variants.items():
        model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
        shard(model, list(model._no_split_modules), mesh, ShardOptions.from_config(fsdp, "cpu"))
        optimizer = adamw(model)
        losses = []
        for _ in range(2):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        weights = {n: p.full_tensor().detach() for n, p in model.named_parameters()}  # collective
        out[name] = (losses, weights, {p.dtype for p in model.parameters()})
    results[rank] = out
    dist.destroy_process_group()


def test_two_ranks_train_alike_under_each_option(tiny_assets, tmp_path):
    """Two gloo ranks: real reduce-scatters, also in bf16 (measured: gloo reduces bf16 on CPU)."""
    import torch.multiprocessing as mp

    with mp.Manager() as manager:
        results = manager.dict()
        args = (str(tmp_path / "init"), str(tiny_assets.model_dir), results)
        start_ranks(_two_rank_worker, args, 2)
        results = dict(results)
    for rank in (0, 1):
        losses, weights, _ = results[rank]["default"]
        for name in ("no_full_shard", "cpu_offload_policy"):
            got_losses, got_weights, _ = results[rank][name]
            assert got_losses == pytest.approx(losses, rel=1e-6), name
            for n, w in weights.items():
                torch.testing.assert_close(got_weights[n], w, msg=lambda m, k=n, v=name: f"{v} {k}: {m}")
        bf16_losses, _, bf16_dtypes = results[rank]["bf16_reduce_bf16"]
        assert bf16_dtypes == {torch.float32}
        assert bf16_losses == pytest.approx(losses, rel=0.02)
        assert bf16_losses != losses
    # The ranks saw different rows, yet hold the same full weights: the gradients were reduced across them.
    for name in ("default", "bf16_reduce_bf16"):
        for n, w in results[0][name][1].items():
            assert torch.equal(w, results[1][name][1][n]), (name, n)
    assert results[0]["default"][0] != results[1]["default"][0]


# ------------------------------------------------------------------ one rank, in this process


def test_options_map_to_fully_shard_arguments():
    default = ShardOptions.from_config(FSDPConfig(), "cuda")
    assert default.fully_shard_kwargs()["reshard_after_forward"] is True
    assert type(default.offload_policy).__name__ == "OffloadPolicy"  # FSDP2's "no offload"
    assert default.mp_policy.param_dtype is None and default.buffer_dtype is None
    fsdp = FSDPConfig(
        enable_full_shard=False, enable_cpu_offload=True, mp_param_dtype=DType("bf16"),
        mp_reduce_dtype=DType("fp32"), mp_buffer_dtype=DType("fp32"),
    )  # fmt: skip
    gpu, cpu = ShardOptions.from_config(fsdp, "cuda"), ShardOptions.from_config(fsdp, "cpu")
    assert gpu.reshard_after_forward is False
    assert (gpu.mp_policy.param_dtype, gpu.mp_policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert gpu.buffer_dtype is torch.float32
    assert type(gpu.offload_policy).__name__ == "CPUOffloadPolicy"
    # Pinned memory needs an accelerator: pinned on CUDA, plain host memory on CPU.
    assert (gpu.offload_policy.pin_memory, cpu.offload_policy.pin_memory) == (True, False)


def test_fsdp_cpu_offload_on_nccl_adds_gloo_for_the_host_memory_collectives():
    # Clipping all-reduces the norm of host-memory gradients; NCCL has no CPU backend.
    offload = Config()
    offload.worker.critic.fsdp.enable_cpu_offload = True
    assert with_host_collectives("nccl", offload) == "cpu:gloo,cuda:nccl"
    assert with_host_collectives("nccl", Config()) == "nccl"
    assert with_host_collectives("gloo", offload) == "gloo"


def test_no_full_shard_keeps_the_gathered_parameters_from_forward_to_backward(tiny_assets, mesh, batch_and_mask):
    batch, _ = batch_and_mask
    ids = batch.input_ids[:, -8:]  # text only: the vision tower's units do not run
    for full_shard, between_passes in ((True, DTensor), (False, torch.nn.Parameter)):
        model = sharded(tiny_assets, mesh, FSDPConfig(enable_full_shard=full_shard))
        layer = model.model.language_model.layers[0]
        loss = model(input_ids=ids).logits.float().mean()
        held = layer.self_attn.q_proj.weight
        assert type(held) is between_passes, (full_shard, type(held))
        loss.backward()
        assert isinstance(layer.self_attn.q_proj.weight, DTensor)  # after the backward, sharded either way


@pytest.mark.parametrize(
    "fsdp",
    [FSDPConfig(enable_full_shard=False), FSDPConfig(enable_cpu_offload=True)],
    ids=["no_full_shard", "cpu_offload_policy"],
)
def test_option_trains_like_the_default(tiny_assets, mesh, batch_and_mask, default_training, fsdp):
    model = sharded(tiny_assets, mesh, fsdp)
    assert_same_training(train(model, batch_and_mask), default_training)


def test_offload_round_trips_are_exact_and_training_is_unchanged(tiny_assets, mesh, batch_and_mask, default_training):
    """Parameters and Adam's states to host memory and back between updates (what the worker does on a GPU).

    On this CPU machine the "device" is the host: the model's move is FSDP2's
    reshard and re-registration around an identity copy, while the optimizer's
    states are really copied into new storage, so their hand-over is tested.
    """
    moved = []

    def round_trip(model, optimizer):
        before = [dict(s) for s in optimizer.state.values()]  # the tensors themselves, so no address is reused
        for device in ("cpu", "cpu"):  # offload, then load back
            move_model(model, device)
            move_optimizer_states(optimizer, device)
        after = list(optimizer.state.values())
        for b, a in zip(before, after):
            old, new = local(b["exp_avg"]), a["exp_avg"].to_local()
            assert new.untyped_storage().data_ptr() != b["exp_avg"].to_local().untyped_storage().data_ptr()
            for key in b:
                assert torch.equal(local(a[key]), local(b[key])), key  # bit-identical
            assert torch.equal(new, old)
        assert all(isinstance(p, DTensor) for p in model.parameters())  # still FSDP2's sharded parameters
        moved.append(len(after))

    result = train(sharded(tiny_assets, mesh, FSDPConfig()), batch_and_mask, between=round_trip)
    assert moved and moved[0] == len(list(result[1]))  # every parameter's state went and came back
    assert_same_training(result, default_training)


def test_offloader_moves_once_per_outermost_pass_and_is_a_no_op_on_cpu(tiny_assets, mesh):
    model = sharded(tiny_assets, mesh, FSDPConfig())
    optimizer = adamw(model)
    model(input_ids=torch.tensor([[1, 2, 3]])).logits.mean().backward()
    optimizer.step()

    def states():
        return [s["exp_avg"] for s in optimizer.state.values()]

    def same(a, b):
        return all(x is y for x, y in zip(a, b, strict=True))

    # Forced on, with the host as the device: every real move makes new tensors, so the moves can be seen.
    offloader = Offloader(lambda device: move_optimizer_states(optimizer, device), "cpu", enabled=True)
    start = states()
    with offloader.on_device():
        loaded = states()
        assert not any(x is y for x, y in zip(loaded, start))  # moved in: new tensors
        with offloader.on_device():  # nested (a checkpoint load that resyncs): no move in or out
            assert same(states(), loaded)
        assert same(states(), loaded)
    assert not any(x is y for x, y in zip(states(), loaded))  # offloaded when the outermost pass ended

    # What the worker builds on a CPU device: offload.* asks for moves, but there is nowhere else to put things.
    parts = offloaders("actor", model, optimizer, OffloadConfig(True, True), FSDPConfig(), "cpu")
    assert set(parts) == {"actor", "actor_optimizer"} and not any(p.enabled for p in parts.values())
    on_gpu = offloaders("actor", model, optimizer, OffloadConfig(True, True), FSDPConfig(), "cuda")
    assert all(p.enabled for p in on_gpu.values())
    under_fsdp_offload = offloaders(
        "actor", model, optimizer, OffloadConfig(True, True), FSDPConfig(enable_cpu_offload=True), "cuda"
    )
    assert not any(p.enabled for p in under_fsdp_offload.values())  # the shards already live on the host
    before = states()
    for part in parts.values():
        part.offload()
        with part.on_device():
            pass
    assert same(states(), before)


def test_mixed_precision_computes_in_bf16_and_keeps_fp32_master_weights(
    tiny_assets, mesh, batch_and_mask, default_training
):
    fsdp = FSDPConfig(mp_param_dtype=DType("bf16"), mp_reduce_dtype=DType("fp32"), mp_buffer_dtype=DType("fp32"))
    model = sharded(tiny_assets, mesh, fsdp)
    seen = {}

    def record(module, args, output):
        seen["weight"], seen["input"], seen["output"] = module.weight.dtype, args[0].dtype, output.dtype

    hook = model.model.language_model.layers[0].mlp.down_proj.register_forward_hook(record)
    metrics, weights, grads = train(model, batch_and_mask)
    hook.remove()
    assert seen == {"weight": torch.bfloat16, "input": torch.bfloat16, "output": torch.bfloat16}
    assert all(p.dtype is torch.float32 for p in model.parameters())  # the master copy the optimizer steps
    assert all(g.dtype is torch.float32 for g in grads.values())
    optimizer_dtypes = {v.dtype for s in adamw(model).state.values() for v in s.values()}
    assert optimizer_dtypes <= {torch.float32}
    want_metrics, want_weights, _ = default_training
    # bf16 compute: the same training within bf16's precision, not fp32's.
    for got, want in zip(metrics, want_metrics):
        assert got["actor/pg_loss"] == pytest.approx(want["actor/pg_loss"], rel=0.05, abs=1e-3)
    moved = [n for n, w in weights.items() if not torch.equal(w, want_weights[n])]
    assert moved  # not silently the fp32 run
    # Adam moves a weight by about lr (1e-3) per step whatever its gradient's size, so where bf16 flips the
    # sign of a tiny gradient the two runs part by up to ~2 lr a step; on average they stay far closer.
    diffs = torch.cat([(weights[n] - w).abs().flatten() for n, w in want_weights.items()])
    assert diffs.max() < 4 * 2e-3 and diffs.mean() < 1e-4, (diffs.max(), diffs.mean())


def test_buffer_dtype_casts_the_rotary_tables(tiny_assets, mesh):
    model = sharded(tiny_assets, mesh, FSDPConfig(mp_buffer_dtype=DType("bf16")))
    assert {b.dtype for b in model.buffers()} == {torch.bfloat16}
    assert all(p.dtype is torch.float32 for p in model.parameters())


def test_frozen_vision_tower_keeps_its_weights(tiny_assets, mesh, batch_and_mask):
    model = sharded(tiny_assets, mesh, FSDPConfig())
    for p in model.model.visual.parameters():  # as the worker does for model.freeze_vision_tower
        p.requires_grad_(False)
    visual = {n: local(p) for n, p in model.model.visual.named_parameters()}
    language = {n: local(p) for n, p in model.model.language_model.named_parameters()}
    train(model, batch_and_mask, steps=1)
    assert all(torch.equal(local(p), visual[n]) for n, p in model.model.visual.named_parameters())
    assert all(p.grad is None for p in model.model.visual.parameters())
    assert any(not torch.equal(local(p), language[n]) for n, p in model.model.language_model.named_parameters())


def test_gradient_checkpointing_gives_the_same_gradients(tiny_assets, mesh, batch_and_mask, default_training):
    model = sharded(tiny_assets, mesh, FSDPConfig())
    model.gradient_checkpointing_enable()  # as the worker does for model.enable_gradient_checkpointing
    layer, calls = model.model.language_model.layers[0], []
    forward = layer.forward

    def counted(*args, **kwargs):  # the recomputation calls forward without module hooks, so count calls here
        calls.append(1)
        return forward(*args, **kwargs)

    layer.forward = counted
    result = train(model, batch_and_mask)
    # Two updates of 2 micro-batches; checkpointing runs each layer's forward again in the backward.
    assert len(calls) == 2 * 2 * 2
    assert_same_training(result, default_training)


def test_shared_prompts_train_like_the_full_padded_passes(tiny_assets, mesh, batch_and_mask, monkeypatch):
    """``share_prompts`` runs the prompt and the responses as two forwards of the sharded model before one
    backward: FSDP2 must gather for both and reduce the gradient both contribute to the prompt's states."""
    import dataclasses

    from helpers.tiny_families import count_prompt_passes

    prompt_passes = count_prompt_passes(monkeypatch)
    both = dataclasses.replace(SETTINGS, micro_batch_size=PROMPTS * N)  # the rows of the prompt together
    results = {}
    for share in (False, True):
        model = sharded(tiny_assets, mesh, FSDPConfig())
        batch, allowed = batch_and_mask
        optimizer = adamw(model)
        settings = dataclasses.replace(both, share_prompts=share)
        metrics = update_policy(model, optimizer, batch, settings, allowed).metrics
        grads = {name: local(p.grad) for name, p in model.named_parameters() if p.grad is not None}
        results[share] = (metrics, grads)
    assert prompt_passes == [PROMPTS]  # shared only when asked: the one prompt once
    # The gradients of one update: the same sums in another order, so equal to float rounding. (Not the weights
    # after AdamW, whose first steps are about lr x sign(gradient): a near-zero gradient's rounding moves them.)
    (shared_metrics, shared_grads), (full_metrics, full_grads) = results[True], results[False]
    assert shared_metrics["actor/pg_loss"] == pytest.approx(full_metrics["actor/pg_loss"], rel=1e-5)
    assert shared_metrics["actor/grad_norm"] == pytest.approx(full_metrics["actor/grad_norm"], rel=1e-5)
    assert shared_grads.keys() == full_grads.keys() and any(g.abs().sum() > 0 for g in full_grads.values())
    for name, g in full_grads.items():
        # Against each tensor's largest entry: an embedding row a prompt token and a response token both reach
        # sums gradients of opposite sign, and its few cancelling entries carry the rounding (measured: at most
        # 4e-6 of the largest entry, in any tensor).
        error = float((shared_grads[name] - g).abs().max())
        assert error <= 1e-5 * float(g.abs().max()), (name, error, float(g.abs().max()))
