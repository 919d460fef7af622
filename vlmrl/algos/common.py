"""Masked reductions and the config-enum base shared by the algorithm modules.

Shapes: ``bs`` sequences, ``L`` padded response length. Masks are ``(bs, L)``
0/1 (bool or numeric); masked-out positions never influence a result, even if
they hold ``nan`` or ``inf``.
"""

from __future__ import annotations

from enum import StrEnum

import torch


class ConfigEnum(StrEnum):
    """A str Enum whose error for an unknown value lists the valid ones.

    Members are named exactly like their values (``grpo = "grpo"``) because
    OmegaConf converts a YAML string to an Enum by member *name*.
    """

    @classmethod
    def _missing_(cls, value: object) -> ConfigEnum:
        valid = ", ".join(repr(m.value) for m in cls)
        raise ValueError(f"{value!r} is not a valid {cls.__name__}; choose one of: {valid}")


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``x`` where ``mask`` is set.

    Args:
        x: ``(bs, L)`` (any shape broadcastable with ``mask``).
        mask: ``(bs, L)`` 0/1 or bool.
        dim: reduce over this dim; ``None`` reduces over everything.

    Returns:
        A scalar if ``dim`` is None, else ``x`` reduced over ``dim`` (e.g. ``(bs,)``).
    """
    x = torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))
    return x.sum() if dim is None else x.sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``x`` over positions where ``mask`` is set; 0 where nothing is set.

    Args:
        x: ``(bs, L)``.
        mask: ``(bs, L)`` 0/1 or bool.
        dim: reduce over this dim; ``None`` reduces over everything.

    Returns:
        A scalar if ``dim`` is None, else ``x`` reduced over ``dim`` (e.g. ``(bs,)``).
    """
    count = masked_sum(torch.ones_like(x), mask, dim)
    # count is 0 or >= 1 for 0/1 masks; clamping keeps an empty selection at 0, not nan.
    return masked_sum(x, mask, dim) / count.clamp_min(1)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Whiten ``x`` over the masked positions of the whole batch; 0 on padding.

    ``(x - mu) / sqrt(var + eps)`` with ``mu`` the masked mean and ``var`` the
    unbiased (Bessel-corrected) masked variance, as verl's ``masked_whiten``.
    With a single valid position the variance is taken as 0.

    Args:
        x: ``(bs, L)``.
        mask: ``(bs, L)``.

    Returns:
        ``(bs, L)``.
    """
    mean = masked_mean(x, mask)  # ()
    n = masked_sum(torch.ones_like(x), mask)  # ()
    var = masked_sum((x - mean).square(), mask) / (n - 1).clamp_min(1)  # ()
    out = (x - mean) * torch.rsqrt(var + eps)
    return torch.where(mask.bool(), out, torch.zeros((), dtype=out.dtype, device=out.device))
