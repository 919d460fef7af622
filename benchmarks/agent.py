"""What multi-turn rollouts cost beyond the engine's own work, and whether tool latency is hidden.

    python -m benchmarks.agent              # 32 prompts x 8 trajectories x 3 turns
    python -m benchmarks.agent --smoke      # 2 x 2 x 2 turns, one step (5-8 minutes on 2 busy cores)

On the tiny Qwen2.5-VL (in process, no Ray), every trajectory calls a tool at
every turn (the parser always reads a call), and the tool answers with a
line of text and a picture. In one process, one after the other:

  (a) the agent loop with an instant tool;
  (b) the agent loop with a tool that sleeps 100 ms per call;
  (c) the engine alone: the exact requests of (a), turn by turn, replayed
      through ``Engine.generate`` from a cold prefix cache, as (a) started.

It reports ``latency_ratio`` = (b) / (a), which concurrency should keep near
1 (goal <= 1.15), and ``loop_overhead`` = (a) / (c), what the loop adds to
generating the same tokens: rendering observations, tools, bookkeeping
(goal <= 1.15). Each is the median over ``--repeats`` alternating runs, with
its spread.

Then (``--step``, on by default; ``--no-loop`` runs it alone) the multi-turn
GRPO step through ``python -m vlmrl.main`` against the raw engines, as
``benchmarks.step`` does for one turn: ``step_overhead`` = vlmrl's step /
(raw vLLM on the same turn requests + raw HF log-prob passes + update), goal
<= 1.15; see ``benchmarks.agent_step``. Results go to ``<out>/agent.json``
and ``<out>/agent.md`` (``agent_smoke.*`` with ``--smoke``).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import time
from pathlib import Path

from benchmarks import agent_step
from benchmarks.agent_step import Recording
from benchmarks.agent_tools import always_call, card

GOALS = {"latency_ratio": 1.15, "loop_overhead": 1.15}
MIN_PIXELS, MAX_PIXELS = 3136, 12544


def wait_tool(seconds: float):
    async def look(context) -> object:
        """Look again."""
        from vlmrl.rollout.turns.tools import ToolResult

        if seconds:
            await asyncio.sleep(seconds)
        return ToolResult(text=f"turn {context.turn}", images=[card(context.turn)])

    return look


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--tokens-per-turn", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="2 prompts x 2 x 2 turns of 4 tokens, one step")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument(
        "--loop", action=argparse.BooleanOptionalAction, default=True,
        help="the in-process agent loop: latency_ratio and loop_overhead",
    )  # fmt: skip
    parser.add_argument(
        "--step", action=argparse.BooleanOptionalAction, default=True,
        help="the multi-turn GRPO step through vlmrl.main against the raw engines: step_overhead",
    )  # fmt: skip
    agent_step.add_arguments(parser)
    args = parser.parse_args(argv)
    if args.smoke:
        args.prompts, args.n, args.turns, args.tokens_per_turn, args.repeats = 2, 2, 2, 4, 1
        agent_step.smoke(args)
    if args.part:
        agent_step.run_part_main(args)
        return 0
    result = {}
    # The step first: its parts run in processes of their own while this one holds no engine yet.
    if args.step:
        result["step"] = agent_step.run(args)
    if args.loop:
        result = {**loop_benchmark(args), **result}
    name = "agent_smoke" if args.smoke else "agent"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / f"{name}.md").write_text(markdown(result))
    print(json.dumps(result, indent=2))
    print(markdown(result))
    return 0


def markdown(result: dict) -> str:
    lines = []
    if "latency_ratio" in result:
        shape = result["shape"]
        lines += [
            (
                f"Agent loop, in process: {shape['prompts']} prompts x {shape['n']} trajectories x "
                f"{shape['turns']} turns of {shape['tokens_per_turn']} tokens; {result['mean_turns']:.2f} turns "
                f"per trajectory."
            ),
            "",
            "| metric | median | min | max | goal | met |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for k, goal in GOALS.items():
            v = result[k]
            lines.append(
                f"| {k} | {v['median']:.3f} | {v['min']:.3f} | {v['max']:.3f} | <= {goal} | "
                f"{'yes' if v['median'] <= goal else 'no'} |"
            )
        lines.append("")
    if "step" in result:
        lines.append(agent_step.markdown(result["step"]))
    return "\n".join(lines)


def loop_benchmark(args) -> dict:
    """The in-process agent loop with an instant and a sleeping tool, and the engine replaying its requests."""
    from transformers import AutoConfig, AutoProcessor

    from vlmrl.data.dataset import MODEL_INPUT_KEYS, RLHFDataset
    from vlmrl.data.media import resize_to_grid
    from vlmrl.models import family_of
    from vlmrl.models.qwen_vision import QwenMediaSizes
    from vlmrl.rollout.engine import Sampling
    from vlmrl.rollout.engine.sampling import sampling_mask
    from vlmrl.models.qwen_vision import SPECIAL_TOKENS as QWEN_MARKERS
    from vlmrl.rollout.engine.vllm import VLLMEngine
    from vlmrl.rollout.turns.loop import AgentLoop, Limits
    from vlmrl.rollout.turns.observations import ConversationRenderer
    from vlmrl.rollout.turns.tools import ToolRunner, tool_from_function
    from vlmrl.testing.assets import ensure_tiny_assets

    assets = ensure_tiny_assets()
    processor = AutoProcessor.from_pretrained(assets.model_dir)
    config = AutoConfig.from_pretrained(assets.model_dir)
    budget = args.turns * (args.tokens_per_turn + 40)
    engine = VLLMEngine(
        str(assets.model_dir), dtype="bfloat16", seed=0, max_model_len=1024 + budget,
        max_num_batched_tokens=8192, enforce_eager=True, gpu_memory_utilization=0.5, cpu_kvcache_space_gb=2,
        min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS,
        allowed_tokens=sampling_mask(processor.tokenizer, config.get_text_config().vocab_size, QWEN_MARKERS),
    )  # fmt: skip
    ds = RLHFDataset(
        str(assets.train_file), processor, prompt_key="problem", answer_key="answer", image_key="images",
        image_dir=None, max_prompt_length=1024, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, model_config=config,
    )  # fmt: skip
    prompts = [ds[i] for i in range(args.prompts)]
    ip = processor.image_processor
    renderer = ConversationRenderer(
        processor, chat_template=None, tools=[], template_has_tools=False,
        resize=lambda image: resize_to_grid(image, QwenMediaSizes.of(ip, MIN_PIXELS, MAX_PIXELS)),
        model_input_keys=MODEL_INPUT_KEYS,
    )  # fmt: skip
    vocab = processor.tokenizer.get_vocab()
    limits = Limits(max_turns=args.turns, max_response_length=budget, max_tokens_per_turn=args.tokens_per_turn,
                    max_tool_response_length=16, max_images=args.turns, tool_timeout=10.0, max_parallel_calls=1)  # fmt: skip
    sampling = Sampling(n=args.n, temperature=1.0, max_tokens=budget, ignore_eos=True)

    def loop_seconds(sleep: float, record: bool = False):
        tool = tool_from_function(wait_tool(sleep), "look")
        wrapped = Recording(engine) if record else engine
        loop = AgentLoop(
            wrapped, renderer, limits, positions=family_of(config).positions(config).positions,
            pad_ids=(vocab["<|image_pad|>"], vocab["<|video_pad|>"]), runner=ToolRunner([tool], 10.0),
            parser=always_call,
        )  # fmt: skip
        engine.llm.reset_prefix_cache()
        start = time.perf_counter()
        trajectories, timings = loop.run(prompts, list(range(len(prompts))), sampling)
        seconds = time.perf_counter() - start
        loop.runner.close()
        return seconds, timings, trajectories, wrapped

    def replay_seconds(calls) -> float:
        engine.llm.reset_prefix_cache()
        start = time.perf_counter()
        for requests in calls:
            engine.generate(requests)
        return time.perf_counter() - start

    loop_seconds(0.0)  # warm-up: first multimodal requests compile and fill caches
    instant, slow, replay = [], [], []
    for _ in range(args.repeats):
        seconds, timings, trajectories, recording = loop_seconds(0.0, record=True)
        instant.append(seconds)
        slow.append(loop_seconds(0.1)[0])
        replay.append(replay_seconds(recording.calls))
    turns = statistics.mean(t.num_turns for t in trajectories)
    ratios = {
        "latency_ratio": [s / i for s, i in zip(slow, instant)],
        "loop_overhead": [i / r for i, r in zip(instant, replay)],
    }
    result = {
        "shape": {"prompts": args.prompts, "n": args.n, "turns": args.turns, "tokens_per_turn": args.tokens_per_turn},
        "mean_turns": turns,
        "seconds": {"instant_tool": instant, "sleeping_tool": slow, "engine_replay": replay},
        "last_run_pieces_s": timings,
        **{k: {"median": statistics.median(v), "min": min(v), "max": max(v), "goal": f"<= {GOALS[k]}"} for k, v in ratios.items()},
    }
    del engine
    gc.collect()
    return result


if __name__ == "__main__":
    raise SystemExit(main())
