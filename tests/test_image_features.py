"""Each distinct image of a pass goes through the vision tower once (vlmrl.train.image_features).

The passes' micro-batches hold a prompt's image once per sample. With the
vision tower's features shared between copies, a pass must compute the same
log-probs and the same gradients as the model that encodes every copy, on
each family's tiny model (Qwen3-VL's deepstack features included), while the
tower sees only the distinct images.
"""

from __future__ import annotations

import pytest
import torch
from helpers.tiny_families import FAMILIES, family_prompts
from transformers import AutoModelForImageTextToText

from vlmrl.records import Trajectory
from vlmrl.records.views import to_batch
from vlmrl.train.actor import forward_response
from vlmrl.train.image_features import distinct_images, share_image_features

SAMPLES = 3  # per prompt: each prompt's image is in the batch three times


def test_distinct_images_groups_equal_pixels_and_grids():
    torch.manual_seed(0)
    a, b = torch.randn(4, 6), torch.randn(4, 6)
    changed = a.clone()
    changed[2, 3] += 1e-3  # one value differs: another image
    pixels = torch.cat([a, b, a, changed, b, a[:2], a[2:]])
    grids = torch.tensor([[1, 2, 2]] * 5 + [[1, 1, 2], [1, 1, 2]])
    firsts, where = distinct_images(pixels, grids)
    # a, b, a, a', b, then a's first half and its second half (each its own grid, different pixels)
    assert firsts == [0, 1, 3, 5, 6]
    assert where == [0, 1, 0, 2, 1, 3, 4]


def test_distinct_images_tells_apart_images_with_equal_fingerprints():
    """Two images whose pixel sums and weighted sums agree are still two images (torch.equal decides)."""
    a = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
    b = torch.tensor([[0.0, 1.0, 1.0, 0.0]])  # same sum 2 and the same weighted sum 1 + 4 = 2 + 3
    grid = torch.tensor([[1, 1, 1], [1, 1, 1]])
    assert distinct_images(torch.cat([a, b]), grid) == ([0, 1], [0, 1])


@pytest.fixture(scope="module", params=FAMILIES)
def family_batch(request, tiny_assets, tmp_path_factory):
    """Two tiny models of a family with the same weights, and a batch of 2 prompts x SAMPLES responses."""
    path, prompts, allowed = family_prompts(request.param, tmp_path_factory.mktemp(request.param), tiny_assets.train_file)
    torch.manual_seed(0)
    models = [AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32) for _ in range(2)]
    allowed_ids = allowed.nonzero().flatten()
    rows = [
        Trajectory.single_turn(p, g, k, allowed_ids[torch.randint(len(allowed_ids), (6,))].tolist(), "", 1.0)
        for g, p in enumerate(prompts)
        for k in range(SAMPLES)
    ]
    batch = to_batch(rows, max_prompt_length=2048, max_response_length=6, pad_token_id=0)
    return models, batch, allowed


def _images_seen(model) -> list[int]:
    """Records, per call of the vision tower, how many images it encoded."""
    seen: list[int] = []
    model.model.visual.register_forward_hook(
        lambda _module, _args, kwargs, _out: seen.append(len(kwargs["grid_thw"])), with_kwargs=True
    )
    return seen


def test_shared_image_features_give_the_same_log_probs_and_gradients(family_batch):
    (plain, shared), batch, allowed = family_batch
    assert share_image_features(shared) == 1
    assert share_image_features(shared) == 0  # wrapped once only
    seen_plain, seen_shared = _images_seen(plain), _images_seen(shared)
    results = []
    for model in (plain, shared):
        model.zero_grad(set_to_none=True)
        log_probs, entropy = forward_response(model, batch, allowed)
        (log_probs * batch.response_mask).sum().backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
        results.append((log_probs.detach(), entropy.detach(), grads))
    assert seen_plain == [2 * SAMPLES] and seen_shared == [2]  # six copies, two distinct images
    (lp0, ent0, g0), (lp1, ent1, g1) = results
    torch.testing.assert_close(lp1, lp0, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent1, ent0, rtol=1e-5, atol=1e-5)
    assert g1.keys() == g0.keys()
    visual = [name for name in g0 if ".visual." in f".{name}"]
    assert visual, "the vision tower got no gradient: the test would not see a wrong expansion"
    for name in g0:
        # Each copy's gradient reaches the one shared output: the tower's gradient is the copies' sum.
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-4, atol=1e-6, msg=name)


def test_distinct_rows_are_not_merged(family_batch):
    """A batch whose rows all have their own image runs the tower on every one, as the model alone would."""
    (_plain, shared), batch, allowed = family_batch
    share_image_features(shared)
    seen = _images_seen(shared)
    one_per_prompt = batch.select([0, SAMPLES])
    with torch.no_grad():
        forward_response(shared, one_per_prompt, allowed)
    assert seen[-1] == 2


def test_a_copy_of_the_model_encodes_with_its_own_tower(family_batch):
    """``copy.deepcopy`` of a wrapped model: the copy's wrapper runs the copy's tower, not the original's."""
    import copy

    (_plain, shared), batch, allowed = family_batch
    share_image_features(shared)
    clone = copy.deepcopy(shared)
    seen_original, seen_clone = _images_seen(shared), _images_seen(clone)
    with torch.no_grad():
        forward_response(clone, batch, allowed)
    assert seen_clone == [2] and seen_original == []
