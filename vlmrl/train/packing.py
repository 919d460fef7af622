"""Padding-free passes for Qwen2/2.5/3-VL and text causal LMs: a padded micro-batch packed into one row of real tokens.

The ``Batch`` stays padded (left-padded prompts, right-padded responses) so
that shards from different workers concatenate; only the model's forward sees
the packed row. Packing keeps each token's own rotary positions (the
dataset's 3-D mrope ids, carried in ``Batch.position_ids``) and puts a fourth
row in front: the plain text position, 0 .. L-1 within each sequence.
transformers' Qwen-VL models (5.x) take that 4-row form and, with no attention
mask, build a causal mask that restarts wherever the text row does not step by
one (SDPA), or call varlen flash-attention on those boundaries, so no token
attends across sequences. ``lm_head`` runs only on the positions that predict
response tokens (``logits_to_keep`` given as indices).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vlmrl.records import Batch


@dataclass(frozen=True)
class Packed:
    input_ids: torch.Tensor
    """(1, T) the real tokens of every sequence, end to end."""
    position_ids: torch.Tensor
    """(4, 1, T) text position within its sequence, then temporal / height / width."""
    logit_index: torch.Tensor
    """(K,) packed positions whose logits predict the K response tokens."""
    targets: torch.Tensor
    """(K,) the response tokens."""
    rows: torch.Tensor
    """(K,) each response token's row in the padded (b, R) layout."""
    cols: torch.Tensor
    """(K,) and its column there."""

    def unpack(self, values: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
        """(K,) per-response-token values into the padded ``shape`` (b, R), zeros on padding."""
        out = values.new_zeros(shape)
        out[self.rows, self.cols] = values
        return out


def pack(batch: Batch) -> Packed:
    """Drop the padding of ``batch`` and lay its sequences end to end (row order kept)."""
    mask = batch.attention_mask.bool()  # (b, S)
    b, s = mask.shape
    prompt_length = batch.prompt_length
    lengths = mask.sum(dim=1)  # (b,)
    # Row-major selection keeps each sequence's tokens together and in order:
    # the real tokens of a row are contiguous (left-padded prompt, right-padded response).
    input_ids = batch.input_ids[mask]  # (T,)
    mrope = batch.position_ids.transpose(0, 1)[:, mask]  # (3, T)
    starts = torch.cumsum(lengths, 0) - lengths  # (b,) each sequence's first packed index
    text = torch.arange(input_ids.shape[0]) - torch.repeat_interleave(starts, lengths)  # (T,)
    packed_index = torch.cumsum(mask.flatten().long(), 0).view(b, s) - 1  # (b, S) packed index of each real token
    response_mask = batch.response_mask.bool()
    if (response_mask & ~mask[:, prompt_length:]).any():
        raise ValueError("response_mask marks tokens that attention_mask leaves out; the batch is malformed")
    rows, cols = response_mask.nonzero(as_tuple=True)  # (K,), (K,)
    # The logit at the token before a response token predicts it.
    logit_index = packed_index[rows, prompt_length + cols] - 1
    return Packed(
        input_ids=input_ids[None],
        position_ids=torch.cat([text[None], mrope], dim=0)[:, None, :],
        logit_index=logit_index,
        targets=batch.responses[rows, cols],
        rows=rows,
        cols=cols,
    )


def padding_share(batch: Batch) -> float:
    """Share of the (b, S) padded layout that is padding."""
    return 1.0 - float(batch.attention_mask.sum()) / batch.attention_mask.numel()


@dataclass(frozen=True)
class Trimmed:
    """A padded micro-batch without the columns that are padding in every one of its rows."""

    input_ids: torch.Tensor
    """(b, p + r) the kept prompt columns, then the kept response columns."""
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    """(b, 3, p + r) mrope positions of the kept columns (a token keeps its own position)."""
    responses: torch.Tensor
    """(b, r) the kept response columns."""


def trim(batch: Batch) -> Trimmed:
    """Drop the prompt columns left of every row's first token and the response columns right of every row's last.

    The batch pads each prompt to ``max_prompt_length`` and each response to
    ``max_response_length``; a micro-batch of shorter rows would otherwise run
    the model over columns no row uses. Masked columns change no real token's
    output, and each token keeps its own position ids, so the result is the same.
    """
    mask = batch.attention_mask.bool()
    p = batch.prompt_length
    used = mask.any(dim=0)  # (S,) columns some row uses
    prompt_used = used[:p].nonzero()
    first = int(prompt_used[0]) if len(prompt_used) else p  # prompts are left-padded
    response_used = used[p:].nonzero()
    r = int(response_used[-1]) + 1 if len(response_used) else 1  # responses are right-padded; keep one column
    cols = slice(first, p + r)
    return Trimmed(
        input_ids=batch.input_ids[:, cols],
        attention_mask=batch.attention_mask[:, cols],
        position_ids=batch.position_ids[:, :, cols],
        responses=batch.responses[:, :r],
    )


def is_text_only(model: torch.nn.Module) -> bool:
    """Whether ``model`` is a text-only causal LM (or a critic on one): its config has no ``vision_config``.

    A text model takes plain ``(b, S)`` positions; a Qwen-VL model the 3-D mrope ones.
    """
    config = getattr(model, "config", None)
    if config is None:  # the critic: a value head on a backbone
        config = model.backbone.config
    return not hasattr(config, "vision_config")


def model_inputs(
    batch: Batch, padding_free: bool, device: torch.device, text_only: bool = False
) -> tuple[dict, Packed | Trimmed]:
    """The model's token inputs for ``batch`` on ``device``, packed into one row or trimmed, and that layout.

    Packed rows carry no attention mask: the text-position row marks where each sequence starts.
    Trimmed rows carry their mask and the (3, b, S) positions Qwen-VL expects. ``text_only`` (a causal LM):
    the text positions alone, (1, T) packed or (b, S) trimmed; a text token's three mrope rows are equal to
    its text position anyway, so the records keep one layout for both kinds of model.
    """
    if padding_free:
        packed = pack(batch)
        positions = packed.position_ids[0] if text_only else packed.position_ids  # (1, T) or (4, 1, T)
        inputs = {
            "input_ids": packed.input_ids.to(device),
            "attention_mask": None,
            "position_ids": positions.to(device),
        }
        return inputs, packed
    trimmed = trim(batch)
    positions = trimmed.position_ids[:, 0] if text_only else trimmed.position_ids.transpose(0, 1)  # (b, S) or (3, b, S)
    inputs = {
        "input_ids": trimmed.input_ids.to(device),
        "attention_mask": trimmed.attention_mask.to(device),
        "position_ids": positions.to(device),
    }
    return inputs, trimmed
