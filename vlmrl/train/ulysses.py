"""Ulysses sequence parallelism: one packed row split over the ranks of a sequence-parallel (SP) group.

The padding-free pass (``vlmrl.train.packing``) lays a micro-batch's
sequences end to end in one row of ``T`` tokens. Under SP the ``sp`` ranks of
a group hold the same micro-batch; the row is padded to a multiple of ``sp``
and rank ``r`` runs the decoder layers on tokens ``[r T/sp, (r+1) T/sp)``
only, its 3-D rotary positions with them. In each attention layer the
queries, keys and values go from sequence-sharded to head-sharded by an
all-to-all (each rank then sees the whole row for ``heads/sp`` heads), the
attention runs causally within each of the row's packed sequences in turn
(no whole-row mask: that would be ``T x T`` per layer), and a second
all-to-all brings the output back to sequence-sharded. So the activations of
the decoder stack are ``1/sp`` of the row on each rank; the attention's
scores are each sequence's, for a share of the heads.

How it hooks into transformers (5.x): the decoder stack's attention
implementation is set to ``ATTENTION``, a function registered in
transformers' ``AttentionInterface`` that runs torch's SDPA between the
two all-to-alls. transformers builds no mask for a name it has no mask
function for; the function runs each sequence on its own from the whole row's sequence
boundaries. A forward pre-hook on the decoder stack (``model.get_decoder()``)
cuts its input embeddings and position ids to the rank's slice, after the
model has embedded the tokens and merged the image features into them.

Images and videos: the tower encodes each frame apart (an image is one frame,
a video ``t`` temporal patches), so with at least as many frames in the
micro-batch as ranks, each rank runs the tower on a contiguous run of them
and the features of all are gathered over the group (an all-gather; the
backward sums each frame's gradients on the rank that encoded it), so every
rank merges the whole row's features and keeps its slice. With fewer frames
than ranks every rank encodes them all. (Routing each frame's features to
the ranks holding its tokens only would move less, but the family's forward
merges them into the whole row's embeddings, which every rank holds, before
the decoder's slice is cut.)

Each rank's ``lm_head`` runs only on the logit positions inside its slice;
``gather`` joins the per-token values (log-probs, entropy) of the group in
row order, so the loss code sees the whole micro-batch on every rank.

Gradients: the all-to-all's backward is the same all-to-all on the
gradients. The ranks of a group compute the same loss from the same gathered
values, and each back-propagates it through its own share of the tokens, so
the group's gradients sum to the micro-batch's gradient. FSDP then averages
over all ``dp x sp`` ranks, and the loss scaling of
``update_loop.global_weight`` counts every row ``sp`` times (once per rank
holding it); the gather's backward multiplies by ``sp``, which makes the
averaged gradient that of the ``dp`` distinct shards.

Models: decoder stacks of full-attention layers that call transformers'
attention interface with ``(module, query, key, value, mask, **kwargs)`` in
the ``(batch, heads, tokens, head_dim)`` layout (tested: Qwen2.5-VL, Qwen3-VL, Qwen2 text;
``check_model`` refuses linear-attention and sliding-window layers).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

ATTENTION = "vlmrl_ulysses"
"""The attention implementation the decoder stack of a sequence-parallel model is set to."""


def data_shards(world_size: int, ulysses_size: int) -> int:
    """Distinct shards of the batch: the workers of a Ulysses group (``ulysses_size`` consecutive ranks) share one."""
    return world_size // ulysses_size


@dataclass(frozen=True)
class SequenceGroup:
    """The SP group this rank belongs to: ``size`` ranks that share micro-batches, this one at ``rank``."""

    group: dist.ProcessGroup | None
    size: int
    rank: int

    @classmethod
    def of_world(cls, sp: int) -> SequenceGroup:
        """The SP groups of consecutive ranks, ``world / sp`` of them; a collective (every rank makes every group)."""
        world, me = dist.get_world_size(), dist.get_rank()
        if world % sp:
            raise ValueError(f"ulysses_size={sp} does not divide the {world} ranks")
        mine = None
        for first in range(0, world, sp):
            group = dist.new_group(list(range(first, first + sp)))
            if first <= me < first + sp:
                mine = group
        return cls(mine, sp, me % sp)


@dataclass(frozen=True)
class Shard:
    """This rank's slice of one packed row, and where the row's response logits fall."""

    group: SequenceGroup
    length: int
    """The row's length padded to a multiple of the group size."""
    keep: torch.Tensor
    """(K,) bool: which of the row's logit positions lie in this rank's slice."""
    local_logit_index: torch.Tensor
    """(K_r,) those positions, counted from the slice's start."""
    counts: list[int]
    """Logit positions in each rank's slice, in rank order."""
    sequences: tuple[tuple[int, int], ...]
    """(start, stop) of each packed sequence in the padded row: a token attends, causally, within its own only."""

    @property
    def start(self) -> int:
        return self.group.rank * self.length // self.group.size

    @property
    def stop(self) -> int:
        return (self.group.rank + 1) * self.length // self.group.size


def split(inputs: dict, logit_index: torch.Tensor, group: SequenceGroup) -> tuple[dict, Shard]:
    """The packed ``inputs`` (``packing.model_inputs``) padded to a multiple of ``group.size``, and this rank's Shard.

    The padding is one extra sequence of token 0 with its own positions (0, 1, ...), so it attends to
    nothing real; its outputs are never read.
    """
    input_ids, positions = inputs["input_ids"], inputs["position_ids"]  # (1, T), (4, 1, T) or (1, T)
    t = input_ids.shape[1]
    length = -(-t // group.size) * group.size
    pad = length - t
    if pad:
        input_ids = torch.nn.functional.pad(input_ids, (0, pad))
        tail = torch.arange(pad, device=positions.device).expand(*positions.shape[:-1], pad)
        positions = torch.cat([positions, tail], dim=-1)
    text = positions[0] if positions.dim() == 3 else positions  # (1, length) position within each sequence
    starts = torch.ones_like(text[0], dtype=torch.bool)
    starts[1:] = text[0, 1:] != text[0, :-1] + 1  # a sequence starts where the text position does not step by one
    bounds = [*starts.nonzero().flatten().tolist(), length]
    sequences = tuple(zip(bounds[:-1], bounds[1:]))
    slice_length = length // group.size
    owner = logit_index // slice_length  # (K,) the rank whose slice holds each logit position
    counts = torch.bincount(owner.cpu(), minlength=group.size).tolist()
    keep = owner == group.rank
    shard = Shard(group, length, keep, logit_index[keep] - group.rank * slice_length, counts, sequences)
    return {**inputs, "input_ids": input_ids, "position_ids": positions}, shard


_active: Shard | None = None
"""The shard of the last ``sharded`` forward; the attention function reads it (in a checkpointed backward too)."""


def install(model: torch.nn.Module) -> None:
    """Point ``model``'s decoder stack at the Ulysses attention; its vision tower keeps its own."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, _attention)
    model.get_decoder().config._attn_implementation = ATTENTION


def check_model(model: torch.nn.Module, size: int, key: str) -> None:
    """Refuse, naming ``key``, a model whose decoder the Ulysses attention cannot split ``size`` ways.

    Every decoder layer must be full attention (a linear-attention or sliding-window layer would run on its
    slice alone), and ``size`` must divide the attention heads. Key/value heads need not divide: the attention
    repeats them to one per query head where they do not.
    """
    config = model.get_decoder().config
    other = sorted(set(getattr(config, "layer_types", None) or ["full_attention"]) - {"full_attention"})
    if other:
        raise ValueError(
            f"{key}={size}: the model's decoder has {', '.join(other)} layers, and Ulysses sequence parallelism "
            f"splits full attention only; set {key}=1 for this model"
        )
    heads = config.num_attention_heads
    if heads % size:
        raise ValueError(
            f"{key}={size}: the model has {heads} attention heads, and Ulysses sequence parallelism splits them "
            f"over the group; pick a ulysses_size that divides {heads}"
        )


@contextlib.contextmanager
def sharded(model: torch.nn.Module, shard: Shard):
    """Run ``model``'s decoder stack on this rank's slice of the row, with the Ulysses attention over the group."""
    global _active
    decoder = model.get_decoder()
    if decoder.config._attn_implementation != ATTENTION:
        raise RuntimeError("the model's decoder does not run the Ulysses attention; call ulysses.install(model) first")
    handle = decoder.register_forward_pre_hook(_slice_inputs(shard), with_kwargs=True)
    # The modules whose forward encodes images and videos (they hold the tower): each rank encodes a share of the
    # frames. Instance attributes over the class's methods (or over share_image_features' one), put back after.
    encoders = []
    if shard.group.size > 1:
        encoders = [m for m in model.modules() if "visual" in m._modules and hasattr(m, "get_image_features")]
    names = ("get_image_features", "get_video_features")
    previous = [{n: m.__dict__.get(n) for n in names} for m in encoders]
    for module in encoders:
        busy = [False]  # one share per encoding: Qwen3-VL's video method calls its image method
        for name in names:
            if hasattr(module, name):
                setattr(module, name, _frame_share(getattr(module, name), module.visual, shard.group, busy))
    _active = shard  # left set after the forward: gradient checkpointing runs the layers again in the backward
    try:
        yield
    finally:
        handle.remove()
        for module, methods in zip(encoders, previous):
            for name, method in methods.items():
                module.__dict__.pop(name, None)
                if method is not None:
                    setattr(module, name, method)


def _frame_share(inner, tower: torch.nn.Module, group: SequenceGroup, busy: list[bool]):
    """``get_image_features`` or ``get_video_features`` that encodes this rank's share of the frames and gathers
    every frame's features.

    The tower encodes each frame apart: its attention spans one ``(h, w)`` grid at a time (``cu_seqlens`` per
    temporal patch), and its positions repeat for every frame. So a video of ``t`` temporal patches is ``t``
    items of grid ``(1, h, w)`` here, as an image is one. The items are cut into ``group.size`` contiguous runs,
    one per rank, so each rank runs the tower once on a share (the FSDP-sharded tower is then called once on
    every rank). With fewer items than ranks, every rank encodes them all: a rank with none would still have to
    run the sharded tower, whose parameters the ranks gather together. The gather's backward sums the ranks'
    gradients of each frame's features on the rank that encoded it (``_GatherRows``).
    """

    def encode(pixels, grid=None, **kwargs):
        n = 0 if grid is None else int(grid[:, 0].sum())
        if busy[0] or n < group.size or not kwargs.get("return_dict"):
            return inner(pixels, grid, **kwargs)
        one = grid.clone()
        one[:, 0] = 1
        items = one.repeat_interleave(grid[:, 0], dim=0)  # (n, 3): every frame an item of its own
        patches = items.prod(-1).tolist()
        merge = tower.spatial_merge_size**2
        owner = [i * group.size // n for i in range(n)]  # contiguous runs, each rank at least one frame
        mine = [i for i in range(n) if owner[i] == group.rank]
        first, last = sum(patches[: mine[0]]), sum(patches[: mine[-1] + 1])
        busy[0] = True
        try:
            out = inner(pixels[first:last], items[mine[0] : mine[-1] + 1], **kwargs)
        finally:
            busy[0] = False
        deepstack = getattr(out, "deepstack_features", None)
        layers = [out.pooler_output, *(deepstack or [])]  # each a tuple of per-item features
        local = torch.cat([torch.cat(list(layer), dim=0) for layer in layers], dim=-1)  # (my tokens, H x layers)
        counts = [sum(p // merge for p, o in zip(patches, owner) if o == r) for r in range(group.size)]
        whole = _GatherRows.apply(local, group, counts).split([x[0].shape[-1] for x in layers], dim=-1)
        per_entry = (grid.prod(-1) // merge).tolist()  # the caller's images or videos, each its frames in order
        split = [layer.split(per_entry) for layer in whole]
        out.pooler_output = split[0]
        if deepstack is not None:
            out.deepstack_features = split[1:]
        if hasattr(out, "last_hidden_state"):  # the patch states of this rank's frames only; no forward reads them
            out.last_hidden_state = None
        return out

    return encode


def _slice_inputs(shard: Shard):
    def hook(module, args, kwargs):
        if args:
            raise RuntimeError("the decoder stack got positional arguments; the Ulysses hook reads keyword ones")
        kwargs = dict(kwargs)
        embeds = kwargs.get("inputs_embeds")
        if embeds is None:  # a text model is given its token ids
            embeds = module.embed_tokens(kwargs.pop("input_ids"))
            kwargs["input_ids"] = None
        kwargs["inputs_embeds"] = embeds[:, shard.start : shard.stop]
        kwargs["position_ids"] = kwargs["position_ids"][..., shard.start : shard.stop]
        visual = kwargs.get("visual_pos_masks")
        if visual is not None:  # Qwen3-VL's deepstack: the image features added in early layers, at image tokens
            before = int(visual[:, : shard.start].sum())
            local = visual[:, shard.start : shard.stop]
            n = int(local.sum())
            kwargs["visual_pos_masks"] = local
            kwargs["deepstack_visual_embeds"] = [e[before : before + n] for e in kwargs["deepstack_visual_embeds"]]
        return args, kwargs

    return hook


class _AllToAll(torch.autograd.Function):
    """(sp, ...) chunks: chunk ``j`` goes to rank ``j``, chunk ``i`` of the result came from rank ``i``.

    Its own inverse, so the backward is the same exchange of the gradients.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


def _tokens_to_heads(x: torch.Tensor, group: SequenceGroup) -> torch.Tensor:
    """(b, H, t, d) for this rank's t tokens -> (b, H/sp, sp*t, d) for the whole row and this rank's heads."""
    b, h, t, d = x.shape
    sp = group.size
    chunks = x.reshape(b, sp, h // sp, t, d).transpose(0, 1)  # (sp, b, H/sp, t, d): chunk j holds rank j's heads
    got = _AllToAll.apply(chunks, group.group)  # got[i]: rank i's tokens, for my heads
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // sp, sp * t, d)


def _heads_to_tokens(x: torch.Tensor, group: SequenceGroup) -> torch.Tensor:
    """(b, H/sp, T, d) for the whole row and this rank's heads -> (b, H, T/sp, d) for this rank's tokens."""
    b, h, length, d = x.shape
    sp = group.size
    chunks = x.reshape(b, h, sp, length // sp, d).permute(2, 0, 1, 3, 4)  # (sp, b, H/sp, t, d): rank j's tokens
    got = _AllToAll.apply(chunks, group.group)  # got[i]: my tokens, for rank i's heads
    return got.transpose(0, 1).reshape(b, h * sp, length // sp, d)


def _attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """SDPA over the whole packed row for a share of the heads, between two all-to-alls; output (b, t, H, d).

    Each packed sequence attends causally within itself (``is_causal`` on its own span), so no ``T x T`` mask is
    built: SDPA turns a boolean mask into a float one per layer, which a 32k-token row would make 4 GiB each.

    Query head ``j`` uses key/value head ``j // (H / H_kv)`` (transformers' ``repeat_kv``). Key/value heads
    that do not split over the group are repeated to one per query head before the exchange.
    """
    shard = _active
    if shard is None or shard.length != query.shape[2] * shard.group.size:
        raise RuntimeError("the Ulysses attention ran outside ulysses.sharded(...): the model was set up for it")
    group = shard.group
    heads, kv_heads = query.shape[1], key.shape[1]
    if kv_heads % group.size:
        key, value = (x.repeat_interleave(heads // kv_heads, dim=1) for x in (key, value))
    if group.size > 1:
        query, key, value = (_tokens_to_heads(x, group) for x in (query, key, value))
    if key.shape[1] != query.shape[1]:
        key, value = (x.repeat_interleave(query.shape[1] // key.shape[1], dim=1) for x in (key, value))
    spans = [
        torch.nn.functional.scaled_dot_product_attention(
            query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], dropout_p=dropout, is_causal=True, scale=scaling
        )
        for a, b in shard.sequences
    ]
    out = spans[0] if len(spans) == 1 else torch.cat(spans, dim=2)  # (b, H/sp, T, d)
    if group.size > 1:
        out = _heads_to_tokens(out, group)
    return out.transpose(1, 2).contiguous(), None


class _Gather(torch.autograd.Function):
    """Per-token values of each rank's slice joined in rank order; the backward keeps this rank's part, times sp."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: SequenceGroup, counts: list[int]) -> torch.Tensor:
        ctx.rank, ctx.size, ctx.counts = group.rank, group.size, counts
        longest = max(counts)
        padded = torch.nn.functional.pad(x, (0, longest - x.shape[0]))
        parts = [torch.empty_like(padded) for _ in range(group.size)]
        dist.all_gather(parts, padded.contiguous(), group=group.group)
        return torch.cat([p[:n] for p, n in zip(parts, counts)])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        start = sum(ctx.counts[: ctx.rank])
        # Every rank of the group computed the same loss; see the module docstring for the factor.
        return grad[start : start + ctx.counts[ctx.rank]] * ctx.size, None, None


class _GatherRows(torch.autograd.Function):
    """(n_r, D) rows of each rank joined in rank order on every rank; the backward sums the ranks' gradients of
    this rank's rows (each rank used the whole, for its own share of the loss)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: SequenceGroup, counts: list[int]) -> torch.Tensor:
        ctx.rank, ctx.group, ctx.counts = group.rank, group.group, counts
        padded = torch.nn.functional.pad(x, (0, 0, 0, max(counts) - x.shape[0])).contiguous()
        parts = [torch.empty_like(padded) for _ in range(group.size)]
        dist.all_gather(parts, padded, group=group.group)
        return torch.cat([p[:n] for p, n in zip(parts, counts)])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone(memory_format=torch.contiguous_format)  # reduced in place: not autograd's own tensor
        dist.all_reduce(grad, group=ctx.group)
        start = sum(ctx.counts[: ctx.rank])
        return grad[start : start + ctx.counts[ctx.rank]], None, None


def gather(values: torch.Tensor, shard: Shard) -> torch.Tensor:
    """(K_r,) values at this rank's logit positions -> (K,) the whole row's, in row order, on every rank."""
    if shard.group.size == 1:
        return values
    return _Gather.apply(values, shard.group, shard.counts)
