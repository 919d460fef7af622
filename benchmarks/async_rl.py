"""Asynchronous training against synchronous, on the tiny quickstart, in one invocation.

    python -m benchmarks.async_rl              # 8 steps of 8 prompts x 4 samples per run, 6 runs
    python -m benchmarks.async_rl --smoke      # 3 steps of 2 prompts x 2, sync and eta 1 only

Each run is ``python -m vlmrl.main`` on examples/quickstart.yaml (colocated, one worker), one after the
other in this process's machine:

  sync            the synchronous step
  async eta=0     must be within noise of sync (it is the same schedule)
  async eta=1, 2  groups admitted 1 or 2 versions ahead, scored while the trainer trains
  disaggregated eta=0, 1   1 rollout server + 1 trainer worker (a core each); at eta=0 the server waits for
                  each update (the placement alone), at eta=1 it generates while the trainer trains
  control sync / control eta=1   the negative control: an instant reward and equal lengths (ignore_eos)

The workload: a reward that waits 0.2-2 s per prompt group (``benchmarks/slow_reward.py``: I/O such as
a sandbox or a judge; a call's groups wait together, so a call waits for its slowest group), and
responses up to 64 tokens as the format-tuned model samples them at temperature 2.0 (median about 5
tokens, a tenth over 20, some up to the cap: a long tail).

Reported per run, over the steps after the first (start-up excluded): trained samples per second, the
mean step, the reward at the last step (mean of the last two), the lag, and the time the driver waited
on rewards with nothing else to do (sync: ``timing_s/reward``, the wait the log-prob passes did not hide;
async: ``timing_s/async/reward_wait``). The sync run's idle time bounds any colocated gain: generation
and training share the workers and never overlap, so what asynchrony can hide is the reward wait.
Results go to ``<out>/async_rl.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ASYNC = ["worker.rollout.async_rl.enable=true", "worker.actor.use_decoupled_loss=true"]
DISAGGREGATED = ["worker.rollout.async_rl.placement=disaggregated", "worker.rollout.async_rl.rollout_workers=1"]
RUNS = {
    "sync": [],
    "async eta=0": [*ASYNC, "worker.rollout.async_rl.max_head_offpolicyness=0"],
    "async eta=1": [*ASYNC, "worker.rollout.async_rl.max_head_offpolicyness=1"],
    "async eta=2": [*ASYNC, "worker.rollout.async_rl.max_head_offpolicyness=2"],
    "disaggregated eta=0": [*ASYNC, *DISAGGREGATED, "worker.rollout.async_rl.max_head_offpolicyness=0"],
    "disaggregated eta=1": [*ASYNC, *DISAGGREGATED, "worker.rollout.async_rl.max_head_offpolicyness=1"],
    "control sync": ["CONTROL"],
    "control eta=1": ["CONTROL", *ASYNC, "worker.rollout.async_rl.max_head_offpolicyness=1"],
}


def command(out: Path, name: str, overrides: list[str], args) -> list[str]:
    control = "CONTROL" in overrides
    overrides = [o for o in overrides if o != "CONTROL"]
    return [
        sys.executable, "-m", "vlmrl.main", "config=examples/quickstart.yaml",
        f"trainer.output_dir={out}", f"trainer.experiment_name={name.replace(' ', '_').replace('=', '')}",
        f"trainer.max_steps={args.steps}", f"data.rollout_batch_size={args.prompts}",
        f"worker.actor.global_batch_size={args.prompts}", f"worker.rollout.n={args.n}",
        f"worker.actor.micro_batch_size_per_device_for_update={args.prompts * args.n}",
        f"data.max_response_length={args.max_response}", f"worker.rollout.temperature={args.temperature}",
        "worker.rollout.calculate_log_probs=true",
        "data.val_files=", "trainer.val_before_train=false", "trainer.logger=[file]", "trainer.save_freq=-1",
        "trainer.save_hf_weights=false",
        "worker.reward.reward_function=benchmarks/slow_reward.py:compute_score",
        f"worker.reward.reward_function_kwargs={{wait: {str(not control).lower()}}}",
        *(["worker.rollout.ignore_eos=true"] if control else []),
        *overrides,
    ]  # fmt: skip


def summarise(metrics: list[dict], samples_per_step: int) -> dict:
    steps = [m for m in metrics if "timing_s/step" in m][1:]  # the first step carries warm-up
    seconds = [m["timing_s/step"] for m in steps]
    waits = [m.get("timing_s/async/reward_wait", m.get("timing_s/reward", 0.0)) for m in steps]
    last = [m["reward/overall"] for m in steps[-2:]]
    return {
        "steps_timed": len(steps),
        "samples_per_s": samples_per_step * len(steps) / sum(seconds),
        "step_s": {"mean": statistics.mean(seconds), "min": min(seconds), "max": max(seconds)},
        "reward_wait_s": statistics.mean(waits),
        # The share of the step the workers sat idle: waiting for rewards (and, disaggregated, for the servers).
        "idle_share": statistics.mean(m.get("async/trainer_idle_share", w / s) for m, w, s in zip(steps, waits, seconds)),
        "reward_last": statistics.mean(last),
        "lag_max": max((m.get("async/lag/max", 0.0) for m in steps), default=0.0),
        "response_length_max": max(m["response_length/max"] for m in steps),
        "response_length_mean": statistics.mean(m["response_length/mean"] for m in steps),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--temperature", type=float, default=2.0)
    parser.add_argument("--max-response", type=int, default=64)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--runs", help="a comma-separated subset of the runs, in order (default: all)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args(argv)
    runs = dict(RUNS)
    if args.smoke:
        args.steps, args.prompts, args.n = 3, 2, 2
        runs = {k: RUNS[k] for k in ("sync", "async eta=1")}
    if args.runs:
        unknown = [k for k in args.runs.split(",") if k not in RUNS]
        if unknown:
            parser.error(f"--runs: unknown run(s) {unknown}; the runs are {list(RUNS)}")
        runs = {k: RUNS[k] for k in args.runs.split(",")}
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    result: dict = {"shape": {"steps": args.steps, "prompts": args.prompts, "n": args.n}, "runs": {}}
    with tempfile.TemporaryDirectory(prefix="vlmrl-async-bench-") as tmp:
        for name, overrides in runs.items():
            print(f"== {name}", flush=True)
            proc = subprocess.run(command(Path(tmp), name, overrides, args), cwd=REPO, env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                print(proc.stdout[-3000:], proc.stderr[-5000:], sep="\n")
                raise SystemExit(f"the {name} run failed")
            experiment = name.replace(" ", "_").replace("=", "")
            path = Path(tmp) / "vlmrl" / experiment / "metrics.jsonl"
            metrics = [json.loads(line) for line in path.read_text().splitlines()]
            result["runs"][name] = summarise(metrics, args.prompts * args.n)
    for name, base in (("async eta=0", "sync"), ("async eta=1", "sync"), ("async eta=2", "sync"),
                       ("disaggregated eta=0", "sync"), ("disaggregated eta=1", "sync"),
                       ("control eta=1", "control sync")):  # fmt: skip
        if name in result["runs"] and base in result["runs"]:
            r = result["runs"][name]
            r["speedup"] = r["samples_per_s"] / result["runs"][base]["samples_per_s"]
    name = "async_rl_smoke" if args.smoke else "async_rl_subset" if args.runs else "async_rl"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / f"{name}.md").write_text(markdown(result))
    print(markdown(result))
    return 0


def markdown(result: dict) -> str:
    s = result["shape"]
    lines = [
        f"{s['steps']} steps of {s['prompts']} prompts x {s['n']} samples per run (the first step not timed); "
        "reward waits 0.2-2 s per group except in the control.",
        "",
        "| run | samples/s | speedup | step s (min-max) | reward wait s/step | trainer idle | reward (last 2) | lag max "
        "| length mean / max |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, r in result["runs"].items():
        speedup = f"{r['speedup']:.2f}" if "speedup" in r else "-"
        lines.append(
            f"| {name} | {r['samples_per_s']:.2f} | {speedup} | {r['step_s']['mean']:.2f} "
            f"({r['step_s']['min']:.2f}-{r['step_s']['max']:.2f}) | {r['reward_wait_s']:.2f} | {r['idle_share']:.0%} "
            f"| {r['reward_last']:.3f} "
            f"| {r['lag_max']:.0f} | {r['response_length_mean']:.1f} / {r['response_length_max']:.0f} |"
        )
    sync = result["runs"].get("sync")
    if sync is not None:
        # Colocated, generation and training share the cores and never overlap, so asynchrony can hide at most
        # the time the synchronous step sat idle: its samples/s can grow by 1 / (1 - idle share) at most.
        bound = 1 / max(1e-9, 1 - sync["idle_share"])
        lines += ["", f"Idle budget of the synchronous run: {sync['idle_share']:.0%} of its step, so a colocated "
                  f"async run can reach at most {bound:.2f}x its samples/s."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
