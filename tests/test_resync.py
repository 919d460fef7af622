"""The bucketed, streamed resync of the actor's weights into vLLM, and the engine's sleep/wake around it.

- Bucket plans keep the state dict's order and never mix dtypes in one all-gather.
- Over two FSDP2 ranks (gloo), the stream yields exactly the names and values
  of the whole-state-dict gather, for buckets of one tensor, a few, and all.
- Against a live in-process vLLM engine (tests/helpers/resync_check.py): a
  change to the vision tower alone shows in the next decode (a stale encoder or
  prefix cache would decode as before), and a resync back to the original
  weights decodes exactly what the fresh engine decoded on them.
- Sleep/wake order on GPU (weights, load, KV cache), none on CPU.
- The process-group backend follows the device.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.runs import REPO

from vlmrl.workers.fsdp_worker import process_group_backend
from vlmrl.workers.rollout import VLLMRollout
from vlmrl.workers.sharding_manager import plan_buckets


def test_bucket_plan_keeps_order_and_splits_on_size_and_key():
    # 40 + 40 fit in 100; 40 more would not; a 200-byte tensor gets its own bucket;
    # None (not bucketable) and another key (dtype/mesh) start new buckets.
    sizes = [("a", 40, 1), ("b", 40, 1), ("c", 40, 1), ("d", 200, 1), ("e", 8, None), ("f", 8, 1), ("g", 8, 2)]
    assert plan_buckets(sizes, 100) == [["a", "b"], ["c"], ["d"], ["e"], ["f"], ["g"]]
    assert plan_buckets(sizes, 1) == [[n] for n, _, _ in sizes]
    assert plan_buckets(sizes, 10**9) == [["a", "b", "c", "d"], ["e"], ["f"], ["g"]]
    assert plan_buckets([], 100) == []


def _two_rank_stream(rank: int, world: int, store: str, model_dir: str, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForImageTextToText

    from vlmrl.workers.sharding_manager import FSDPVLLMShardingManager

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    mesh = init_device_mesh("cpu", (world,))
    for module in model.modules():
        if type(module).__name__ in set(model._no_split_modules):
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    manager = FSDPVLLMShardingManager(model, rollout=None, rollout_dtype=torch.bfloat16)
    report = {}
    # One tensor per all-gather in the actor's dtype, 64 KiB buckets cast to bf16 before the gather, one bucket.
    for bucket_bytes, dtype in ((1, None), (64 << 10, torch.bfloat16), (1 << 40, None)):
        manager.bucket_bytes = bucket_bytes
        streamed = list(manager.stream_full_weights(dtype))
        want = {k: v if dtype is None else v.to(dtype) for k, v in full.items()}
        report[str(bucket_bytes)] = {
            "names": [n for n, _ in streamed] == list(want),
            "values": all(t.dtype == want[n].dtype and torch.equal(t, want[n]) for n, t in streamed),
            "largest_bucket": manager.largest_bucket_bytes,
        }
    report["model_bytes"] = sum(v.numel() * 4 for v in full.values())
    if rank == 0:
        Path(out).write_text(json.dumps(report))
    dist.destroy_process_group()


def test_stream_over_two_ranks_equals_the_whole_state_dict(tiny_assets, tmp_path):
    import torch.multiprocessing as mp

    out = tmp_path / "report.json"
    mp.spawn(_two_rank_stream, args=(2, str(tmp_path / "store"), str(tiny_assets.model_dir), str(out)), nprocs=2)
    report = json.loads(out.read_text())
    for key, r in report.items():
        if key != "model_bytes":
            assert r["names"] and r["values"], (key, r)
    # Bucket sizes bound what one all-gather holds: the largest tensor when each is its own bucket,
    # 64 KiB (bf16) unless one tensor is bigger, the whole fp32 model as one bucket (shards padded to equal size).
    largest_tensor = report["1"]["largest_bucket"]
    assert largest_tensor < report["model_bytes"] / 4
    assert report[str(64 << 10)]["largest_bucket"] <= max(64 << 10, largest_tensor) + 4096
    assert report[str(1 << 40)]["largest_bucket"] >= report["model_bytes"]


@pytest.fixture(scope="module")
def live_resync(tiny_assets):
    proc = subprocess.run(
        [sys.executable, "tests/helpers/resync_check.py", "check", str(tiny_assets.model_dir), str(tiny_assets.val_file)],
        cwd=REPO, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-5000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def _same(a: list[dict], b: list[dict]) -> bool:
    return all(x["ids"] == y["ids"] and x["log_probs"] == y["log_probs"] for x, y in zip(a, b, strict=True))


def test_resync_back_to_the_original_weights_decodes_exactly_as_the_fresh_engine(live_resync):
    # Three resyncs happened in between, the last one with every tensor in its own bucket.
    assert _same(live_resync["restored"], live_resync["fresh"])
    assert not _same(live_resync["all_changed"], live_resync["fresh"])  # the control: the weights did change
    assert live_resync["names_match"] and live_resync["values_match"]


def test_a_changed_vision_tower_is_not_served_from_stale_caches(live_resync):
    # Only model.visual.* changed: with the old image embeddings still cached, the same image prompts
    # would decode exactly as before. They must not.
    fresh, changed = live_resync["fresh"], live_resync["vision_changed"]
    assert all(len(x["ids"]) == len(y["ids"]) for x, y in zip(fresh, changed))
    differ = [x["log_probs"][0] != y["log_probs"][0] for x, y in zip(fresh, changed)]
    assert all(differ), differ  # even the first token, conditioned on the prompt alone
    metrics = live_resync["vision_sync"]
    assert metrics["timing_s/resync_worker"] > 0
    assert metrics["perf/resync_bucket_peak_mb"] == 0  # one rank: its shards are the tensors, nothing is gathered


class _FakeLLM:
    """Records the sleep-mode calls a VLLMRollout makes."""

    def __init__(self):
        self.calls = []
        self.llm_engine = self

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tags))

    def collective_rpc(self, method, kwargs):
        self.calls.append(("rpc", method, list(kwargs["weights_iterator"])))

    def generate(self, requests, params, use_tqdm):
        self.calls.append(("generate",))
        return []

    def reset_encoder_cache(self):
        self.calls.append(("reset_encoder_cache",))

    def reset_mm_cache(self):
        self.calls.append(("reset_mm_cache",))

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))


def _rollout(sleeps: bool) -> VLLMRollout:
    # The engine's memory handling only, without building an engine.
    rollout = object.__new__(VLLMRollout)
    rollout.llm, rollout.sleeps, rollout.freed = _FakeLLM(), sleeps, set()
    return rollout


def test_gpu_engine_sleeps_after_generating_and_wakes_weights_before_kv_cache_on_resync():
    rollout = _rollout(sleeps=True)
    rollout.wake_up()
    rollout.llm.calls.append(("generate",))
    rollout.sleep()
    rollout.load_weights(iter([("w", torch.zeros(1))]))
    rollout.wake_up()  # the next generate: already awake
    calls = [c if c[0] != "rpc" else ("rpc", c[1], [n for n, _ in c[2]]) for c in rollout.llm.calls]
    assert calls == [
        ("generate",),
        ("sleep", 1),
        ("wake_up", ["weights"]),
        ("rpc", "reload_weights", ["w"]),
        ("wake_up", ["kv_cache"]),
        ("reset_encoder_cache",),
        ("reset_mm_cache",),
        ("reset_prefix_cache",),
    ]
    # Validation or a warm-up step: a generate with no resync since the sleep wakes both at once.
    rollout.sleep()
    rollout.wake_up()
    assert rollout.llm.calls[-2:] == [("sleep", 1), ("wake_up", ["kv_cache", "weights"])]


def test_cpu_engine_never_sleeps_but_still_drops_its_caches_on_resync():
    rollout = _rollout(sleeps=False)
    rollout.sleep()
    rollout.load_weights([("w", torch.zeros(1))])
    rollout.wake_up()
    assert [c[0] for c in rollout.llm.calls] == ["rpc", "reset_encoder_cache", "reset_mm_cache", "reset_prefix_cache"]


def test_process_group_backend_follows_the_device():
    assert process_group_backend("cuda") == "nccl"
    assert process_group_backend("cpu") == "gloo"


def test_resync_config_defaults():
    from vlmrl.config import RolloutConfig

    assert RolloutConfig().free_cache_engine is True  # EasyR1/verl sleep the engine on GPU
    assert RolloutConfig().resync_bucket_mb == 512
