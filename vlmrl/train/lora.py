"""LoRA on the actor and the critic through peft, and the merged weights that vLLM and HF exports get.

Adapters are injected into the HF model in place (peft's ``inject_adapter_in_model``),
before FSDP2 shards it: the actor stays the HF module it was, each targeted
``nn.Linear`` replaced by peft's LoRA ``Linear``, whose frozen weight now lives
under ``<module>.base_layer`` and whose adapters under ``<module>.lora_A.default``
and ``<module>.lora_B.default``. Only the adapters require grad, so the optimizer
(built from the parameters that require grad) trains only them. The actor is
deliberately not wrapped in a ``PeftModel``: the passes, the batching and the
checkpoint code keep the HF model's attributes (``model.visual``, ``config``,
``save_pretrained``) and names without peft's ``base_model.model.`` prefix.

A LoRA critic (``vlmrl.train.critic.ValueModel``) gets its adapters the same
way, in its backbone, before its value head is made: the head is new, so it is
trained whole, beside the adapters.

The reference model under LoRA is this same module with its adapters switched
off (``adapters_disabled``): the base weights, with no second copy loaded.

vLLM and HF directories want plain weights under the HF checkpoint names.
``merged_weights`` maps a stream of gathered ``(name, full tensor)`` pairs to
``W = W0 + (alpha / rank) * B @ A`` under the base module's name, on the
gathered tensors; the live sharded model is never merged. (vLLM's own LoRA
serving would avoid the merge but needs the engine built with LoRA enabled;
merged weights keep the rollout engine as it is.)
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

from vlmrl.config import LoraConfig
from vlmrl.models import family_of

# peft (and the transformers auto classes it pulls in) is seconds of import: imported by the functions that use
# it, so that a run without LoRA (the driver, and every worker) never pays for it.
if TYPE_CHECKING:
    import peft

ADAPTER = "default"
"""peft's name for the one adapter vlmrl trains."""


def peft_config(cfg: LoraConfig, family_exclude: str | None = None) -> peft.LoraConfig:
    """The peft config of a ``model.lora`` section (rank > 0); without the section's own exclude_modules, the
    model family's (``Family.lora_exclude``: the vision tower)."""
    import peft

    targets = cfg.target_modules.strip()
    return peft.LoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        # "all-linear" is peft's own keyword (every Linear but the output head); otherwise module names.
        target_modules=targets if targets == "all-linear" else [t.strip() for t in targets.split(",") if t.strip()],
        exclude_modules=family_exclude if cfg.exclude_modules is None else cfg.exclude_modules,
        lora_dropout=0.0,  # dropout would make the actor's log-probs differ from the engine's
        bias="none",
    )


def scaling(cfg: LoraConfig) -> float:
    """The factor of the adapters' product: alpha / rank (peft's plain, non-rsLoRA scaling)."""
    return cfg.alpha / cfg.rank


def add_lora(model: torch.nn.Module, cfg: LoraConfig, key: str = "worker.actor.model.lora") -> torch.nn.Module:
    """Inject LoRA adapters into ``model`` in place (before sharding) and freeze the rest; return it.

    Raises ``ValueError`` when the targets select no module, or a module that
    is not a Linear layer (``merged_weights`` merges Linear adapters only);
    the message names the config section ``key``.
    """
    import peft
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.tuners_utils import BaseTunerLayer

    try:
        config = peft_config(cfg, family_of(model.config).lora_exclude)
        peft.inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    except ValueError as e:  # peft's "No modules were targeted for adaptation", and its other config errors
        raise ValueError(
            f"{key}: target_modules={cfg.target_modules!r} with exclude_modules="
            f"{cfg.exclude_modules!r} selects no module of the model, or peft refused it ({e}); "
            "name its Linear layers (e.g. q_proj,v_proj)"
        ) from e
    layers = {name: m for name, m in model.named_modules() if isinstance(m, BaseTunerLayer)}
    other = sorted(f"{name} ({type(m.get_base_layer()).__name__})" for name, m in layers.items()
                   if not isinstance(m, LoraLinear))  # fmt: skip
    if other:
        raise ValueError(
            f"{key}.target_modules={cfg.target_modules!r} selects layers that are not Linear: "
            f"{', '.join(other[:5])}; vlmrl merges adapters of Linear layers only, so name Linear modules "
            f"or exclude these with {key}.exclude_modules"
        )
    return model


@contextmanager
def adapters_disabled(model: torch.nn.Module):
    """Within the block ``model`` computes with its base weights only: the reference model under LoRA.

    What peft's ``PeftModel.disable_adapter()`` does, on the injected layers
    themselves (the actor is not wrapped in a ``PeftModel``). peft's switch
    also resets the adapters' ``requires_grad``; the flags are put back as
    they were, so a frozen adapter (``freeze_vision_tower``) stays frozen.
    """
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    flags = [(p, p.requires_grad) for m in layers for p in m.parameters()]
    for m in layers:
        m.enable_adapters(False)
    try:
        yield model
    finally:
        for m in layers:
            m.enable_adapters(True)
        for p, requires_grad in flags:
            p.requires_grad_(requires_grad)


def hf_name(name: str) -> str:
    """The HF checkpoint name of a LoRA model's parameter name (``PeftModel`` prefix and ``.base_layer`` dropped)."""
    return name.removeprefix("base_model.model.").replace(".base_layer.", ".")


def merged_weights(items: Iterable[tuple[str, torch.Tensor]], scale: float) -> Iterator[tuple[str, torch.Tensor]]:
    """Full weights of a LoRA model (a dict's items or a lazy stream) as merged HF weights.

    Each ``<m>.base_layer.weight`` comes out as ``<m>.weight`` = W0 + scale * B @ A
    (computed in float32, returned in W0's dtype) once its ``<m>.lora_A.default.weight``
    (r, in) and ``<m>.lora_B.default.weight`` (out, r) have arrived; in a state
    dict they follow the base weight, so at most one module waits at a time.
    Every other tensor passes through under its HF name, as it arrived. A
    module whose three parts do not all arrive is an error at the end.

    >>> w, a, b = torch.zeros(2, 3), torch.ones(1, 3), torch.tensor([[1.0], [2.0]])
    >>> dict(merged_weights([("q.base_layer.weight", w), ("q.lora_A.default.weight", a),
    ...                      ("q.lora_B.default.weight", b), ("q.base_layer.bias", torch.ones(2))], 0.5))
    {'q.weight': tensor([[0.5000, 0.5000, 0.5000],
            [1.0000, 1.0000, 1.0000]]), 'q.bias': tensor([1., 1.])}
    """
    parts = {".base_layer.weight": "W", f".lora_A.{ADAPTER}.weight": "A", f".lora_B.{ADAPTER}.weight": "B"}
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in items:
        suffix = next((s for s in parts if name.endswith(s)), None)
        if suffix is None:
            if ".lora_" in name:
                raise ValueError(f"{name}: an adapter tensor vlmrl cannot merge (only adapter {ADAPTER!r} of Linear)")
            yield hf_name(name), tensor
            continue
        module = name.removesuffix(suffix)
        have = pending.setdefault(module, {})
        have[parts[suffix]] = tensor
        if len(have) == 3:
            del pending[module]
            w = have["W"]
            a, b = (have[k].to(device=w.device, dtype=torch.float32) for k in "AB")
            yield hf_name(module) + ".weight", (w.to(torch.float32) + scale * (b @ a)).to(w.dtype)
    if pending:
        missing = {m: sorted(set("WAB") - set(have)) for m, have in pending.items()}
        raise ValueError(f"LoRA merge: modules without their base weight (W) or adapters (A, B): {missing}")
