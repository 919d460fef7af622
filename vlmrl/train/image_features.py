"""Each distinct image of a forward pass goes through the vision tower once.

GRPO samples n responses per prompt, so a micro-batch holds each prompt's image
n times over (8 in the quickstart and the step benchmark), and a multi-turn
trajectory's prompt image is in every one of its group's rows. The model
would run its vision tower on every copy: on the step benchmark's shape that
is about 12 % of a log-prob pass (0.10 s of 0.85 s, tiny Qwen2.5-VL), seven
eighths of it repeated work.

``share_image_features(model)`` wraps the ``get_image_features`` of a
Qwen2-VL / Qwen2.5-VL / Qwen3-VL model (transformers 5) so that the tower sees
each distinct image once and every copy gets the same output tensors. The
model's forward scatters the copies into the rows as before. Under autograd the
copies' gradients add up in the one output, which is the gradient of the
separate copies: the passes compute what they computed, with fewer operations.

Images are the same when their patch grids and pixels are equal (``torch.equal``
after a cheap fingerprint sorts them into buckets), so nothing relies on
tensor identity. Videos are left as they are.
"""

from __future__ import annotations

import functools
import types

import torch

from vlmrl.models import family_of

__all__ = ["distinct_images", "share_image_features"]


def share_image_features(model: torch.nn.Module) -> int:
    """Wrap the ``get_image_features`` of each module of ``model`` that holds its family's vision tower
    (``Family.vision_tower``: ``visual`` for the Qwen-VL families).

    Returns how many modules were wrapped (0 for a text model, and for one wrapped before). Call it before
    sharding or adding adapters: it sets a bound method on the module instance, which neither touches. The
    method reaches the class's own ``get_image_features`` through the module it is bound to, so a copy of the
    model (``copy.deepcopy`` rebinds bound methods to the copy) encodes with its own tower.
    """
    tower = family_of(model.config).vision_tower
    if tower is None:
        return 0
    wrapped = 0
    for module in model.modules():
        if tower not in module._modules or not hasattr(type(module), "get_image_features"):
            continue
        if getattr(module.__dict__.get("get_image_features"), "__func__", None) is _shared_get_image_features:
            continue
        module.get_image_features = types.MethodType(_shared_get_image_features, module)
        wrapped += 1
    return wrapped


def distinct_images(pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> tuple[list[int], list[int]]:
    """``(firsts, where)``: the index of the first copy of each distinct image, and for every image the position
    of its copy's first occurrence in ``firsts``.

    ``pixel_values`` holds the images' patches one image after another,
    ``grid_thw[i].prod()`` rows for image ``i``.
    """
    sizes = grid_thw.prod(-1).tolist()
    patches = torch.split(pixel_values, sizes)
    # Buckets by grid and two pixel sums (a plain one and a position-weighted one), so that torch.equal runs only
    # between images that are likely the same.
    weights = torch.arange(1, pixel_values.shape[-1] + 1, dtype=pixel_values.dtype, device=pixel_values.device)
    sums = torch.stack([pixel_values.sum(-1), pixel_values @ weights], dim=-1)
    fingerprints = [s.sum(0).tolist() for s in torch.split(sums, sizes)]
    buckets: dict[tuple, list[int]] = {}
    firsts: list[int] = []
    where: list[int] = []
    for i, image in enumerate(patches):
        key = (tuple(grid_thw[i].tolist()), *fingerprints[i])
        bucket = buckets.setdefault(key, [])
        for position in bucket:
            if torch.equal(patches[firsts[position]], image):
                where.append(position)
                break
        else:
            bucket.append(len(firsts))
            where.append(len(firsts))
            firsts.append(i)
    return firsts, where


def _shared_get_image_features(
    module: torch.nn.Module, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor | None = None, **kwargs
):
    """The module's class's ``get_image_features`` over the distinct images, each copy given its original's."""
    original = functools.partial(type(module).get_image_features, module)
    # Only the structured output (what the models' forward asks for) can be expanded without knowing the
    # family's tuple layout.
    if image_grid_thw is None or len(image_grid_thw) < 2 or not kwargs.get("return_dict"):
        return original(pixel_values, image_grid_thw, **kwargs)
    firsts, where = distinct_images(pixel_values, image_grid_thw)
    if len(firsts) == len(where):
        return original(pixel_values, image_grid_thw, **kwargs)
    sizes = image_grid_thw.prod(-1).tolist()
    patches = torch.split(pixel_values, sizes)
    out = original(torch.cat([patches[i] for i in firsts]), image_grid_thw[firsts], **kwargs)
    # Per image (a tuple, one entry per image): the merged embeddings, and Qwen3-VL's deepstack features
    # (one such tuple per deepstack layer). Each copy gets its first occurrence's tensors.
    out.pooler_output = tuple(out.pooler_output[j] for j in where)
    deepstack = getattr(out, "deepstack_features", None)
    if deepstack is not None:
        out.deepstack_features = [tuple(layer[j] for j in where) for layer in deepstack]
    # The tower's patch-level states, one image after another (no model's forward reads them): expanded
    # the same way, so the output describes every image of pixel_values.
    states = getattr(out, "last_hidden_state", None)
    unique_sizes = [sizes[i] for i in firsts]
    if isinstance(states, torch.Tensor) and states.shape[0] == sum(unique_sizes):
        pieces = torch.split(states, unique_sizes)
        out.last_hidden_state = torch.cat([pieces[j] for j in where])
    return out
