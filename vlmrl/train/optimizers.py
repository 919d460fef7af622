"""The optimizers of ``optim.strategy``: torch's AdamW, and AdamW with bfloat16 states (``adamw_bf16``).

``adamw_bf16`` is EasyR1's option for saving optimizer memory (there: the
``AnyPrecisionAdamW`` of llama-cookbook): both Adam moments are stored in
bfloat16, half the bytes of float32 states. Written here from the AdamW
update (Loshchilov & Hutter, decoupled weight decay): each step upcasts the
moments, computes the update in float32 and stores the moments back in
bfloat16. A bfloat16 parameter also gets Kahan summation: a bfloat16 buffer
keeps the part of each update that rounding to bfloat16 dropped and adds it
to the next one, so updates smaller than the parameter's last bit still add
up (with lr 1e-6 and weights near 1, every plain bfloat16 update would be lost).
"""

from __future__ import annotations

import math

import torch

from vlmrl.config.options import OptimizerStrategy

__all__ = ["BF16StateAdamW", "build_optimizer"]


class BF16StateAdamW(torch.optim.Optimizer):
    """AdamW with its moments in ``state_dtype`` (bfloat16 by default) and Kahan-compensated bfloat16 parameters."""

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        state_dtype: torch.dtype = torch.bfloat16,
    ):
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})
        self.state_dtype = state_dtype

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, decay = group["lr"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, dtype=self.state_dtype)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=self.state_dtype)
                    if p.dtype == torch.bfloat16:
                        state["compensation"] = torch.zeros_like(p, dtype=torch.bfloat16)
                state["step"] += 1
                t = float(state["step"])
                grad = p.grad.float()
                m = state["exp_avg"].float().mul_(beta1).add_(grad, alpha=1 - beta1)
                v = state["exp_avg_sq"].float().mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                state["exp_avg"].copy_(m)
                state["exp_avg_sq"].copy_(v)
                # AdamW: p <- p - lr * wd * p - lr * m_hat / (sqrt(v_hat) + eps), with the bias corrections
                # m_hat = m / (1 - beta1^t) and v_hat = v / (1 - beta2^t); the moments used are the float32
                # values before they were rounded for storage.
                denom = (v.sqrt() / math.sqrt(1 - beta2**t)).add_(eps)
                update = (m / denom).mul_(-lr / (1 - beta1**t))  # m may be the stored moment itself (float32)
                weights = p.float().clone()
                if decay:
                    update.add_(weights, alpha=-lr * decay)
                if "compensation" in state:
                    exact = weights.add_(update).add_(state["compensation"].float())
                    p.copy_(exact)
                    state["compensation"].copy_(exact - p.float())  # what rounding to bfloat16 dropped
                else:
                    p.copy_(weights.add_(update))  # weights is a copy: the decay above read the old values
        return loss


def build_optimizer(params, optim) -> torch.optim.Optimizer:
    """The optimizer ``optim.strategy`` names, over ``params``, with the section's lr, betas and weight decay."""
    params = list(params)
    kwargs = {"lr": optim.lr, "betas": tuple(optim.betas), "weight_decay": optim.weight_decay}
    if optim.strategy is OptimizerStrategy.adamw_bf16:
        return BF16StateAdamW(params, **kwargs)
    return torch.optim.AdamW(params, **kwargs)
