"""Log-probabilities and entropy from logits, numerically safe and memory-aware."""

from __future__ import annotations

from collections.abc import Callable

import torch

# Low-precision logits are upcast to float32 this many token rows at a time, so
# a (bs, L, V) float32 copy of a ~150k vocabulary never exists at once when no
# gradient is kept (reference and old-policy log-probs). With autograd on,
# backward stores each chunk anyway.
_FP32_CHUNK_TOKENS = 1024


def _rowwise_fp32(
    fn: Callable[..., tuple[torch.Tensor, ...]], logits: torch.Tensor, *rows: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """Apply ``fn(logits_2d_fp32, *rows_1d) -> ((n,), ...)`` to ``(..., V)`` logits, chunked
    when they must be upcast; returns each output as float32 of shape ``logits.shape[:-1]``."""
    flat = logits.reshape(-1, logits.shape[-1])  # (N, V)
    flat_rows = [r.reshape(-1) for r in rows]  # (N,) each
    if logits.dtype in (torch.float32, torch.float64):
        outs = fn(flat, *flat_rows)
    else:
        chunks = [
            fn(flat[i : i + _FP32_CHUNK_TOKENS].float(), *(r[i : i + _FP32_CHUNK_TOKENS] for r in flat_rows))
            for i in range(0, flat.shape[0], _FP32_CHUNK_TOKENS)
        ]
        outs = tuple(torch.cat(parts) for parts in zip(*chunks))
    return tuple(out.reshape(logits.shape[:-1]) for out in outs)


# Both go through log_softmax, which subtracts the row max before exponentiating.
# The shorter z_y - logsumexp(z) and logsumexp(z) - sum_v p_v z_v subtract two
# numbers of the logits' magnitude and lose about |z| * 6e-8 in float32.


def _entropy_of(logp: torch.Tensor) -> torch.Tensor:
    p = logp.exp()
    # p log p is taken as 0 where p = 0 (a -inf logit), not 0 * -inf = nan.
    plogp = torch.where(p > 0, p * logp, torch.zeros((), dtype=p.dtype, device=p.device))
    return -plogp.sum(-1)


def _logprobs_2d(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor]:
    return (torch.log_softmax(logits, dim=-1).gather(-1, labels[:, None]).squeeze(-1),)


def _entropy_2d(logits: torch.Tensor) -> tuple[torch.Tensor]:
    return (_entropy_of(torch.log_softmax(logits, dim=-1)),)


def _both_2d(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # One log_softmax for both: over a (tokens, vocab) block it is the pass's largest elementwise op.
    logp = torch.log_softmax(logits, dim=-1)
    log_probs = logp.gather(-1, labels[:, None]).squeeze(-1)
    with torch.no_grad():
        entropy = _entropy_of(logp)
    return log_probs, entropy


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Log-probability of each label under the softmax of its logits.

    ``log p(y) = log_softmax(z)_y = (z_y - max z) - log sum_v exp(z_v - max z)``.
    bf16/fp16 logits are upcast to float32 in chunks of tokens.

    Args:
        logits: ``(bs, L, V)``.
        labels: ``(bs, L)`` int64 token ids.

    Returns:
        ``(bs, L)`` log-probs; float32 for low-precision logits, else the logits' dtype.
    """
    if labels.shape != logits.shape[:-1]:
        raise ValueError(f"labels must be logits.shape[:-1] = {tuple(logits.shape[:-1])}; got {tuple(labels.shape)}")
    return _rowwise_fp32(_logprobs_2d, logits, labels)[0]


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the softmax distribution of each row of logits, in nats.

    ``H = -sum_v p_v log p_v`` with ``log p = log_softmax(z)`` (max-shifted, so
    stable for large logits) and ``p log p = 0`` where a logit is ``-inf``.
    bf16/fp16 logits are upcast to float32 in chunks of tokens.

    Args:
        logits: ``(..., V)``, e.g. ``(bs, L, V)``.

    Returns:
        ``(...)``, e.g. ``(bs, L)``; float32 for low-precision logits.
    """
    return _rowwise_fp32(_entropy_2d, logits)[0]


def logprobs_and_entropy(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logprobs_from_logits(logits, labels), entropy_from_logits(logits))`` from one log-softmax,
    the entropy without a gradient: a metric beside log-probs that may carry one.

    The values are those of the two functions, and the log-probs' gradient is theirs. An entropy term
    in a loss takes ``entropy_from_logits`` instead.
    """
    if labels.shape != logits.shape[:-1]:
        raise ValueError(f"labels must be logits.shape[:-1] = {tuple(logits.shape[:-1])}; got {tuple(labels.shape)}")
    log_probs, entropy = _rowwise_fp32(_both_2d, logits, labels)
    return log_probs, entropy
