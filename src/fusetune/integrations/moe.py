"""Route the expert MLPs of a live transformers 5.x model through :func:`fusetune.moe_mlp`.

``route(model)`` finds every experts module transformers' ``@use_experts_implementation``
builds (Qwen3-MoE, Qwen3.5-MoE, Mixtral, gpt-oss, and any other with 3-D ``gate_up_proj`` /
``down_proj``, a gate and a SiLU or gpt-oss activation) and gives that module a forward, through
its class (:mod:`fusetune.integrations._class_forward`: one forward for every layer, so that
compiling layer by layer compiles one graph for all of them), that calls the fused op on its own
parameters, in place (no copy, no new parameters). The router, its top-k, the routing weights
and the auxiliary load-balancing loss stay transformers' own: only ``experts(hidden,
top_k_index, top_k_weights)`` changes. ``unroute(model)`` restores.

PEFT: LoRA on the experts through PEFT 0.21's ``LoraConfig(target_parameters=[...
"gate_up_proj", ..."down_proj"])`` wraps the experts module in (nested) ``ParamWrapper``
modules. ``route`` then patches the outermost wrapper: its forward reads the adapter's A and B
(views of PEFT's own ``lora_A`` / ``lora_B`` weights, per expert exactly as PEFT's
``get_delta_factors``) into a :class:`fusetune.MoeLora` on every call, so gradients reach
PEFT's parameters and the adapter's state (active, disabled, merged) is honoured. Several
active adapters at once fall back to PEFT's own forward. Without PEFT, fusetune's own adapter is
a ``MoeLora`` passed to ``moe_mlp`` directly.

Not routed (left to transformers): experts without a gate, with a post-expert norm, under
expert parallelism, or with another activation.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from fusetune.integrations import _class_forward
from fusetune.ops.moe import MoeLora, moe_mlp

# How many times the fused path ran eagerly (tests assert it moved: no silent fallback). Calls
# inside a compiled graph are not counted (see _count).
CALLS = {"moe_mlp": 0, "peft_fallback": 0}


class _Spec(NamedTuple):
    base: nn.Module  # the transformers experts module
    wrappers: tuple  # PEFT ParamWrappers around it, outermost first
    activation: str


_ROUTED = "_fusetune_moe"  # a routed module's _Routed


class _Routed(NamedTuple):
    """What a routed module keeps on itself: its activation, read by the class forward every
    routed module shares, and what ``unroute`` restores (see :mod:`._class_forward`). No
    module references: the forward finds the experts module and its PEFT wrappers from
    ``self`` on each call, so a copy of a routed model runs on its own modules."""

    activation: str
    cls: type
    original: object  # the instance-level forward before routing, if any
    had_instance_forward: bool


def _param_wrapper_type():
    try:
        from peft.tuners.lora.layer import ParamWrapper
    except ImportError:  # pragma: no cover - peft is optional
        return None
    return ParamWrapper


def _is_gpt_oss(base: nn.Module) -> bool:
    return type(base).__name__ == "GptOssExperts"


def _activation(base: nn.Module) -> str | None:
    """The activation ("swiglu" or "gpt_oss") when the module's gate is one moe_mlp computes,
    else None. A class's own ``_apply_gate`` other than transformers' default (chunk, then
    act(gate) * up) is trusted for gpt-oss only; a version without ``_apply_gate`` (an older
    5.x) chunks in its forward."""
    if _is_gpt_oss(base):
        return "gpt_oss" if hasattr(base, "alpha") and hasattr(base, "limit") else None
    apply_gate = getattr(type(base), "_apply_gate", None)
    if apply_gate is not None and apply_gate.__name__ != "_default_apply_gate":
        return None
    act = getattr(base, "act_fn", None)
    silu = type(act).__name__ in ("SiLUActivation", "SiLU") or isinstance(act, nn.SiLU)
    return "swiglu" if silu else None


def _transposed(base: nn.Module) -> bool:
    """Weights stored (in, out): transformers' flag, else gpt-oss's known layout."""
    return bool(getattr(base, "is_transposed", _is_gpt_oss(base)))


def _interleaved(base: nn.Module) -> bool:
    return not getattr(base, "is_concatenated", not _is_gpt_oss(base))


def _routable(base: nn.Module) -> str | None:
    """The activation of a transformers experts module fused by moe_mlp, else None."""
    gate_up = getattr(base, "gate_up_proj", None)
    down = getattr(base, "down_proj", None)
    if not (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor)):
        return None
    if gate_up.dim() != 3 or down.dim() != 3 or not getattr(base, "has_gate", True):
        return None
    if getattr(base, "has_post_expert_norm", False) or getattr(base, "_is_expert_parallel", False):
        return None
    biases = [getattr(base, name, None) for name in ("gate_up_proj_bias", "down_proj_bias")]
    if (biases[0] is None) != (biases[1] is None):
        return None
    return _activation(base)


def _chain(module: nn.Module, wrapper_type) -> tuple[tuple, nn.Module]:
    wrappers = []
    while wrapper_type is not None and isinstance(module, wrapper_type):
        wrappers.append(module)
        module = module.base_layer
    return tuple(wrappers), module


def _candidates(model: nn.Module):
    """(top module, spec) for each experts module, its PEFT wrappers' outermost as the top."""
    wrapper_type = _param_wrapper_type()
    inner = set()
    if wrapper_type is not None:
        inner = {id(m.base_layer) for m in model.modules() if isinstance(m, wrapper_type)}
    for module in model.modules():
        if id(module) in inner:
            continue
        wrappers, base = _chain(module, wrapper_type)
        if any(w.parameter_name not in ("gate_up_proj", "down_proj") for w in wrappers):
            continue
        activation = _routable(base)
        if activation is not None:
            yield module, _Spec(base, wrappers, activation)


def route(model: nn.Module) -> int:
    """Make every routable experts module of ``model`` run through moe_mlp; return how many
    are routed (already routed ones included; calling twice changes nothing)."""
    count = 0
    for module, spec in _candidates(model):
        if _ROUTED not in vars(module):
            restore = _class_forward.install(module, _routed_experts_forward)
            setattr(module, _ROUTED, _Routed(spec.activation, *restore))
        count += 1
    return count


def unroute(model: nn.Module) -> int:
    """Undo :func:`route` on ``model``; return how many modules were restored."""
    count = 0
    for module in list(model.modules()):
        routed = vars(module).pop(_ROUTED, None)
        if routed is not None:
            _class_forward.restore(module, *routed[1:])
            count += 1
    return count


# ----------------------------------------------------------------------------- the forward


def _peft_factors(wrapper, experts: int):
    """(A [E, r, in], B [E, out, r], scaling) of the wrapper's one active adapter, None when it
    adds nothing now (disabled, merged, no adapter here), or "many" for several adapters."""
    if wrapper.disable_adapters or wrapper.merged:
        return None
    active = [name for name in wrapper.active_adapters if name in wrapper.lora_A]
    if not active:
        return None
    if len(active) > 1:
        return "many"
    name = active[0]
    a = wrapper.lora_A[name].weight
    b = wrapper.lora_B[name].weight
    a = a.reshape(experts, -1, a.shape[-1])
    b = b.reshape(b.shape[0], -1, experts).permute(2, 0, 1)
    return a, b, float(wrapper.scaling[name])


def _lora(spec: _Spec):
    """The MoeLora of the PEFT wrappers' current state; None without one; "many" to fall back."""
    factors = {}
    experts = spec.base.gate_up_proj.shape[0]
    for wrapper in spec.wrappers:
        found = _peft_factors(wrapper, experts)
        if found == "many":
            return "many"
        if found is not None:
            factors[wrapper.parameter_name] = found
    if not factors:
        return None
    gate_up = factors.get("gate_up_proj", (None, None, 1.0))
    down = factors.get("down_proj", (None, None, gate_up[2]))
    return MoeLora(
        gate_up[0], gate_up[1], down[0], down[1], scaling=gate_up[2], down_scaling=down[2]
    )


def _routed_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """The forward of every routed module's class (one function for all layers: Dynamo guards
    the class, so compiling layer by layer compiles one graph for all of them, where a forward
    object per module compiled one per layer)."""
    routed = getattr(self, _ROUTED, None)
    if routed is None:  # unrouted, its class kept: see _class_forward.restore
        return _class_forward.base_forward(self)(hidden_states, top_k_index, top_k_weights)
    wrappers, base = _chain(self, _param_wrapper_type())
    spec = _Spec(base, wrappers, routed.activation)
    lora = _lora(spec) if spec.wrappers else None
    if lora == "many":
        _count("peft_fallback")
        return _class_forward.base_forward(self)(hidden_states, top_k_index, top_k_weights)
    base = spec.base
    out = moe_mlp(
        hidden_states,
        top_k_index,
        top_k_weights,
        base.gate_up_proj,
        base.down_proj,
        activation=spec.activation,
        gate_up_bias=getattr(base, "gate_up_proj_bias", None),
        down_bias=getattr(base, "down_proj_bias", None),
        lora=lora,
        transposed=_transposed(base),
        interleaved=_interleaved(base),
        alpha=float(getattr(base, "alpha", 1.702)),
        limit=float(getattr(base, "limit", 7.0)),
    )
    _count("moe_mlp")
    return out.to(hidden_states.dtype)


def _count(name: str) -> None:
    """Count an eager call in :data:`CALLS`. Not while compiling: Dynamo would guard on the
    count's value and compile again on every call. Compiled runs are seen through the
    profiler instead (``fusetune::moe_forward`` / ``moe_backward`` events run inside graphs)."""
    if not torch.compiler.is_compiling():
        CALLS[name] += 1
