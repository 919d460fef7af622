"""The agent quickstart's task, tool and starting model: the colour can only be seen through a tool.

Each row asks for the colour of a shape whose picture is hidden: the prompt
has no image. The ``reveal`` tool (examples/agent_tools.py) answers with the
picture, kept in the row's ``hidden`` column. A policy that answers at once is
right by chance (1 in 4); one that calls ``reveal`` and reads the colour off
the tool's image can be right every time. The blank-tool baseline
(``reveal_blank``) shows a blank canvas, so calling the tool there cannot help.

Why no covered picture in the prompt (the first design had one): with it, the
policy never learned to read the tool's picture (validation at 0.23 for 32 steps
at lr 1e-3, with every sample calling), although the same start learned it
under supervision in 40 steps; without it, validation reached 0.55 by step 24.
A likely reason: the call's tokens came after the covered picture, so their
noisy advantages reached the vision tower through it.

The starting model is the tiny random VLM tuned for format only, as the
single-turn quickstart's is (``vlmrl.testing.format_tune``): on the prompt it
mostly calls ``reveal`` and sometimes names a colour at once, and after a tool
response it names a colour, independently of any image, each about a quarter
of the time (the learning rate decays over the last third of the tuning).
RL has to find that calling the tool and looking at its picture pays.
"""

from __future__ import annotations

import io
import random
import sys
from dataclasses import dataclass
from pathlib import Path

from vlmrl.testing import sft, synthetic

QUESTION = "What colour is the shape? The picture is hidden; reveal shows it. Answer with one word."
TOOL_CALL = "<tool_call>reveal</tool_call>"
"""The call the start is tuned to write: the quickstart's own format (examples/agent_tools.py:parse_named), 5 tokens
once the tags are tokens of their own."""
TOOL_CALL_TAGS = ("<tool_call>", "</tool_call>")
TOOL_TEXT = "the picture"
N_TRAIN, N_VAL = 1024, 128
STEPS, BATCH_SIZE, LR = 150, 16, 1e-3
FIRST_TURN_SHARE, FIRST_TURN_CALL = 0.8, 0.9
"""Of the tuning examples, ``FIRST_TURN_SHARE`` are first turns, of which ``FIRST_TURN_CALL`` call reveal and the rest
name a colour at once; the others are the turn after the tool's answer (a colour, whatever the picture).

Why these shares (each was tried): a start that called on about half the prompts left the choice to chance, since
calling pays no more than guessing until the model reads the tool's picture; GRPO's noisy early updates drove
calls to 0 at lr 1e-3, and a policy that never calls has no way back. Calling on most prompts puts most samples
on the path that can learn. The after-tool colours are few because every one of them teaches the model that the
picture does not matter: 2,400 of them (300 steps at half the examples) left a start that did not learn to read
the picture in 20 RL steps, where the single-turn quickstart's start, tuned on 640, does."""


@dataclass(frozen=True)
class AgentAssets:
    model_dir: Path
    """The tiny model tuned to call reveal or answer, at random (see the module docstring)."""
    train_file: Path
    val_file: Path


def reveal_schema() -> dict:
    """The schema the reveal tools of examples/agent_tools.py get from their signature and docstring."""
    return {
        "type": "function",
        "function": {
            "name": "reveal",
            "description": "Show the picture.",
            "parameters": {"type": "object", "properties": {}, "required": []},
        },
    }


def _png(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def write_agent_dataset(out_dir: Path, n_train: int = N_TRAIN, n_val: int = N_VAL, seed: int = 0) -> None:
    import pyarrow.parquet as pq
    from datasets import Dataset, Features, Image as ImageFeature, List, Value

    features = Features(
        {
            "problem": Value("string"),
            "answer": Value("string"),
            "images": List(ImageFeature()),
            "hidden": Value("binary"),
            "data_source": Value("string"),
        }
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", n_train), ("val", n_val)):
        rng = random.Random(f"agent:{split}:{seed}")
        samples = [synthetic.shape_colour_sample(rng) for _ in range(n)]
        columns = {
            "problem": [QUESTION] * n,
            "answer": [s.answer for s in samples],
            "images": [[] for s in samples],  # no picture in the prompt: see the module docstring
            "hidden": [_png(s.image) for s in samples],
            "data_source": ["agent_colour"] * n,
        }
        pq.write_table(Dataset.from_dict(columns, features=features).data.table, out_dir / f"{split}.parquet")


def agent_format_tune(model_dir: Path, out_dir: Path, seed: int = 0, steps: int = STEPS) -> Path:
    """Write ``model_dir`` tuned to the agent task's format: call reveal or answer, then answer."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from vlmrl.data.chat import tools_system_message
    from vlmrl.data.dataset import MODEL_INPUT_KEYS
    from vlmrl.data.media import resize_to_grid
    from vlmrl.models.qwen_vision import QwenMediaSizes
    from vlmrl.rollout.turns.observations import ConversationRenderer

    processor = AutoProcessor.from_pretrained(model_dir)
    tokenizer = processor.tokenizer
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    add_tool_call_tokens(processor, model)
    rng = random.Random(f"agent:format:{seed}")
    pictures = [synthetic.shape_colour_sample(rng).image for _ in range(64)]
    covered = synthetic.blanked(synthetic.shape_colour_sample(rng)).image
    colours = sorted(synthetic.COLOURS)
    ip = processor.image_processor
    sizes = QwenMediaSizes.of(ip, 3136, 12544)

    def grid(image):
        return resize_to_grid(image, sizes)

    messages = [
        {"role": "system", "content": tools_system_message([reveal_schema()])},
        {"role": "user", "content": [{"type": "text", "text": QUESTION}]},
    ]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    # What the agent loop appends after a call, from the loop's own renderer: the end-of-turn separator, the
    # tool's turn with its picture, and the next assistant turn's opening.
    renderer = ConversationRenderer(
        processor, chat_template=None, tools=[reveal_schema()], template_has_tools=False, resize=grid,
        model_input_keys=MODEL_INPUT_KEYS,
    )  # fmt: skip
    observation = renderer.render(renderer.tool_messages([(TOOL_TEXT, [covered])]), [covered]).text
    after_call = TOOL_CALL + tokenizer.eos_token + observation
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    tokenizer.padding_side = "right"
    model.train()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        # Constant, then down to LR / (steps - hold) over the last third: each step's noise moves the
        # after-tool colour shares; decayed, the start ends near the average of its steps, every colour
        # about a quarter (constant to the end, one colour had 0.39 and another 0.15).
        hold = int(steps * 2 / 3)
        for step in range(steps):
            for group in optimizer.param_groups:
                group["lr"] = LR * min(1.0, (steps - step) / (steps - hold))
            texts, images, targets = [], [], []
            for _ in range(BATCH_SIZE):
                answer = rng.choice(colours) + tokenizer.eos_token
                first_turn, call = rng.random() < FIRST_TURN_SHARE, rng.random() < FIRST_TURN_CALL
                if first_turn and call:
                    text, shown, target = prompt, [], TOOL_CALL + tokenizer.eos_token
                elif first_turn:  # a colour at once
                    text, shown, target = prompt, [], answer
                else:  # the turn after the tool: a colour, whatever the picture
                    text, shown, target = prompt + after_call, [rng.choice(pictures)], answer
                texts.append(text + target)
                images += [grid(i) for i in shown]
                targets.append(len(tokenizer.encode(target)))
            # One padded batch (right-padded), the loss on each row's target tokens only.
            inputs = processor(text=texts, images=images or None, padding=True, return_tensors="pt")
            sft.step_on_targets(model, optimizer, inputs, targets)
    model.eval()
    model.save_pretrained(out_dir)
    processor.save_pretrained(out_dir)
    return out_dir


def add_tool_call_tokens(processor, model) -> None:
    """Give the tokenizer ``<tool_call>`` and ``</tool_call>`` as single tokens, as Qwen's own tokenizers have them.

    The tiny byte-level BPE was trained on a corpus without them, so each tag cost 9 tokens and the call 32,
    one letter at a time, exactly the per-turn cap: at temperature 1 a call then rarely came out whole, and RL
    had 32 tokens of letters to keep intact before any colour could pay. As added tokens (not special ones, so
    vLLM's decoding keeps them in the text the parser reads) the JSON call is 16 tokens and the bare-name call
    ``TOOL_CALL`` 5. The embedding and output rows of the two new ids start at the mean of the others
    (transformers' resize) and are then tuned.
    """
    from tokenizers import AddedToken

    tokenizer = processor.tokenizer
    added = tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_CALL_TAGS])
    if added:
        model.resize_token_embeddings(len(tokenizer))


def build_agent_assets(root: Path, base_model_dir: Path) -> AgentAssets:
    assets = agent_layout(root)
    write_agent_dataset(assets.train_file.parent)
    agent_format_tune(base_model_dir, assets.model_dir)
    return assets


def agent_layout(root: Path) -> AgentAssets:
    return AgentAssets(
        model_dir=root / "tiny-qwen2_5_vl-agent-tuned",
        train_file=root / "data" / "train.parquet",
        val_file=root / "data" / "val.parquet",
    )


def agent_version() -> str:
    """Hash of everything that decides the bytes of the agent assets (the tiny model's included)."""
    from vlmrl.data import chat
    from vlmrl.testing import assets

    # The observation the tuning shows after a call comes from the agent loop's renderer, which
    # tests/test_agent_render.py holds to the chat template's own rendering; so the template (in the tiny
    # model's assets) and chat.py's system message decide it, not the renderer's source.
    return assets._version(
        (synthetic, chat, sft, sys.modules[__name__]),
        f"{assets.assets_version()}:{N_TRAIN}:{N_VAL}:{STEPS}:{BATCH_SIZE}:{LR}:{FIRST_TURN_SHARE}:{FIRST_TURN_CALL}",
    )


def ensure_agent_assets(cache_dir: Path | None = None) -> AgentAssets:
    """The agent quickstart's tuned model and data, built (with the tiny assets) on first use."""
    from vlmrl.testing import assets

    cache_dir = Path(cache_dir) if cache_dir is not None else assets.default_cache_dir()
    base = assets.ensure_tiny_assets(cache_dir)
    version = agent_version()
    final = cache_dir / f"agent-assets-{version}"
    assets._ensure(cache_dir, final, version, lambda tmp: build_agent_assets(tmp, base.model_dir))
    return agent_layout(final)
