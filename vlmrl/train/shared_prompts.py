"""Each distinct prompt of a padded micro-batch through the model once (``worker.actor.share_prompts``).

GRPO samples n responses per prompt, and the micro-batches of similar-length
rows hold a prompt's samples side by side, so a padded pass runs the model over
the same prompt tokens n times. A causal model's states at the prompt's
positions do not depend on what follows them, so the pass can run the distinct
prompts once, keep their keys and values (transformers' cache), and then run
every row's response tokens attending to its prompt's cached keys and values.
The logit that predicts the first response token is the prompt's last one. The
log-probs, and under autograd the gradients (a prompt's states get the summed
gradient of all its rows), are those of the full pass up to float rounding: the
same operations in another order and shape, so a run's last bits, and with them
a seeded run's samples, differ from one without it. Hence off by default.

On the step benchmark's batch (32 prompts x 8 samples, prompts of about 53
tokens before 128 response tokens) it takes the positions the model body
computes in a log-prob pass from 46,656 to 34,504 (-26 %).

It applies to the padded (trimmed) layout only; a packed row holds each
sequence once and would need a block mask over the whole row instead. Rows
whose media come after the prompt (an agent's observation images) keep the
full pass, as does a micro-batch in which no two rows share a prompt.
Gradient checkpointing and a cache do not go together in transformers (it drops
the cache), so the configuration refuses the pair (``vlmrl.validate``), and
:func:`prompt_logits_and_cache` checks that the cache came back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vlmrl.records import Batch
from vlmrl.train.micro_batches import merge_mm_inputs
from vlmrl.train.packing import Trimmed


@dataclass(frozen=True)
class SharedPrompts:
    """Which rows of a micro-batch share a prompt."""

    firsts: list[int]
    """The row of each distinct prompt's first copy, in row order."""
    where: torch.Tensor
    """(b,) each row's distinct prompt: an index into ``firsts``."""


def media_token_ids(model: torch.nn.Module) -> list[int]:
    """The image and video placeholder token ids of a Qwen-VL ``model`` (none for a text model)."""
    config = getattr(model, "config", None)
    ids = [getattr(config, name, None) for name in ("image_token_id", "video_token_id")]
    return [i for i in ids if i is not None]


def find(batch: Batch, prompt_columns: int, media_ids: list[int]) -> SharedPrompts | None:
    """The distinct prompts of ``batch``'s rows, or None when sharing would save nothing or cannot apply.

    ``prompt_columns``: the width of the (trimmed) prompt part in ``batch.input_ids``' last columns before the
    responses. Rows share a prompt when their prompt tokens, mask, positions and media inputs are all equal
    (the group id only narrows the comparison). None when no two rows share one, or when a row has a media
    placeholder after its prompt, whose pixels the response pass would then need.
    """
    p = batch.prompt_length
    if prompt_columns == 0:
        return None
    if media_ids and bool(torch.isin(batch.input_ids[:, p:], torch.tensor(media_ids)).any()):
        return None
    cols = slice(p - prompt_columns, p)
    ids, mask, positions = batch.input_ids[:, cols], batch.attention_mask[:, cols], batch.position_ids[:, :, cols]
    mm = batch.mm_inputs
    firsts: list[int] = []
    where: list[int] = []
    by_group: dict[int, list[int]] = {}
    for row, group in enumerate(batch.group_ids.tolist()):
        for k in by_group.setdefault(group, []):
            first = firsts[k]
            if (
                torch.equal(ids[row], ids[first])
                and torch.equal(mask[row], mask[first])
                and torch.equal(positions[row], positions[first])
                and _same_media(mm[row], mm[first])
            ):
                where.append(k)
                break
        else:
            by_group[group].append(len(firsts))
            where.append(len(firsts))
            firsts.append(row)
    if len(firsts) == len(where):
        return None
    return SharedPrompts(firsts, torch.tensor(where))


def _same_media(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a is b or (a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a))


def forward(
    model: torch.nn.Module,
    inputs: dict,
    mm_rows: list[dict[str, torch.Tensor]],
    shared: SharedPrompts,
    prompt_columns: int,
) -> torch.Tensor:
    """The ``(b, r, V)`` logits predicting the ``r`` response columns of the trimmed ``inputs``.

    ``inputs``: ``packing.model_inputs``' trimmed inputs (input ids, mask and positions, on the model's device);
    ``mm_rows``: each row's media inputs (only the distinct prompts' go through the model).
    """
    p = prompt_columns
    device = inputs["input_ids"].device
    firsts = torch.tensor(shared.firsts, device=device)
    where = shared.where.to(device)
    positions = inputs["position_ids"]  # (3, b, S) or, for a text model, (b, S)
    mm = {key: value.to(device) for key, value in merge_mm_inputs([mm_rows[i] for i in shared.firsts]).items()}
    last, cache = prompt_logits_and_cache(
        model,
        input_ids=inputs["input_ids"][firsts, :p],
        attention_mask=inputs["attention_mask"][firsts, :p],
        position_ids=positions[..., :p].index_select(positions.dim() - 2, firsts),
        mm=mm,
    )
    for layer in cache.layers:  # every row gets its prompt's keys and values (autograd sums their gradients)
        layer.keys = layer.keys.index_select(0, where)
        layer.values = layer.values.index_select(0, where)
    r = inputs["input_ids"].shape[1] - p
    out = model(
        input_ids=inputs["input_ids"][:, p:],
        attention_mask=inputs["attention_mask"],  # (b, p + r): the cached prompt's columns, then the responses'
        position_ids=positions[..., p:],
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=r,
    )
    # The prompt's last logit predicts response column 0; response column j's predicts column j + 1.
    return torch.cat([last.index_select(0, where), out.logits[:, :-1]], dim=1)


def prompt_logits_and_cache(model: torch.nn.Module, *, mm: dict[str, torch.Tensor], **inputs):
    """``(last, cache)``: the logits at each prompt's last position ``(u, 1, V)`` and the prompts' keys and values."""
    out = model(**inputs, use_cache=True, logits_to_keep=1, **mm)
    cache = out.past_key_values
    if cache is None or cache.get_seq_length() != inputs["input_ids"].shape[1]:
        raise RuntimeError(
            "worker.actor.share_prompts: the model returned no cache of the prompts (transformers drops it under "
            "gradient checkpointing); set worker.actor.share_prompts=false or enable_gradient_checkpointing=false"
        )
    return out.logits, cache


def computed_tokens(trimmed: Trimmed, shared: SharedPrompts) -> tuple[int, int]:
    """``(real, computed)`` token positions of a shared pass: each distinct prompt once, then every row's responses."""
    p = trimmed.input_ids.shape[1] - trimmed.responses.shape[1]
    prompts = trimmed.attention_mask[shared.firsts, :p]
    responses = trimmed.attention_mask[:, p:]
    return int(prompts.sum()) + int(responses.sum()), prompts.numel() + responses.numel()
