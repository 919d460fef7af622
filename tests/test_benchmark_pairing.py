"""The step benchmark's paired ratios: each round's vlmrl run against the raw passes, the raw vLLM run and the TRL run
of the same round.

Pure arithmetic on made-up timings; the benchmark itself runs end to end in test_benchmark_smoke.py.
"""

from __future__ import annotations

import math

from benchmarks.step import _paired_mean, paired_rounds

SAMPLES = 256


def _round(step, ref, update, raw_ref, raw_update, trl, gen=None, raw_gen=None):
    hf = [{"ref_s": r, "update_s": u} for r, u in zip(raw_ref, raw_update)]
    return {
        "vlmrl": {
            "timing_s": {"step": step, "ref": ref, "update_actor": update, "gen": gen or 1.0},
            "response_length_mean": 128.0,
            "log": [],
        },
        "hf_before": hf[0],
        "hf_after": hf[1],
        "vllm": None if raw_gen is None else {"gen_s": raw_gen, "gen_tokens": SAMPLES * 128.0},
        "trl": None if trl is None else {"trl_step_s": trl, "trl_samples_per_s": SAMPLES / trl},
    }


def test_each_round_is_divided_by_its_own_raw_runs_and_trl_run():
    # Round 1: raw ref (0.8 + 1.0) / 2 = 0.9, so 0.9 / 0.9 = 1; raw update (2.0 + 2.2) / 2 = 2.1, 2.31 / 2.1 = 1.1;
    # TRL 6.0 s a step against vlmrl's 4.0 s: 6 / 4 = 1.5 times the samples/s; generation 2.0 s against raw
    # vLLM's 2.2 s for the same 256 x 128 tokens: 2.2 / 2.0 = 1.1 times the tokens/s.
    # Round 2: the machine is slower; ref 1.2 / 1.2 = 1, update 2.4 / 3.0 = 0.8, TRL 6.0 / 6.0 = 1,
    # gen 2.7 / 3.0 = 0.9.
    rounds = paired_rounds(
        [
            _round(4.0, 0.9, 2.31, (0.8, 1.0), (2.0, 2.2), 6.0, gen=2.0, raw_gen=2.2),
            _round(6.0, 1.2, 2.4, (1.1, 1.3), (2.9, 3.1), 6.0, gen=3.0, raw_gen=2.7),
        ],
        SAMPLES,
    )
    assert [round(r["ref_vs_raw"], 9) for r in rounds] == [1.0, 1.0]
    assert [round(r["update_vs_raw"], 9) for r in rounds] == [1.1, 0.8]
    assert [r["vlmrl_over_trl"] for r in rounds] == [1.5, 1.0]
    assert [round(r["rollout_efficiency"], 9) for r in rounds] == [1.1, 0.9]
    # The headline is the mean of the rounds' ratios, (1.5 + 1.0) / 2 = 1.25, not the ratio of the mean
    # steps (6.0 / 5.0 = 1.2), which lets one round's slow minute weigh on the other's.
    assert _paired_mean("vlmrl_over_trl", rounds, 6.0 / 5.0) == 1.25
    assert math.isclose(_paired_mean("rollout_efficiency", rounds, 0.0), 1.0)


def test_without_a_pair_in_every_round_the_ratio_is_of_the_means():
    # A round without its TRL run (or its raw vLLM run) cannot be paired: the unpaired ratio of the means stands.
    rounds = paired_rounds(
        [
            _round(4.0, 0.9, 2.0, (0.9, 0.9), (2.0, 2.0), 6.0, gen=2.0, raw_gen=2.0),
            _round(6.0, 0.9, 2.0, (0.9, 0.9), (2.0, 2.0), None),
        ],
        SAMPLES,
    )
    assert "vlmrl_over_trl" not in rounds[1] and "rollout_efficiency" not in rounds[1]
    assert _paired_mean("vlmrl_over_trl", rounds, 1.2) == 1.2
    assert _paired_mean("rollout_efficiency", rounds, 0.7) == 0.7
