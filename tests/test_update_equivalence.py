"""The actor's passes give the same numbers however the batch is cut or laid out.

Gradient accumulation is exact: (micro-batches, accumulation) = (full batch,
none). Padding-free (packed) passes give the padded passes' log-probs and
gradients, and dynamic (token-budget) micro-batches the fixed ones'.

The actor's update on the tiny Qwen2.5-VL, in process, on a batch of image
prompts with ragged response lengths (so token_mean micro-batches hold
different token counts, the case a plain 1/k average gets wrong). The
optimizer is replaced by one that records the gradient it is asked to apply.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import AutoModelForImageTextToText, AutoProcessor

from helpers.trajectories import Response, batch_of
from vlmrl.data.dataset import RLHFDataset
from vlmrl.algos import KLEstimator, LossAvgMode, PolicyLossParams, PolicyLossType, entropy_from_logits
from vlmrl.train.actor import UpdateSettings, compute_log_probs, forward_response, update_policy
from vlmrl.train.micro_batches import MicroBatching, computed_tokens, merged_mm_inputs
from vlmrl.train.critic import CriticSettings, ValueModel, compute_values, update_critic
from vlmrl.train.packing import trim
from vlmrl.rollout.engine.sampling import sampling_mask
from vlmrl.models.qwen_vision import SPECIAL_TOKENS as QWEN_MARKERS

PROMPTS, N, RESPONSE = 3, 2, 6


class RecordingOptimizer:
    """Takes the place of AdamW: ``step`` records the gradients instead of applying them."""

    def __init__(self, model: torch.nn.Module):
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.grads: list[torch.Tensor] | None = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    def step(self) -> None:
        self.grads = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in self.params]


@pytest.fixture(scope="module")
def model_and_batch(tiny_assets):
    processor = AutoProcessor.from_pretrained(tiny_assets.model_dir)
    model = AutoModelForImageTextToText.from_pretrained(tiny_assets.model_dir, dtype=torch.float32)
    dataset = RLHFDataset(
        str(tiny_assets.train_file),
        processor,
        prompt_key="problem",
        answer_key="answer",
        image_key="images",
        image_dir=None,
        max_prompt_length=128,
        min_pixels=3136,
        max_pixels=12544,
        filter_overlong_prompts=False,  # the first rows fit; checking all 256 would cost seconds
    )
    allowed = sampling_mask(processor.tokenizer, model.config.get_text_config().vocab_size, QWEN_MARKERS)
    allowed_ids = allowed.nonzero().flatten()
    gen = torch.Generator().manual_seed(0)
    lengths = [6, 1, 4, 2, 5, 3]  # ragged: micro-batches of 2 hold 7, 6 and 8 tokens
    generations = []
    for i in range(PROMPTS):
        prompt = dataset[i]
        for k in range(N):
            ids = allowed_ids[torch.randint(len(allowed_ids), (lengths[i * N + k],), generator=gen)].tolist()
            generations.append(Response(prompt, i, ids, "", None))
    batch = batch_of(
        generations,
        max_prompt_length=128,
        max_response_length=RESPONSE,
        pad_token_id=processor.tokenizer.pad_token_id,
    )
    log_probs, _ = compute_log_probs(model, batch, MicroBatching(8), allowed)
    # Old and reference log-probs a little off the current ones, so ratios leave 1 and some clip.
    batch.old_log_probs = log_probs + 0.3 * torch.randn(log_probs.shape, generator=gen)
    batch.ref_log_probs = log_probs + 0.3 * torch.randn(log_probs.shape, generator=gen)
    batch.advantages = torch.randn(len(batch), 1, generator=gen).expand(-1, RESPONSE) * batch.response_mask
    return model, batch, allowed


def update_settings(batch, micro_batch_size, loss_type, mode, padding_free=False, max_token_len=None):
    return UpdateSettings(
        samples_per_update=len(batch),
        micro_batch_size=micro_batch_size,
        ppo_epochs=1,
        loss_type=loss_type,
        loss_params=PolicyLossParams(
            clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_dual=3.0, loss_avg_mode=mode, norm_len=RESPONSE
        ),
        max_grad_norm=1e9,  # no clipping: compare the raw accumulated gradient
        entropy_coeff=0.01,
        use_kl_loss=True,
        kl_estimator=KLEstimator.low_var_kl,
        kl_coef=0.1,
        max_token_len=max_token_len,
        padding_free=padding_free,
    )


def gradients(model, batch, allowed, micro_batch_size, loss_type, mode, padding_free=False, max_token_len=None):
    settings = update_settings(batch, micro_batch_size, loss_type, mode, padding_free, max_token_len)
    optimizer = RecordingOptimizer(model)
    metrics = update_policy(model, optimizer, batch, settings, allowed).metrics
    return optimizer.grads, metrics


@pytest.mark.parametrize(
    ("loss_type", "mode"),
    [
        (PolicyLossType.default, LossAvgMode.token_mean),
        (PolicyLossType.default, LossAvgMode.seq_mean_token_mean),
        (PolicyLossType.gspo, LossAvgMode.token_mean),
    ],
)
def test_micro_batches_with_accumulation_equal_the_full_batch(model_and_batch, loss_type, mode):
    model, batch, allowed = model_and_batch
    tokens = [int(mb.response_mask.sum()) for mb in batch.split(2)]
    assert len(set(tokens)) > 1, tokens  # the micro-batches really are ragged
    full, full_metrics = gradients(model, batch, allowed, len(batch), loss_type, mode)
    accumulated, _ = gradients(model, batch, allowed, 2, loss_type, mode)
    assert any(g.abs().sum() > 0 for g in full)
    for name_param, a, f in zip(model.named_parameters(), accumulated, full):
        torch.testing.assert_close(a, f, rtol=1e-4, atol=GRAD_ATOL, msg=lambda m, n=name_param[0]: f"{n}: {m}")
    if loss_type is PolicyLossType.default:  # the clipped branches were exercised
        assert full_metrics["actor/pg_clipfrac_higher"] + full_metrics["actor/pg_clipfrac_lower"] > 0


# Float32 gradients summed in another order (other micro-batches, another CPU's kernels) differ by a few ulps of
# the largest terms: up to 2.7e-7 was seen on one machine, on gradients whose errors, were a micro-batch's
# weight wrong, would be of the gradients' own size (1e-4 and up). 1e-6 keeps that margin on any machine.
GRAD_ATOL = 1e-6


def assert_same_gradients(model, got, want):
    assert any(g.abs().sum() > 0 for g in want)
    for (name, _), a, f in zip(model.named_parameters(), got, want):
        torch.testing.assert_close(a, f, rtol=1e-4, atol=GRAD_ATOL, msg=lambda m, n=name: f"{n}: {m}")


def full_logits(model, batch, allowed, temperatures=None):
    """By hand: one forward over the whole untrimmed padded layout, the (b, R, V) logits that predict the response
    tokens, divided by each row's temperature if given, the tokens no response may hold at the float32 minimum."""
    out = model(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=batch.position_ids.transpose(0, 1),
        use_cache=False,
        logits_to_keep=RESPONSE + 1,
        **merged_mm_inputs(batch),
    )
    logits = out.logits[:, :-1].float()
    if temperatures is not None:
        logits = logits / temperatures[:, None, None]
    return logits.masked_fill(~allowed, torch.finfo(torch.float32).min)


def test_padding_free_log_probs_equal_the_padded_ones(model_and_batch):
    model, batch, allowed = model_and_batch
    share = 1 - float(batch.attention_mask.sum()) / batch.attention_mask.numel()
    assert share > 0.2, share  # the padded layout really carries padding (prompt and response)
    mask = batch.response_mask.bool()
    padded, padded_entropy = compute_log_probs(model, batch, MicroBatching(4), allowed)
    packed, packed_entropy = compute_log_probs(model, batch, MicroBatching(4, padding_free=True), allowed)
    torch.testing.assert_close(packed[mask], padded[mask], rtol=0, atol=1e-5)
    torch.testing.assert_close(packed_entropy[mask], padded_entropy[mask], rtol=0, atol=1e-5)
    assert (packed[~mask] == 0).all()


def test_padding_free_gradients_equal_the_padded_ones(model_and_batch):
    model, batch, allowed = model_and_batch
    padded, padded_metrics = gradients(model, batch, allowed, 2, PolicyLossType.default, LossAvgMode.token_mean)
    packed, packed_metrics = gradients(
        model, batch, allowed, 2, PolicyLossType.default, LossAvgMode.token_mean, padding_free=True
    )
    assert_same_gradients(model, packed, padded)
    assert packed_metrics["actor/padding_share"] == 0 < padded_metrics["actor/padding_share"]


def test_dynamic_micro_batches_equal_the_fixed_ones(model_and_batch):
    model, batch, allowed = model_and_batch
    lengths = batch.attention_mask.sum(dim=1).tolist()
    budget = max(lengths) + min(lengths)  # room for two short sequences, never two long ones
    fixed, _ = gradients(model, batch, allowed, len(batch), PolicyLossType.default, LossAvgMode.seq_mean_token_mean)
    dynamic, metrics = gradients(
        model, batch, allowed, 1, PolicyLossType.default, LossAvgMode.seq_mean_token_mean,
        padding_free=True, max_token_len=budget,
    )  # fmt: skip
    assert 1 < metrics["actor/micro_batches"] < len(batch)
    assert_same_gradients(model, dynamic, fixed)


def test_micro_batches_skip_the_columns_every_row_pads(model_and_batch):
    model, batch, allowed = model_and_batch
    groups = MicroBatching(2).groups(batch)
    lengths = batch.attention_mask.sum(dim=1)
    # Fixed micro-batches hold rows of similar length: sorted by length, then cut.
    assert [i for g in groups for i in g] == sorted(range(len(batch)), key=lambda i: int(lengths[i]))
    for rows in groups:
        mb = batch.select(rows)
        trimmed = trim(mb)
        # What is left is as wide as the micro-batch's longest prompt plus its longest response.
        prompt = int(mb.attention_mask[:, : mb.prompt_length].sum(dim=1).max())
        response = int(mb.response_mask.sum(dim=1).max())
        assert trimmed.input_ids.shape == (len(rows), prompt + response)
        assert computed_tokens(mb, padding_free=False) == len(rows) * (prompt + response)
        assert int(trimmed.attention_mask.sum()) == int(mb.attention_mask.sum())  # no real token is cut
    # The log-probs of trimmed micro-batches are the untrimmed full batch's: one forward over the whole padded
    # layout, by hand, as the actor ran it before trimming.
    trimmed_lp, _ = compute_log_probs(model, batch, MicroBatching(2), allowed)
    with torch.no_grad():
        logits = full_logits(model, batch, allowed)
    full_lp = torch.log_softmax(logits, dim=-1).gather(-1, batch.responses[..., None])[..., 0]
    mask = batch.response_mask.bool()
    torch.testing.assert_close(trimmed_lp[mask], full_lp[mask], rtol=0, atol=1e-5)


def test_an_on_policy_update_takes_its_old_log_probs_from_its_own_forward(model_and_batch):
    """With one update on freshly sampled data, old = current policy: ratio 1 (nothing clips), and the
    gradient is the one the update gets from old log-probs computed by a separate pass first."""
    model, batch, allowed = model_and_batch
    with_pass = batch.select(list(range(len(batch))))
    with_pass.old_log_probs, _ = compute_log_probs(model, batch, MicroBatching(8), allowed)
    without = batch.select(list(range(len(batch))))
    without.old_log_probs = None
    want, want_metrics = gradients(model, with_pass, allowed, 2, PolicyLossType.default, LossAvgMode.token_mean)
    settings = update_settings(batch, 2, PolicyLossType.default, LossAvgMode.token_mean)
    optimizer = RecordingOptimizer(model)
    update = update_policy(model, optimizer, without, settings, allowed, old_from_forward=True)
    assert_same_gradients(model, optimizer.grads, want)
    mask = batch.response_mask.bool()
    # The returned old log-probs and entropy are the pass's.
    torch.testing.assert_close(update.log_probs[mask], with_pass.old_log_probs[mask], rtol=0, atol=1e-5)
    _, entropy = compute_log_probs(model, batch, MicroBatching(8), allowed)
    torch.testing.assert_close(update.entropy[mask], entropy[mask], rtol=0, atol=1e-5)
    assert update.metrics["actor/pg_clipfrac_higher"] == update.metrics["actor/pg_clipfrac_lower"] == 0
    assert update.metrics["actor/ppo_kl"] == pytest.approx(0.0, abs=1e-7)
    assert update.metrics["actor/pg_loss"] == pytest.approx(want_metrics["actor/pg_loss"], rel=1e-4, abs=1e-6)
    # More than one update per batch needs the pass: the second epoch's old policy is not the current one.
    two_epochs = dataclasses.replace(settings, ppo_epochs=2)
    with pytest.raises(RuntimeError, match="old_log_prob_pass=always"):
        update_policy(model, RecordingOptimizer(model), without, two_epochs, allowed, old_from_forward=True)


def test_the_critic_values_and_gradients_are_the_same_padded_packed_or_budgeted(tiny_assets, model_and_batch):
    _, batch, _ = model_and_batch
    critic = ValueModel.from_pretrained(str(tiny_assets.model_dir), torch.float32, trust_remote_code=False)
    # The head starts at zero, which would make every value 0 and every layout agree trivially.
    torch.nn.init.normal_(critic.value_head.weight, std=0.5, generator=torch.Generator().manual_seed(1))
    mask = batch.response_mask.bool()
    lengths = batch.attention_mask.sum(dim=1).tolist()
    budget = max(lengths) + min(lengths)
    padded = compute_values(critic, batch, MicroBatching(2))
    packed = compute_values(critic, batch, MicroBatching(2, padding_free=True))
    budgeted = compute_values(critic, batch, MicroBatching(1, max_token_len=budget))
    # The reference: one forward over the whole untrimmed padded layout, by hand.
    with torch.no_grad():
        hidden = critic.backbone(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            position_ids=batch.position_ids.transpose(0, 1),
            use_cache=False,
            **merged_mm_inputs(batch),
        ).last_hidden_state
        full = critic.value_head(hidden).squeeze(-1)[:, -RESPONSE - 1 : -1]
    assert full[mask].abs().min() > 0
    for got in (padded, packed, budgeted):
        torch.testing.assert_close(got[mask], full[mask], rtol=0, atol=1e-5)

    values_batch = batch.select(list(range(len(batch))))
    values_batch.values = padded
    values_batch.returns = padded + torch.randn(padded.shape, generator=torch.Generator().manual_seed(2))
    grads = {}
    for name, (micro, budget_, padding_free) in {
        "padded": (2, None, False), "packed": (2, None, True), "budgeted": (1, budget, True),
    }.items():  # fmt: skip
        settings = CriticSettings(
            samples_per_update=len(batch), micro_batch_size=micro, ppo_epochs=1, cliprange_value=0.5,
            loss_avg_mode=LossAvgMode.token_mean, max_grad_norm=1e9, norm_len=RESPONSE,
            max_token_len=budget_, padding_free=padding_free,
        )  # fmt: skip
        optimizer = RecordingOptimizer(critic)
        update_critic(critic, optimizer, values_batch, settings)
        grads[name] = optimizer.grads
    # The random head makes the critic's gradients larger than the actor's, and their float noise with them:
    # compared per parameter, as a share of the gradient's norm.
    assert any(g.abs().sum() > 0 for g in grads["padded"])
    for other in ("packed", "budgeted"):
        for (name, _), a, f in zip(critic.named_parameters(), grads[other], grads["padded"]):
            assert float((a - f).norm()) <= 1e-4 * float(f.norm()) + 1e-9, (other, name)


def test_an_entropy_term_in_the_loss_gets_the_entropy_gradient(model_and_batch):
    # As a metric the entropy is detached (one log-softmax serves it and the log-probs); with entropy_grad (the
    # update's entropy bonus) it carries the gradient of the entropy computed by hand from the model's logits.
    model, batch, allowed = model_and_batch
    mask = batch.response_mask
    _, metric = forward_response(model, batch, allowed)
    assert not metric.requires_grad
    model.zero_grad(set_to_none=True)
    _, bonus = forward_response(model, batch, allowed, entropy_grad=True)
    torch.testing.assert_close(bonus.detach(), metric)
    (bonus * mask).sum().backward()
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    (entropy_from_logits(full_logits(model, batch, allowed)) * mask).sum().backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    assert_same_gradients(model, got, want)


@pytest.mark.parametrize("padding_free", [False, True])
def test_log_probs_are_of_each_rows_sampling_temperature(model_and_batch, padding_free):
    # Rows sampled at temperature T are scored under softmax(z / T); rows at T = 1 skip the division.
    # By hand, on the untrimmed batch: log_softmax(z / T)_y, with rows at 0.5, 1 and 2.
    model, batch, allowed = model_and_batch
    mixed = batch.select(list(range(len(batch))))
    mixed.temperatures = torch.tensor([0.5, 1.0, 2.0] * (len(batch) // 3))
    lp, _ = compute_log_probs(model, mixed, MicroBatching(4, padding_free=padding_free), allowed)
    with torch.no_grad():
        logits = full_logits(model, batch, allowed, mixed.temperatures)
    want = torch.log_softmax(logits, dim=-1).gather(-1, batch.responses[..., None])[..., 0]
    mask = batch.response_mask.bool()
    torch.testing.assert_close(lp[mask], want[mask], rtol=0, atol=1e-5)
