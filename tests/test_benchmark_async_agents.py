"""The async agent benchmark's arithmetic (``benchmarks.async_agents``) and its waits (``benchmarks.slow_agents``).

Pure logic on made-up runs; the benchmark itself is a command (docs/performance.md), not a test.
"""

from __future__ import annotations

import random
import statistics

import pytest

from benchmarks.async_agents import RUNS, combine, command, merge, summarise
from benchmarks.slow_agents import extra_looks, wait_s


def _run(samples_per_s: float, windows: list[float], seed: int = 1) -> dict:
    return {"seed": seed, "samples_per_s": samples_per_s, "step_s": 128 / samples_per_s, "windows": windows,
            "lag_max": 1.0, "calls_per_rollout": 1.0}  # fmt: skip


def test_each_speedup_is_over_the_same_rounds_sync_run():
    # Round 1 (a quiet machine): sync 20, eta=1 30 -> 1.5. Round 2 (a slower one): sync 10, eta=1 16 -> 1.6.
    # Speedups 1.5 and 1.6: median 1.55. Over the median sync (15) it would read 23 / 15 = 1.53, and a
    # speedup over the other round's sync 30 / 10 = 3.0 or 16 / 20 = 0.8.
    rounds = [
        {"sync": _run(20.0, [0.2, 0.4]), "async eta=1": _run(30.0, [0.2, 0.3])},
        {"sync": _run(10.0, [0.1, 0.5]), "async eta=1": _run(16.0, [0.3, 0.5])},
    ]
    summary = combine(rounds)
    assert summary["async eta=1"]["speedup"]["all"] == pytest.approx([1.5, 1.6])
    assert summary["async eta=1"]["speedup"]["median"] == pytest.approx(1.55)
    assert summary["sync"]["speedup"]["all"] == pytest.approx([1.0, 1.0])
    # Reward windows: per window, the median over rounds and the range (windows 2: 0.3 and 0.5 -> 0.4).
    window = summary["async eta=1"]["windows"][1]
    assert (window["median"], window["min"], window["max"]) == pytest.approx((0.4, 0.3, 0.5))


def test_merge_appends_rounds_per_workload_and_refuses_runs_of_other_lengths():
    one = {"shape": {}, "workloads": {"multi_turn": {"steps": 32, "rounds": [{"sync": _run(20.0, [0.2], seed=1)}]}}}
    two = {"shape": {}, "workloads": {"multi_turn": {"steps": 32, "rounds": [{"sync": _run(10.0, [0.4], seed=2)}]}}}
    merged = merge([one, two])["workloads"]["multi_turn"]
    assert [r["sync"]["seed"] for r in merged["rounds"]] == [1, 2]
    assert merged["summary"]["sync"]["windows"][0]["median"] == pytest.approx(0.3)
    two["workloads"]["multi_turn"]["steps"] = 24
    with pytest.raises(SystemExit, match="multi_turn runs 32 and 24 steps"):
        merge([one, two])


def test_summarise_leaves_out_the_first_steps_time_but_not_its_reward():
    # Step 1 took 30 s (start-up); steps 2-3 took 4 s each: 2 x 128 samples / 8 s = 32 samples/s.
    metrics = [
        {"step": s, "timing_s/step": t, "timing_s/gen": t / 2, "reward/overall": r, "agent/tool_calls/mean": 1.0, "agent/turns/mean": 2.0}
        for s, t, r in ((1, 30.0, 0.1), (2, 4.0, 0.2), (3, 4.0, 0.6))
    ]
    run = summarise(metrics, 128)
    assert run["samples_per_s"] == pytest.approx(32.0)
    assert run["rewards"] == [0.1, 0.2, 0.6] and run["windows"] == [pytest.approx(0.3)]
    assert run["timing_s"] == {"gen": pytest.approx(2.0), "step": pytest.approx(4.0)}
    # Multi-turn: a trajectory's tool calls (1), not its turns (2, the call's and the answer's).
    assert run["calls_per_rollout"] == 1.0
    # An external agent: its calls are its turns (3), whatever a step's other rollouts did.
    agent = [{k: v for k, v in m.items() if k != "agent/tool_calls/mean"} | {"agent/turns/mean": 3.0} for m in metrics]
    assert summarise(agent, 128)["calls_per_rollout"] == 3.0


def test_waits_are_long_tailed_within_their_bounds_and_agents_make_two_to_four_calls():
    rng = random.Random(0)
    waits = [wait_s(rng) for _ in range(20000)]
    # 0.2 + 1.8 u^3: the median is 0.2 + 1.8 / 8 = 0.425 s, the mean 0.2 + 1.8 / 4 = 0.65 s, and
    # P(wait > 1.5) = P(u > (1.3 / 1.8)^(1/3)) = 1 - 0.897 = 0.103.
    assert 0.2 <= min(waits) and max(waits) <= 2.0
    assert statistics.median(waits) == pytest.approx(0.425, abs=0.02)
    assert statistics.mean(waits) == pytest.approx(0.65, abs=0.02)
    assert sum(w > 1.5 for w in waits) / len(waits) == pytest.approx(0.103, abs=0.01)
    looks = [extra_looks(rng) for _ in range(20000)]
    for extra, share in ((0, 0.7), (1, 0.2), (2, 0.1)):
        assert looks.count(extra) / len(looks) == pytest.approx(share, abs=0.015)



def test_the_multi_turn_workload_has_two_to_four_tool_turns_after_a_reveal():
    import benchmarks.look_again as look_again

    rng = random.Random(0)
    turns = [look_again.tool_turns(rng) for _ in range(20000)]
    # 2, 3 or 4 tool turns, with the long tail of the agent's calls (0.7, 0.2, 0.1).
    for count, share in ((2, 0.7), (3, 0.2), (4, 0.1)):
        assert turns.count(count) / len(turns) == pytest.approx(share, abs=0.015)
    assert look_again.calls_reveal("<tool_call>reveal</tool_call>")
    assert look_again.calls_reveal('<tool_call>\n{"name": "reveal", "arguments": {}}\n</tool_call>')
    assert not look_again.calls_reveal("red") and not look_again.calls_reveal("<tool_call>look</tool_call>")
    # An answer without the call scores 0 however right; the last answer is scored once the model called.
    blind = {"response": "red", "ground_truth": "red", "messages": [{"role": "assistant", "content": "red"}]}
    assert look_again.compute_score(blind)["overall"] == 0.0
    seen = {**blind, "messages": [{"role": "assistant", "content": "<tool_call>reveal</tool_call>"}, *blind["messages"]]}
    assert look_again.compute_score(seen) == {"overall": 1.0, "accuracy": 1.0, "revealed": 1.0}
    assert look_again.compute_score({**seen, "response": "blue"})["overall"] == 0.0


def test_an_override_set_for_the_invocation_reaches_every_run_and_wins_over_the_runs_own(tmp_path):
    lr = "worker.actor.optim.lr=5e-4"
    for name in RUNS:
        cmd = command(tmp_path, "openai_agent", name, 4, 1, (lr, "worker.rollout.async_rl.consume_order=admitted"))
        assert lr in cmd, name
        # vlmrl.main takes the last of two settings of a key: the invocation's must come after the run's.
        order = [i for i, a in enumerate(cmd) if a.startswith("worker.rollout.async_rl.consume_order=")]
        assert cmd[order[-1]] == "worker.rollout.async_rl.consume_order=admitted", name
