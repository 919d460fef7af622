"""The streamed resync against a live in-process vLLM engine per FSDP2 rank, as the workers do it.

Run as a subprocess (the engine patches torch's thread settings process-wide).

    python tests/helpers/resync_check.py check MODEL_DIR DATA_FILE
        The engine starts on TARGET, a copy of MODEL_DIR with every weight
        changed, and greedy-decodes image rows; the actor starts on MODEL_DIR.
        Then: resync the actor into the engine and decode; change the actor's
        vision tower only, resync and decode (a stale encoder or prefix cache
        would decode as before); give the actor TARGET's weights and resync
        with tiny buckets (every tensor its own all-gather): that must decode
        exactly what the engine decoded when it was fresh on TARGET, and a
        tensor the resync skipped would still hold MODEL_DIR's value.
        Prints RESULT {json}.

    python tests/helpers/resync_check.py measure MODEL_DIR BUCKET_MB [REPEATS] [RANKS]
        Seconds and peak extra resident memory of a resync on RANKS ranks (default 1),
        each with its engine: the old whole state dict (get_model_state_dict, then
        one list) against the stream; and what two partial reload_weights calls
        do compared to one. Prints RESULT {json} (rank 0's; the memory is the
        largest rank's).
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from transformers import AutoModelForImageTextToText, AutoProcessor

from vlmrl.validate import load_config
from vlmrl.testing.resolvers import register_resolvers

register_resolvers()  # run as its own process: quickstart.yaml names its model and data as ${tiny:...}
from vlmrl.data.dataset import RLHFDataset
from vlmrl.rollout.engine import Sampling
from vlmrl.rollout.engine.sampling import sampling_mask, seeded_requests
from vlmrl.models.qwen_vision import SPECIAL_TOKENS as QWEN_MARKERS
from vlmrl.rollout.engine.vllm import VLLMEngine
from vlmrl.weight_sync import EngineSink, WeightSync

RESPONSE = 6


def setup(model_dir, max_model_len, min_pixels, max_pixels, rank=0, world=1, store=None, engine_dir=None):
    store = store or Path(tempfile.mkdtemp()) / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    for module in model.modules():  # one FSDP unit per decoder layer and vision block, as the workers shard
        if type(module).__name__ in set(model._no_split_modules or []):
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    processor = AutoProcessor.from_pretrained(model_dir)
    allowed = sampling_mask(processor.tokenizer, model.config.get_text_config().vocab_size, QWEN_MARKERS)
    rollout = VLLMEngine(
        str(engine_dir or model_dir), dtype="float32", seed=0, max_model_len=max_model_len, max_num_batched_tokens=max_model_len,
        enforce_eager=True, gpu_memory_utilization=0.5, cpu_kvcache_space_gb=1, min_pixels=min_pixels,
        max_pixels=max_pixels, allowed_tokens=allowed,
    )  # fmt: skip
    return model, processor, rollout


@torch.no_grad()
def perturb(model: torch.nn.Module, prefix: str, scale: float, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.startswith(prefix):
            local = p.to_local() if isinstance(p, DTensor) else p.data
            # Relative to the tensor's size, so that norm weights (all ones, std 0) change as much as the rest.
            local.add_(scale * local.abs().mean() * torch.randn(local.shape, generator=gen))


def write_target(model_dir: str, out: Path) -> None:
    """``model_dir`` with every weight changed, as a model directory vLLM loads."""
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    perturb(model, "", 0.5, seed=2)
    model.save_pretrained(out)
    for f in Path(model_dir).iterdir():  # tokenizer, processor and chat template
        if f.is_file() and not (out / f.name).exists():
            shutil.copy(f, out / f.name)


def check(model_dir: str, data_file: str) -> dict:
    data = load_config(["config=examples/quickstart.yaml"]).data
    target_dir = Path(tempfile.mkdtemp()) / "target"
    write_target(model_dir, target_dir)
    model, processor, rollout = setup(model_dir, 512, data.min_pixels, data.max_pixels, engine_dir=target_dir)
    dataset = RLHFDataset(
        data_file, processor, prompt_key=data.prompt_key, answer_key=data.answer_key, image_key=data.image_key,
        image_dir=None, max_prompt_length=data.max_prompt_length, min_pixels=data.min_pixels,
        max_pixels=data.max_pixels, format_prompt=data.format_prompt,
    )  # fmt: skip
    prompts = [dataset.sample(i) for i in range(4)]
    greedy = Sampling(n=1, temperature=0.0, max_tokens=RESPONSE, want_log_probs=True)

    def decode() -> list[dict]:
        out = rollout.generate(seeded_requests(prompts, list(range(len(prompts))), greedy, rollout.seed))
        return [{"ids": s.token_ids, "log_probs": s.log_probs} for o in out for s in o.samples]

    sync = WeightSync(model, EngineSink(rollout), torch.float32, bucket_bytes=64 << 10)
    result = {"fresh_target": decode()}
    sync.sync(1)
    result["actor"] = decode()
    perturb(model, "model.visual.", 0.5, seed=1)
    result["vision_sync"] = sync.sync(2)
    result["vision_changed"] = decode()
    target = AutoModelForImageTextToText.from_pretrained(target_dir, dtype=torch.float32).state_dict()
    with torch.no_grad():
        for k, v in model.state_dict().items():
            v.to_local().copy_(target[k])
    sync.gather.bucket_bytes = 1  # every tensor its own bucket
    sync.sync(3)
    result["synced_target"] = decode()
    result["version"] = rollout.version
    # The stream names what the whole-state-dict gather names, with the same values.
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    streamed = list(sync.gather.stream())
    result["names_match"] = [n for n, _ in streamed] == list(full)
    result["values_match"] = all(torch.equal(t, full[n]) for n, t in streamed)
    return result


class PeakRSS:
    """Peak resident memory while the block runs, above what it was at the start (sampled every 0.2 ms)."""

    def __enter__(self):
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # what earlier blocks freed goes back to the OS first
        self.start, self.peak, self.done = self.rss(), 0, False
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()
        return self

    @staticmethod
    def rss() -> int:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _poll(self):
        while not self.done:
            self.peak = max(self.peak, self.rss())
            time.sleep(0.0002)

    def __exit__(self, *exc):
        self.done = True
        self.thread.join()
        self.peak = max(self.peak, self.rss())
        self.extra_mb = (self.peak - self.start) / 2**20


def measure(rank: int, world: int, store: str, model_dir: str, bucket_mb: float, repeats: int) -> None:
    model, _, rollout = setup(model_dir, 256, 3136, 12544, rank, world, store)
    size_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20  # DTensor: global numel
    sync = WeightSync(model, EngineSink(rollout), torch.float32, bucket_bytes=int(bucket_mb * 2**20))
    versions = iter(range(1, 1 << 30))

    def whole():
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        rollout.load_weights([(n, t.to(torch.float32)) for n, t in state.items()], next(versions))

    rows: dict[str, list] = {"whole": [], "stream": []}
    for _ in range(repeats):
        for name, run in (("whole", whole), ("stream", lambda: sync.sync(next(versions)))):
            start = time.perf_counter()
            with PeakRSS() as peak:
                run()
            rows[name].append((time.perf_counter() - start, peak.extra_mb))

    def median(xs):
        return sorted(xs)[len(xs) // 2]

    extra = torch.tensor([median([r[1] for r in rows[k]]) for k in ("whole", "stream")], dtype=torch.float64)
    dist.all_reduce(extra, op=dist.ReduceOp.MAX)  # the largest rank's
    result = {
        "ranks": world,
        "model_mb": size_mb,
        "bucket_mb": bucket_mb,
        "largest_bucket_mb": sync.gather.largest_bucket_bytes / 2**20,
        **{f"{k}_seconds": median([r[0] for r in v]) for k, v in rows.items()},
        "whole_extra_rss_mb": float(extra[0]),
        "stream_extra_rss_mb": float(extra[1]),
    }
    # Two partial reload_weights calls, split inside a decoder layer, against one call with the same weights.
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=0)
    probe = [{"prompt_token_ids": list(range(10, 30))}]

    def greedy():
        out = rollout.llm.generate(probe, params, use_tqdm=False)[0].outputs[0]
        return list(out.token_ids), [lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids)]

    perturb(model, "", 0.5, seed=3)
    target = [(n, t.clone()) for n, t in sync.gather.stream(torch.float32)]
    sync.sync(next(versions))
    one_call = greedy()
    perturb(model, "", 0.5, seed=4)
    sync.sync(next(versions))  # the engine now holds other weights
    split = next(i for i, (n, _) in enumerate(target) if "language_model" in n and n.endswith("k_proj.weight"))
    rollout.load_weights(target[:split], next(versions))
    rollout.load_weights(target[split:], next(versions))
    result["partial_split_before"] = target[split][0]
    result["partial_calls_equal_one_call"] = greedy() == one_call
    if rank == 0:
        print("RESULT " + json.dumps(result), flush=True)
    dist.destroy_process_group()


def main() -> None:
    mode, *args = sys.argv[1:]
    if mode == "check":
        print("RESULT " + json.dumps(check(*args)))
        return
    import torch.multiprocessing as mp

    model_dir, bucket_mb, repeats, world = args[0], float(args[1]), int((args + ["3"])[2]), int((args + ["3", "1"])[3])
    store = str(Path(tempfile.mkdtemp()) / "store")
    # Every tensor over 64 KiB gets its own mapping, returned to the OS when freed: the resident set then
    # follows what is allocated, instead of glibc reusing one method's freed heap for the next.
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    mp.spawn(measure, args=(world, store, model_dir, bucket_mb, repeats), nprocs=world)


if __name__ == "__main__":
    main()
