"""Asynchronous training against synchronous, for multi-turn tool rollouts and an external agent, on tasks that learn.

    python -m benchmarks.async_agents                   # both workloads, seeds 1-3 (about 2 hours)
    python -m benchmarks.async_agents --workloads openai_agent --seeds 1 --steps 4   # a quick look
    python -m benchmarks.async_agents --merge a/async_agents.json b/async_agents.json   # rounds of two invocations

Two workloads, each a task whose synchronous reward rises within the measured steps:

  multi_turn     the agent quickstart's task (examples/agent_quickstart.yaml) with 2-4 tool turns: after the
                 model's ``reveal`` call, the tool shows the picture and the model answers, 2-4 times in all (a
                 long tail), each call waiting 0.2-2 s (``benchmarks/look_again.py``, a workflow class calling the
                 configured tool ``benchmarks/slow_agents.py:reveal``)
  openai_agent   the OpenAI-SDK demo (examples/openai_agent/config.yaml) as an external agent that makes 2-4
                 calls (a long tail), waiting 0.2-2 s before each (``benchmarks/slow_agents.py:solve``)

Each workload trains, one run after another in this machine (16 prompts x 8 rollouts a step):

  sync                 the synchronous step
  async eta=0          colocated; the same schedule as sync, so within its noise
  async eta=1          colocated; groups admitted one version ahead, scored while the trainer trains
  disaggregated eta=1  one rollout server and one trainer worker (a core each); the server runs the turn loop
                       or the agents while the trainer trains, and a step takes the groups that finished first
                       (``consume_order=finished``)

and, named with ``--runs``:

  disaggregated eta=1 loglinear   the same without the decoupled loss's proximal pass on the trainer
                                  (``worker.actor.proximal_log_probs=loglinear``)
  disaggregated eta=0             the rollout server at eta=0: the synchronous schedule in that placement

A round runs each of them once, with one seed (``data.seed`` and ``worker.rollout.seed``: the prompts' order
and the sampling); rounds repeat the whole list with the next seed, so the reward's spread over rounds is
run-to-run noise (with one seed, the synchronous runs repeat exactly). Reported per kind: the median over
rounds (and the spread) of trained samples per second over the steps after the first, and the training reward
(temperature 1) averaged over windows of steps, so the curves can be compared step for step. Results go to ``<out>/async_agents.json`` and ``.md``.
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
RUNS = {
    "sync": [],
    "async eta=0": [*ASYNC, "worker.rollout.async_rl.max_head_offpolicyness=0"],
    "async eta=1": [*ASYNC, "worker.rollout.async_rl.max_head_offpolicyness=1"],
    "disaggregated eta=1": [
        *ASYNC, "worker.rollout.async_rl.max_head_offpolicyness=1", "worker.rollout.async_rl.placement=disaggregated",
        "worker.rollout.async_rl.rollout_workers=1",
        # A step takes the groups that finished first, so a slow trajectory or agent never holds it up.
        "worker.rollout.async_rl.consume_order=finished",
    ],
}  # fmt: skip
# The same, without the decoupled loss's proximal pass: each token's proximal log-prob interpolated between the
# engine's and the update's own by its version (AReaL's loglinear). Not in the default list.
RUNS["disaggregated eta=1 loglinear"] = [*RUNS["disaggregated eta=1"], "worker.actor.proximal_log_probs=loglinear"]
# The rollout server at eta = 0: the synchronous schedule in that placement, to tell what the placement costs
# learning from what one update of staleness does. Not in the default list.
RUNS["disaggregated eta=0"] = [
    *(k for k in RUNS["disaggregated eta=1"] if "max_head_offpolicyness" not in k),
    "worker.rollout.async_rl.max_head_offpolicyness=0",
]
DEFAULT_RUNS = ["sync", "async eta=0", "async eta=1", "disaggregated eta=1"]
WORKLOADS = {
    "multi_turn": [
        "config=examples/agent_quickstart.yaml",
        # The quickstart's task with 2-4 tool turns (benchmarks/look_again.py), each tool call a 0.2-2 s wait.
        "worker.rollout.multi_turn.enable=false", "worker.rollout.workflow=benchmarks/look_again.py:LookAgain",
        "worker.rollout.multi_turn.tools=[benchmarks/slow_agents.py:reveal]",
        "worker.rollout.multi_turn.tool_processes=0",  # async tools awaited in the worker's loop: waits overlap
        "worker.reward.reward_function=benchmarks/look_again.py:compute_score",
        # Model and tool tokens together: up to 4 pictures and 5 answers; a sample run's longest took 164.
        "data.max_response_length=192",
    ],
    "openai_agent": [
        "config=examples/openai_agent/config.yaml",
        "worker.rollout.agent=benchmarks/slow_agents.py:solve",
        "worker.rollout.agent_options.max_concurrency=128",  # every rollout of a step at once: they wait on I/O
        # Four calls merged into one row: 8 + 3 x (27 + 8) = 113 tokens (see the demo's config).
        "data.max_response_length=128",
    ],
}
STEPS = {"multi_turn": 32, "openai_agent": 24}
"""Steps a run, enough for the synchronous reward to rise clearly (the guides' curves: the agent quickstart's
training reward goes 0.17 -> 0.70 by step 32, the demo's validation 0.26 -> 0.73 by step 24)."""
GOALS = {"multi_turn": 1.8, "openai_agent": 1.5}
"""Samples/s of async eta=1 (the better placement) over sync."""
WINDOW = 8
PROMPTS, N = 16, 8
"""Both workloads' configs: data.rollout_batch_size and worker.rollout.n."""


def command(out: Path, workload: str, name: str, steps: int, seed: int, extra: tuple[str, ...] = ()) -> list[str]:
    """The run's ``vlmrl.main`` command; ``extra`` overrides come last, so they win over the run's own."""
    return [
        sys.executable, "-m", "vlmrl.main", *WORKLOADS[workload], f"data.seed={seed}", f"worker.rollout.seed={seed}",
        f"trainer.output_dir={out}", f"trainer.experiment_name={experiment(name)}", f"trainer.max_steps={steps}",
        "data.val_files=", "trainer.val_before_train=false", "trainer.logger=[file]", "trainer.save_freq=-1",
        "trainer.save_hf_weights=false", "worker.rollout.calculate_log_probs=true",
        *RUNS[name], *extra,
    ]  # fmt: skip


def experiment(name: str) -> str:
    return name.replace(" ", "_").replace("=", "")


def summarise(metrics: list[dict], samples_per_step: int) -> dict:
    steps = [m for m in metrics if "timing_s/step" in m]
    timed = steps[1:]  # the first step carries warm-up
    seconds = [m["timing_s/step"] for m in timed]
    rewards = [m["reward/overall"] for m in steps]
    return {
        "samples_per_s": samples_per_step * len(timed) / sum(seconds),
        "step_s": statistics.mean(seconds),
        "rewards": rewards,
        "windows": [statistics.mean(rewards[i : i + WINDOW]) for i in range(0, len(rewards), WINDOW)],
        "lag_max": max((m.get("async/lag/max", 0.0) for m in steps), default=0.0),
        # Where a step's time goes: the mean of each timing_s/* key over the timed steps.
        "timing_s": {k[len("timing_s/"):]: statistics.mean(m.get(k, 0.0) for m in timed)
                     for k in sorted({k for m in timed for k in m if k.startswith("timing_s/")})},  # fmt: skip
        "idle_share": statistics.mean(m.get("async/trainer_idle_share", 0.0) for m in timed),
        "calls_per_rollout": statistics.mean(_calls_per_rollout(m) for m in steps),
    }


def _calls_per_rollout(m: dict) -> float:
    """Tool calls per trained trajectory (multi-turn), or model calls per trained rollout (agent: its turns)."""
    return m.get("agent/tool_calls/mean", m.get("agent/turns/mean", 0.0))


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "all": values}


def combine(rounds: list[dict]) -> dict:
    """Per kind, the median and spread over rounds of samples/s, of its speedup over the same round's sync run,
    and of each reward window."""
    out = {}
    for name in rounds[0]:
        runs = [r[name] for r in rounds]
        out[name] = {
            "samples_per_s": spread([r["samples_per_s"] for r in runs]),
            "speedup": spread([r["samples_per_s"] / s["sync"]["samples_per_s"] for r, s in zip(runs, rounds)]),
            "windows": [spread([r["windows"][i] for r in runs]) for i in range(len(runs[0]["windows"]))],
            "lag_max": max(r["lag_max"] for r in runs),
            "step_s": spread([r["step_s"] for r in runs]),
            "calls_per_rollout": statistics.mean(r["calls_per_rollout"] for r in runs),
        }
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, help="steps a run (default: 32 for multi_turn, 24 for openai_agent)")
    parser.add_argument("--seeds", default="1,2,3", help="one round per seed (data order and sampling)")
    parser.add_argument("--keep-metrics", type=Path, help="copy each run's metrics.jsonl under this folder")
    parser.add_argument("--merge", nargs="+", type=Path, help="combine the rounds of these results and stop")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--runs", default=",".join(DEFAULT_RUNS), help=f"a comma-separated list of runs, sync first; "
                        f"the runs are {list(RUNS)}")  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="an override for every run of the invocation, sync's included (repeatable)")
    args = parser.parse_args(argv)
    if args.merge:
        return write(merge([json.loads(p.read_text()) for p in args.merge]), args.out)
    seeds = [int(s) for s in args.seeds.split(",")]
    workloads, names = args.workloads.split(","), args.runs.split(",")
    problems = [f"--workloads: unknown {w!r}; the workloads are {list(WORKLOADS)}" for w in workloads if w not in WORKLOADS]
    problems += [f"--runs: unknown {n!r}; the runs are {list(RUNS)}" for n in names if n not in RUNS]
    if names[0] != "sync":
        problems.append("--runs: the first run must be sync (speedups are over it)")
    if problems:
        parser.error("; ".join(problems))
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    result: dict = {"shape": {"prompts": PROMPTS, "n": N}, "workloads": {}}
    samples_per_step = PROMPTS * N
    for workload in workloads:
        steps = args.steps or STEPS[workload]
        rounds = []
        for seed in seeds:
            rounds.append({})
            for name in names:
                print(f"== {workload}, seed {seed}: {name}", flush=True)
                with tempfile.TemporaryDirectory(prefix="vlmrl-async-agents-") as tmp:
                    cmd = command(Path(tmp), workload, name, steps, seed, tuple(args.set))
                    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
                    if proc.returncode != 0:
                        print(proc.stdout[-3000:], proc.stderr[-5000:], sep="\n")
                        raise SystemExit(f"the {workload} {name} run failed")
                    path = Path(tmp) / "vlmrl" / experiment(name) / "metrics.jsonl"
                    metrics = [json.loads(line) for line in path.read_text().splitlines()]
                    if args.keep_metrics:  # every logged key of every step, to look into a run afterwards
                        kept = args.keep_metrics / workload / f"seed{seed}" / f"{experiment(name)}.jsonl"
                        kept.parent.mkdir(parents=True, exist_ok=True)
                        kept.write_text(path.read_text())
                rounds[-1][name] = {"seed": seed, **summarise(metrics, samples_per_step)}
                print(json.dumps({k: v for k, v in rounds[-1][name].items() if k != "rewards"}), flush=True)
            # Written after every round, so an interrupted invocation keeps its whole rounds.
            result["workloads"][workload] = {"steps": steps, "rounds": rounds, "summary": combine(rounds)}
            write(result, args.out, quiet=True)
    return write(result, args.out)


def merge(results: list[dict]) -> dict:
    """The rounds of several invocations (of the same tree), workload by workload, in the order given."""
    out: dict = {"shape": results[0]["shape"], "workloads": {}}
    for result in results:
        for workload, data in result["workloads"].items():
            into = out["workloads"].setdefault(workload, {"steps": data["steps"], "rounds": []})
            if into["steps"] != data["steps"]:
                raise SystemExit(f"--merge: {workload} runs {into['steps']} and {data['steps']} steps")
            into["rounds"] += data["rounds"]
    for data in out["workloads"].values():
        data["summary"] = combine(data["rounds"])
    return out


def write(result: dict, out: Path, quiet: bool = False) -> int:
    out.mkdir(parents=True, exist_ok=True)
    (out / "async_agents.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "async_agents.md").write_text(markdown(result))
    if not quiet:
        print(markdown(result))
    return 0


def _fmt(s: dict, digits: int = 2) -> str:
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"


def markdown(result: dict) -> str:
    shape = result["shape"]
    lines = [
        f"{shape['prompts']} prompts x {shape['n']} rollouts a step; the median over rounds (one per seed), with "
        "the range in brackets. Samples/s leave out the first step.",
    ]
    for workload, data in result["workloads"].items():
        summary = data["summary"]
        windows = len(next(iter(summary.values()))["windows"])
        heads = [f"reward, steps {i * WINDOW + 1}-{min((i + 1) * WINDOW, data['steps'])}" for i in range(windows)]
        lines += [
            "", f"### {workload}, {data['steps']} steps a run, seeds {', '.join(str(r['sync']['seed']) for r in data['rounds'])} (goal: async eta=1 at least {GOALS[workload]}x sync's samples/s)", "",
            "| run | samples/s | speedup | step s | calls/rollout | lag max | " + " | ".join(heads) + " |",
            "| --- " * (6 + windows) + "|",
        ]  # fmt: skip
        for name, s in summary.items():
            cells = [_fmt(s["samples_per_s"]), _fmt(s["speedup"]), _fmt(s["step_s"], 1), f"{s['calls_per_rollout']:.2f}",
                     f"{s['lag_max']:.0f}", *(_fmt(w, 3) for w in s["windows"])]  # fmt: skip
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
