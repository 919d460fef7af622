"""End to end: a forced rollout-training mismatch shows in the metrics, and the correction acts on it.

The baseline is the shared run (tests/conftest.py::e2e_run): engine and actor both in float32 with the engine's
log-probs asked for, so the default correction (truncate, C = 2) runs and the ratio stays within a hair of 1
(vLLM and the HF forward agree to about 1e-6 in log-prob on the quickstart in fp32). The forced run is the same training with
the engine in bfloat16 while the actor stays in float32, the mismatch of a bf16 sampler and an fp32 trainer, and
the correction set to mask at a threshold the baseline's ratios never reach: tokens must be masked there, the
mismatch KL must grow, and the run must still train.
"""

from __future__ import annotations

import pytest
from helpers.runs import E2E_TRAINING, read_metrics, run_main, tail

pytestmark = pytest.mark.e2e

THRESHOLD = 1.001
"""The mask's C: far above every ratio of the fp32 baseline (within about 1 +- 2e-6), below the bf16 engine's
largest ones (about 1.003 to 1.016 in a step of this run)."""
QUIET = ["data.val_files=", "trainer.val_before_train=false", "trainer.logger=[console,file]"]


@pytest.fixture(scope="module")
def forced(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rollout_correction")
    proc = run_main(tmp / "out", *E2E_TRAINING, *QUIET, "trainer.max_steps=2", "worker.rollout.dtype=bfloat16",
                    "algorithm.rollout_correction.mode=mask", f"algorithm.rollout_correction.threshold={THRESHOLD}",
                    experiment="forced", timeout=900)  # fmt: skip
    assert proc.returncode == 0, tail(proc)
    return read_metrics(tmp / "out", "forced")


def test_the_fp32_baseline_has_no_mismatch_to_correct(e2e_run):
    metrics = [m for m in read_metrics(e2e_run.output_dir, "e2e") if "mismatch/ratio_max" in m]
    assert metrics, "the shared run logged no mismatch metrics"
    for m in metrics:
        # The default correction (calculate_log_probs=true): truncate at C = 2, which nothing reaches.
        assert m["rollout_corr/truncated_token_frac"] == 0, m
        assert m["rollout_corr/masked_token_frac"] == m["rollout_corr/vetoed_token_frac"] == 0, m
        assert m["rollout_corr/weight_mean"] == pytest.approx(1.0, abs=1e-2)
        assert 1 / THRESHOLD < m["mismatch/ratio_min"] <= m["mismatch/ratio_max"] < THRESHOLD, m
        # The quickstart's prompts show one image each; their split is the whole batch.
        assert m["mismatch/kl_k3/images_1"] == pytest.approx(m["mismatch/kl_k3"])
        assert any(key.startswith("mismatch/kl_k1/length_q") for key in m), sorted(m)


def test_a_bf16_engine_raises_the_masked_share_and_the_kl(forced, e2e_run):
    baseline = [m for m in read_metrics(e2e_run.output_dir, "e2e") if "mismatch/kl_k3" in m]
    assert [m["step"] for m in forced] == [1, 2]
    for m in forced:
        assert m["mismatch/ratio_max"] > THRESHOLD, m
        assert 0 < m["rollout_corr/masked_token_frac"] < 1, m
        assert m["rollout_corr/masked_seq_frac"] >= m["rollout_corr/masked_token_frac"], m
        assert m["rollout_corr/truncated_token_frac"] == 0  # mode mask truncates nothing
        assert "actor/pg_loss" in m and m["actor/grad_norm"] > 0  # the kept tokens still train
    # The k3 estimate of KL(behaviour || actor), per step: about 2e-5 with the bf16 engine, under 1e-7 without.
    forced_kl = sum(m["mismatch/kl_k3"] for m in forced) / len(forced)
    assert forced_kl > 10 * max(b["mismatch/kl_k3"] for b in baseline) and forced_kl > 1e-6, (forced, baseline)
