"""Weights to rollout servers through a weight-transfer group of their own (``vlmrl.weight_sync.collective``), on
gloo: the code that runs NCCL on GPU, here on CPU.

- Between Ray actors: a state dict of mixed dtypes and shapes (bfloat16, float32 with NaN and inf, float16 not
  contiguous, int64, a 0-d int32, bool, an empty tensor, one tensor larger than a bucket) reaches two receivers
  bit for bit, in several buckets and in order, twice through the same group; the sender's default process
  group (the trainer's FSDP group) is still the one it was, and works.
- A real ``RolloutServer`` (vLLM on the quickstart's tiny model, fp32) joins the group: after a broadcast of
  perturbed weights its greedy tokens and log-probs, on a text and an image prompt, equal those after a push of
  the same weights through the object store, and differ from the original weights'; a second broadcast of the
  original weights brings the original outputs back.
"""

from __future__ import annotations

import math
import sys

import pytest
import ray
import torch
import torch.distributed as dist
from helpers.configs import CPU, QUICKSTART
from helpers.rollout_servers import launched_server
from ray import cloudpickle
from safetensors.torch import load_file
from transformers import AutoConfig, AutoProcessor

from vlmrl.data.dataset import RLHFDataset
from vlmrl.records import PromptSample
from vlmrl.rollout.engine import InterruptMode, Sampling
from vlmrl.validate import load_config
from vlmrl.weight_sync.collective import Broadcast, WeightGroup, broadcast_weights, open_group
from vlmrl.weight_sync.object_store import push_weights

BUCKET = 4096  # bytes: the state dict below spans several buckets, and one tensor is larger than a bucket
LENGTH = 128

# The test actors below go to Ray's workers by value: those do not have this file on their path.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture(scope="module")
def config(quickstart_assets):
    return load_config([QUICKSTART, f"data.max_prompt_length={LENGTH}", f"data.max_response_length={LENGTH}"], CPU)


@pytest.fixture(scope="module")
def launched(config):
    """The rollout server, launched first and not waited on: vLLM starts while the unit test runs."""
    with launched_server(config, max_concurrency=4) as handle:
        yield handle


def _state_dict() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    special = torch.randn(7, generator=g)
    special[:3] = torch.tensor([math.nan, math.inf, -0.0])
    return {
        "a.weight": torch.randn(3, 5, generator=g).to(torch.bfloat16),
        "a.bias": special,
        "b.weight": torch.randn(4, 6, generator=g).to(torch.float16).t(),  # not contiguous
        "b.count": torch.arange(-5, 5, dtype=torch.int64).reshape(2, 5),
        "b.step": torch.tensor(7, dtype=torch.int32),  # 0-d
        "c.mask": torch.tensor([True, False, True]),
        "c.empty": torch.empty(0, 4),
        "d.large": torch.randn(40, 50, generator=g),  # 8000 bytes, in a bucket of its own
        "e.weight": torch.randn(9, 3, generator=g).to(torch.bfloat16),
    }


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


class Trainer:
    """Rank 0 of a trainer: its own default process group (as FSDP's), and the sender of the weight group."""

    def __init__(self, init_file: str):
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=0, world_size=1)
        self.group: WeightGroup | None = None

    def open(self, servers: list) -> int:
        self.group = open_group(servers, "gloo")
        return self.group.address.world_size

    def push(self, named: dict[str, torch.Tensor], servers: list, version: int) -> dict[str, float]:
        return broadcast_weights(named.items(), self.group, servers, version, bucket_bytes=BUCKET)

    def default_group(self) -> tuple[int, int, float, int]:
        """The default group's size and rank, an all-reduce over it, and how many groups torch has registered."""
        x = torch.ones(3)
        dist.all_reduce(x)
        registered = len(dist.distributed_c10d._world.pg_map)
        return dist.get_world_size(), dist.get_rank(), float(x.sum()), registered


class Receiver:
    """A stand-in rollout server: joins the group and keeps what each load receives."""

    def __init__(self):
        self.group: WeightGroup | None = None
        self.loads: list[tuple[int, list[tuple[str, torch.Tensor]]]] = []

    def join_weight_group(self, address, rank: int) -> None:
        self.group = WeightGroup(address, rank)

    def load_weights(self, weights: Broadcast, version: int, interrupt: str) -> None:
        assert weights.group == self.group.address and interrupt == "continue"
        self.loads.append((version, [(n, t.clone()) for n, t in self.group.receive()]))

    def received(self) -> list[tuple[int, list[tuple[str, torch.Tensor]]]]:
        return self.loads


def test_a_broadcast_carries_mixed_dtypes_bit_exact_in_buckets_beside_the_default_group(launched, tmp_path):
    trainer = ray.remote(num_cpus=0)(Trainer).remote(str(tmp_path / "default_group"))
    receivers = [ray.remote(num_cpus=0)(Receiver).remote() for _ in range(2)]
    try:
        before = ray.get(trainer.default_group.remote())
        assert before[:3] == (1, 0, 3.0)
        assert ray.get(trainer.open.remote(receivers), timeout=120) == 3

        sent = _state_dict()
        metrics = ray.get(trainer.push.remote(sent, receivers, 1), timeout=120)
        flipped = {k: -t if t.is_floating_point() else t for k, t in sent.items()}
        ray.get(trainer.push.remote(flipped, receivers, 2), timeout=120)

        assert metrics["perf/resync_buckets"] == 3  # the small tensors; d.large alone; e.weight
        assert metrics["perf/resync_mb"] * 2**20 == sum(t.numel() * t.element_size() for t in sent.values())
        for loads in ray.get([r.received.remote() for r in receivers]):
            assert [version for version, _ in loads] == [1, 2]
            for (_, named), expected in zip(loads, [sent, flipped], strict=True):
                assert [n for n, _ in named] == list(expected)  # in the sender's order
                for name, tensor in named:
                    assert _same_bits(tensor, expected[name]), name
        # The trainer's default group is the one it was: same size and rank, nothing registered beside it.
        assert ray.get(trainer.default_group.remote()) == before
    finally:
        for actor in [trainer, *receivers]:
            ray.kill(actor)


# ---------------------------------------------------------------- a real rollout server


def _prompts(config, model_dir: str, train_file: str) -> list[PromptSample]:
    """A text prompt and an image prompt of the quickstart's data."""
    processor = AutoProcessor.from_pretrained(model_dir)
    ids = processor.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name a colour."}], add_generation_prompt=True, tokenize=True
    )
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    text = PromptSample(
        index=0, raw_prompt_ids=ids, input_ids=ids, images=[], mm_inputs={}, ground_truth="", data_source="",
        prompt_text="", position_ids=torch.arange(len(ids)).expand(3, len(ids)).clone(),
    )  # fmt: skip
    data = RLHFDataset(
        train_file, processor, prompt_key="problem", answer_key="answer", image_key="images",
        image_dir=None, max_prompt_length=LENGTH, min_pixels=config.data.min_pixels,
        max_pixels=config.data.max_pixels, model_config=AutoConfig.from_pretrained(model_dir),
    )  # fmt: skip
    return [text, data[0]]


def _hf_names(checkpoint: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tiny model's saved weights under the names the trainer sends (transformers 5's ``model.visual.*``,
    ``model.language_model.*``; the file keeps the older ``visual.*``, ``model.*``), without building the model."""
    named = {}
    for name, tensor in checkpoint.items():
        if name.startswith("visual."):
            name = f"model.{name}"
        elif name.startswith("model.") and not name.startswith(("model.visual.", "model.language_model.")):
            name = f"model.language_model.{name.removeprefix('model.')}"
        named[name] = tensor
    return named


def _greedy(server, prompts) -> tuple[list[list[int]], list[list[float]]]:
    sampling = Sampling(n=1, temperature=0.0, max_tokens=24, ignore_eos=True, want_log_probs=True)
    trajectories, _, _ = ray.get(server.generate.remote(prompts, list(range(len(prompts))), sampling), timeout=120)
    return [t.token_ids for t in trajectories], [list(t.log_probs[t.prompt_length :]) for t in trajectories]


def test_a_server_that_got_the_weights_by_broadcast_samples_as_after_the_object_store(
    launched, config, quickstart_assets
):
    model_dir = config.worker.actor.model.model_path
    weights = _hf_names(load_file(f"{model_dir}/model.safetensors"))
    g = torch.Generator().manual_seed(0)
    perturbed = {  # the decoder layers' and the vision blocks' matrices with a little noise
        k: t + 0.05 * t.std() * torch.randn(t.shape, generator=g) if ".layers." in k or ".blocks." in k else t
        for k, t in weights.items()
    }
    prompts = _prompts(config, model_dir, str(quickstart_assets.train_file))
    server = launched
    assert ray.get(server.version.remote(), timeout=300) == 0
    group = open_group([server], "gloo")
    original = _greedy(server, prompts)

    metrics = broadcast_weights(perturbed.items(), group, [server], 1, InterruptMode.refuse, bucket_bytes=1 << 20)
    assert metrics["perf/resync_buckets"] > 1 and ray.get(server.version.remote()) == 1
    by_broadcast = _greedy(server, prompts)
    assert by_broadcast[0] != original[0] or by_broadcast[1] != original[1]

    push_weights(weights.items(), [server], 2, InterruptMode.refuse)
    assert _greedy(server, prompts) == original
    push_weights(perturbed.items(), [server], 3, InterruptMode.refuse, bucket_bytes=1 << 20)
    assert _greedy(server, prompts) == by_broadcast  # the same tokens and the same log-probs, exactly

    broadcast_weights(weights.items(), group, [server], 4, InterruptMode.refuse)  # the group serves every sync
    assert ray.get(server.version.remote()) == 4 and _greedy(server, prompts) == original
