"""Two FSDP ranks equal one process, for the families with their own code paths: GLM-4.1V, Qwen3-VL-MoE, Qwen3.5
and Qwen3.5-MoE (the tiny models, loaded as the trainer loads them, ``vlmrl.train.models.load_pretrained``).

Two gloo ranks each take one row of a batch and shard the model with FSDP2 as the actor does (one unit per
``_no_split_modules`` class: decoder layers, vision blocks); the gradients they reduce equal the gradients of one
unsharded model on both rows. The Qwen2.5-VL actor is held to the same in ``tests/test_fsdp_options.py`` and end
to end in ``tests/test_multi_worker.py``.
"""

from __future__ import annotations


import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from helpers.ranks import start_ranks
from vlmrl.testing.tiny_qwen3_5 import build_tiny_qwen3_5_family
from vlmrl.testing.tiny_vlm import build_tiny_vlm
from vlmrl.train.fsdp_options import ShardOptions, shard
from vlmrl.train.models import load_pretrained

FAMILIES = ("glm4v", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")
ROWS, LENGTH = 2, 24


def _rows() -> torch.Tensor:
    """Two text rows of equal length (ordinary tokens of every tiny vocabulary), the same on every rank."""
    return torch.randint(10, 200, (ROWS, LENGTH), generator=torch.Generator().manual_seed(3))


def _loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    # The mean next-token loss over the rows' tokens. The rows are of equal length, so the mean over both rows is
    # the mean of the two rows' means: what FSDP's averaged gradient of one row per rank computes.
    return model(input_ids=ids, labels=ids).loss


def _two_rank_worker(rank: int, init_file: str, model_dirs: dict, results: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    out = {}
    for name, path in model_dirs.items():
        model = load_pretrained(path, torch.float32, trust_remote_code=False)
        shard(model, list(model._no_split_modules), mesh, ShardOptions())
        _loss(model, _rows()[rank : rank + 1]).backward()
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}  # collective
        if rank == 0:
            out[name] = grads
    if rank == 0:
        results.update(out)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("two-ranks")
    build = {"glm4v": build_tiny_vlm, "qwen3_vl_moe": build_tiny_vlm}
    return {f: str(build.get(f, build_tiny_qwen3_5_family)(root / f, f)) for f in FAMILIES}


@pytest.fixture(scope="module")
def two_rank_grads(model_dirs, tmp_path_factory):
    import torch.multiprocessing as mp

    with mp.Manager() as manager:
        results = manager.dict()
        args = (str(tmp_path_factory.mktemp("init") / "store"), model_dirs, results)
        start_ranks(_two_rank_worker, args, 2)
        return dict(results)


@pytest.mark.parametrize("name", FAMILIES)
def test_two_fsdp_ranks_reduce_the_gradients_of_one_process(model_dirs, two_rank_grads, name):
    model = load_pretrained(model_dirs[name], torch.float32, trust_remote_code=False)
    _loss(model, _rows()).backward()
    want = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    got = two_rank_grads[name]
    assert got.keys() == want.keys() and want
    assert any("experts" in n for n in want) == ("moe" in name)  # the routed experts are sharded and reduced too
    for n, g in want.items():
        # float32 sums in another order: measured at most 1e-7 apart; row 0's gradient alone is 0.2-0.5 away.
        torch.testing.assert_close(got[n], g, atol=1e-6, rtol=1e-4, msg=lambda m, k=n: f"{name} {k}: {m}")
