"""Route a PEFT LoRA model's projections through fusetune's LoRA ops.

    model = peft.get_peft_model(model, LoraConfig(..., lora_dropout=0.0))
    fusetune.integrations.peft.apply(model)    # patches forwards in place; returns the model
    ...train...
    fusetune.integrations.peft.unpatch(model)  # PEFT's own forwards back, exactly

What is routed (modules found by attribute name, as transformers' Llama / Mistral / Qwen /
Gemma layers name them):
- an MLP with ``gate_proj``, ``up_proj``, ``down_proj`` (all three LoRA layers) and an
  ``act_fn`` that is silu, gelu or tanh-gelu: :func:`fusetune.lora_mlp`;
- an attention with ``q_proj``, ``k_proj``, ``v_proj`` all LoRA layers: :func:`fusetune.lora_qkv`
  (q computes all three; k and v hand out the results when called with the same input, as the
  attention forward does; otherwise they compute their own);
- every other LoRA linear layer (``o_proj``, or q and v when k has no adapter):
  :func:`fusetune.lora_linear`.

A LoRA layer qualifies with one active adapter, lora_dropout == 0, no DoRA (or other LoRA
variant), no LoRA bias, a frozen nn.Linear base, and adapters in float32 or the base dtype.
A layer that does not is left on PEFT's path, with one warning naming it and the reason. The
checks run again on every call, so merging, ``disable_adapter()`` or switching adapters later
falls back to PEFT's forward for that call.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from fusetune.ops.lora import lora_linear, lora_mlp, lora_qkv

_PATCH = "_fusetune_peft_patch"
_SKIPPED = "_fusetune_peft_skipped"
# Reasons that are modes PEFT handles on its own path, not a limitation: no warning.
_QUIET_REASONS = ("adapters disabled", "adapter merged into the base weight")


@dataclass
class _Patch:
    """What ``unpatch`` restores: the module's instance-level forward before patching (None
    when it used its class's)."""

    original: Callable | None
    had_instance_forward: bool
    warned: set[str] = field(default_factory=set)


# ----------------------------------------------------------------------------- qualification


def _lora_linear_class():
    from peft.tuners.lora.layer import Linear

    return Linear


def is_lora_layer(module: torch.nn.Module) -> bool:
    """A PEFT LoRA linear layer (any state)."""
    try:
        return isinstance(module, _lora_linear_class())
    except ImportError:  # pragma: no cover - peft missing
        return False


def lora_reason(layer: torch.nn.Module) -> str | None:
    """Why ``layer`` (a PEFT LoRA linear layer) cannot take fusetune's path now; None if it can."""
    base = layer.get_base_layer()
    if not isinstance(base, torch.nn.Linear) or not base.weight.dtype.is_floating_point:
        return f"its base layer is {type(base).__name__}, not a floating-point nn.Linear"
    if layer.disable_adapters:
        return "adapters disabled"
    if layer.merged:
        return "adapter merged into the base weight"
    active = [name for name in layer.active_adapters if name in layer.lora_A]
    if len(active) != 1:
        return f"{len(active)} active adapters on it (fusetune takes exactly one)"
    name = active[0]
    if layer.use_dora.get(name, False):
        return "DoRA (use_dora=True)"
    variant = getattr(layer, "lora_variant", {}).get(name)
    if variant is not None:
        return f"LoRA variant {type(variant).__name__}"
    dropout = layer.lora_dropout[name]
    if not isinstance(dropout, torch.nn.Identity) and getattr(dropout, "p", 1.0) > 0:
        return f"lora_dropout={getattr(dropout, 'p', '?')} (fusetune needs 0)"
    if layer.lora_B[name].bias is not None or layer.lora_A[name].bias is not None:
        return "LoRA bias (lora_bias=True)"
    if base.weight.requires_grad or (base.bias is not None and base.bias.requires_grad):
        return "its base layer is trainable (fusetune keeps the base frozen)"
    lora_a, lora_b = layer.lora_A[name].weight, layer.lora_B[name].weight
    if lora_a.dtype != lora_b.dtype or lora_a.dtype not in (torch.float32, base.weight.dtype):
        return (
            f"adapters in {lora_a.dtype} / {lora_b.dtype} beside a {base.weight.dtype} base "
            "(fusetune takes float32 or the base dtype)"
        )
    return None


def _projection(layer: torch.nn.Module) -> tuple:
    """(weight, lora_a, lora_b, scaling, bias) of a qualifying layer's active adapter."""
    name = next(n for n in layer.active_adapters if n in layer.lora_A)
    base = layer.get_base_layer()
    return (
        base.weight,
        layer.lora_A[name].weight,
        layer.lora_B[name].weight,
        layer.scaling[name],
        base.bias,
    )


_PROBE_ACTIVATIONS = {
    "swiglu": F.silu,
    "geglu": F.gelu,
    "geglu_tanh": functools.partial(F.gelu, approximate="tanh"),
}


def mlp_activation(act_fn: Callable) -> str | None:
    """lora_mlp's activation name for ``act_fn``, recognised by its values (not its class)."""
    probe = torch.linspace(-6.0, 6.0, 241)
    try:
        values = act_fn(probe)
    except Exception:  # noqa: BLE001 - an activation we cannot probe is one we do not route
        return None
    for name, reference in _PROBE_ACTIVATIONS.items():
        if torch.allclose(values, reference(probe), rtol=1e-5, atol=1e-6):
            return name
    return None


# ----------------------------------------------------------------------------- patched forwards


def _original_forward(module: torch.nn.Module, patch: _Patch) -> Callable:
    if patch.had_instance_forward:
        return patch.original
    return type(module).forward.__get__(module)


def _linear_forward(layer, name, x, *args, **kwargs):
    patch = getattr(layer, _PATCH)
    reason = "extra forward arguments (e.g. adapter_names)" if args or kwargs else None
    reason = reason or lora_reason(layer)
    if reason is not None:
        return _call_original(layer, patch, name, reason, x, *args, **kwargs)
    weight, lora_a, lora_b, scaling, bias = _projection(layer)
    return lora_linear(x, weight, lora_a, lora_b, scaling, bias=bias)


def _call_original(module, patch: _Patch, name: str, reason: str, *args, **kwargs):
    if reason not in _QUIET_REASONS and reason not in patch.warned:
        patch.warned.add(reason)
        _warn(name, reason)
    return _original_forward(module, patch)(*args, **kwargs)


def _mlp_forward(mlp, name, activation, x, *args, **kwargs):
    patch = getattr(mlp, _PATCH)
    layers = (mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    reason = "extra forward arguments" if args or kwargs else None
    for layer in layers:
        reason = reason or lora_reason(layer)
    if reason is not None:
        return _call_original(mlp, patch, name, reason, x, *args, **kwargs)
    return lora_mlp(x, *(_projection(layer) for layer in layers), activation)


class _QKVGroup:
    """q_proj computes q, k and v in one lora_qkv call and keeps k and v for the k_proj and
    v_proj calls that follow with the same input (each result handed out once)."""

    def __init__(self, layers):
        self.layers = layers
        self.pending: list | None = None

    def forward(self, index: int, name: str, x, *args, **kwargs):
        layer = self.layers[index]
        if index > 0:
            pending, self.pending = self.pending, None
            if pending is not None and pending[0] is x and not args and not kwargs:
                result = pending[index]
                if index == 1:
                    self.pending = [x, None, pending[2]]
                return result
            return _linear_forward(layer, name, x, *args, **kwargs)
        self.pending = None
        reason = "extra forward arguments" if args or kwargs else None
        for each in self.layers:
            reason = reason or lora_reason(each)
        if reason is not None:
            return _linear_forward(layer, name, x, *args, **kwargs)
        q, k, v = lora_qkv(x, *(_projection(each) for each in self.layers))
        self.pending = [x, k, v]
        return q


# ----------------------------------------------------------------------------- apply / unpatch


def _warn(name: str, reason: str) -> None:
    warnings.warn(
        f"fusetune.integrations.peft: {name} stays on PEFT's path: {reason}",
        UserWarning,
        stacklevel=3,
    )


def _install(module: torch.nn.Module, forward: Callable) -> None:
    had_instance = "forward" in module.__dict__
    setattr(module, _PATCH, _Patch(module.__dict__.get("forward"), had_instance))
    module.forward = forward


def _skip(module: torch.nn.Module, name: str, reason: str) -> None:
    """Leave ``module`` on PEFT's path, saying why once."""
    if getattr(module, _SKIPPED, None) != reason:
        setattr(module, _SKIPPED, reason)
        if reason not in _QUIET_REASONS:
            _warn(name, reason)


def apply(model: torch.nn.Module) -> torch.nn.Module:
    """Patch ``model``'s LoRA MLPs, q/k/v projections and other LoRA linear layers (in place)
    to run through fusetune's ops; see the module doc for what qualifies. Idempotent. Returns
    ``model``."""
    _lora_linear_class()  # ImportError early when peft is missing
    named = dict(model.named_modules())
    handled: set[str] = set()
    for name, module in named.items():
        if hasattr(module, _PATCH):
            handled.update(_children(name, module))
            continue
        if _is_mlp(module):
            _patch_mlp(name, module, handled)
        elif _is_qkv(module):
            _patch_qkv(name, module, handled)
    for name, module in named.items():
        if name in handled or hasattr(module, _PATCH) or not is_lora_layer(module):
            continue
        reason = lora_reason(module)
        if reason is not None:
            _skip(module, name, reason)
        else:
            _install(module, functools.partial(_linear_forward, module, name))
    return model


def _children(prefix: str, module: torch.nn.Module) -> list[str]:
    names = ("gate_proj", "up_proj", "down_proj", "q_proj", "k_proj", "v_proj")
    return [f"{prefix}.{n}" if prefix else n for n in names if hasattr(module, n)]


def _is_mlp(module: torch.nn.Module) -> bool:
    projections = [getattr(module, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    return hasattr(module, "act_fn") and all(
        p is not None and is_lora_layer(p) for p in projections
    )


def _is_qkv(module: torch.nn.Module) -> bool:
    projections = [getattr(module, n, None) for n in ("q_proj", "k_proj", "v_proj")]
    return all(p is not None and is_lora_layer(p) for p in projections)


def _patch_mlp(name: str, mlp: torch.nn.Module, handled: set[str]) -> None:
    activation = mlp_activation(mlp.act_fn)
    if activation is None:
        _skip(mlp, name, f"act_fn {type(mlp.act_fn).__name__} is not silu, gelu or tanh-gelu")
        return  # its LoRA layers go through lora_linear one by one
    layers = (mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    reasons = [lora_reason(layer) for layer in layers]
    if any(reasons):
        return  # each layer is judged (and warned about) on its own below
    if len({layer.get_base_layer().weight.dtype for layer in layers}) > 1:
        _skip(mlp, name, "gate, up and down base weights of different dtypes")
        return
    _install(mlp, functools.partial(_mlp_forward, mlp, name, activation))
    handled.update(_children(name, mlp))


def _patch_qkv(name: str, attention: torch.nn.Module, handled: set[str]) -> None:
    layers = (attention.q_proj, attention.k_proj, attention.v_proj)
    if any(lora_reason(layer) for layer in layers):
        return
    if len({layer.get_base_layer().weight.dtype for layer in layers}) > 1:
        return  # one by one through lora_linear
    group = _QKVGroup(layers)
    for index, (suffix, layer) in enumerate(
        zip(("q_proj", "k_proj", "v_proj"), layers, strict=True)
    ):
        child = f"{name}.{suffix}" if name else suffix
        _install(layer, functools.partial(group.forward, index, child))
        handled.add(child)


def unpatch(model: torch.nn.Module) -> torch.nn.Module:
    """Restore every forward :func:`apply` patched in ``model`` (exactly: a module that had
    no instance-level forward gets none) and forget the skip notes. Returns ``model``."""
    for module in model.modules():
        patch = module.__dict__.pop(_PATCH, None)
        if patch is not None:
            if patch.had_instance_forward:
                module.forward = patch.original
            else:
                module.__dict__.pop("forward", None)
        module.__dict__.pop(_SKIPPED, None)
    return model


def patched(model: torch.nn.Module) -> list[str]:
    """Names of the modules whose forward :func:`apply` replaced."""
    return [name for name, module in model.named_modules() if hasattr(module, _PATCH)]
