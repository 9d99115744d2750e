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
variant), no LoRA bias, a frozen nn.Linear base, and adapters in float32 or the base dtype. A
bitsandbytes 4-bit base (QLoRA: PEFT's ``lora.bnb.Linear4bit`` around ``bnb.nn.Linear4bit``)
qualifies too when its compute dtype is the dtype its weight was quantised from (or unset): the
ops then dequantise it in Triton where they read it (:mod:`fusetune.ops.quant4`).
A layer that does not is left on PEFT's path, with one warning naming it and the reason. The
qualification holds on every call: merging, ``disable_adapter()``, switching adapters, a new
adapter or new weights, a dtype or device change later route that call as a fresh check would.
It is cached per layer under a key of everything it reads (adapter state, the tensors by
identity with their dtype, shape, device and requires_grad, the scaling): a step's forwards
re-read the key (a few attribute reads), not the whole check.

A patched module's class becomes a subclass with fusetune's forward, one per class, as FSDP2's
``fully_shard`` swaps classes (:mod:`fusetune.integrations._class_forward`); its name,
``isinstance``, state dict, copies and pickles are as before. Every layer then runs the same
forward object, so ``torch.compile`` of each decoder layer on its own shares one graph among
them, as with PEFT's own forwards.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from fusetune.integrations import _class_forward
from fusetune.ops.lora import (
    lora_linear_validated,
    lora_mlp_validated,
    lora_qkv_validated,
)
from fusetune.ops.quant4 import is_4bit, logical_dtype
from fusetune.reference.lora import Projection, check_mlp_projections, check_qkv_projections
from fusetune.reference.lora import check_projection as _check_projection

_PATCH = "_fusetune_peft_patch"
_SKIPPED = "_fusetune_peft_skipped"
_ROUTE = "_fusetune_peft_route"
_NO_VARIANTS: dict = {}  # PEFT versions without lora_variant
# Reasons that are modes PEFT handles on its own path, not a limitation: no warning.
_QUIET_REASONS = ("adapters disabled", "adapter merged into the base weight")
_PARTITIONED = (
    "its layers' weights are partitioned by DeepSpeed ZeRO-3 and the call is not inside a "
    "DeepSpeed engine's forward (where ZeRO gathers a neighbour's weights for the group): the "
    "layers run fusetune's lora_linear one by one"
)


@dataclass
class _Patch:
    """A patched module's own arguments, read by the forward its fused class has (so that every
    layer runs one function: Dynamo then guards the class, not a per-module object, and
    compiling layer by layer compiles one graph for all of them), and what ``unpatch``
    restores: the class and the instance-level forward before patching (None when it used its
    class's)."""

    cls: type
    original: Callable | None
    had_instance_forward: bool
    name: str  # the module's name in the model, for warnings
    activation: str | None = None  # an MLP's lora_mlp activation
    group: _QKVGroup | None = None  # a q/k/v projection's group, and its index in it
    index: int = 0
    warned: set[str] = field(default_factory=set)
    # an MLP's gate, up and down projections last checked together (by identity)
    checked: tuple[Projection, ...] | None = None


@dataclass
class _Route:
    """A LoRA layer's qualification (``lora_reason``, and its checked projection when it
    qualifies), valid while :func:`_state_key` gives ``key``. ``tensors`` keeps the tensors
    the key names by id alive, so that no id is reused while the route is cached."""

    key: tuple
    reason: str | None
    projection: Projection | None
    tensors: tuple

    def __reduce__(self):
        """Copies and pickles of a model carry no route: the key's ids are this process's
        and these tensors'."""
        return type(None), ()


# ----------------------------------------------------------------------------- qualification


def _lora_linear_class() -> tuple[type, ...]:
    """PEFT's LoRA linear layer classes: ``lora.Linear``, and ``lora.bnb.Linear4bit`` when
    bitsandbytes is installed."""
    from peft.tuners.lora.layer import Linear

    try:
        from peft.tuners.lora.bnb import Linear4bit
    except ImportError:  # bitsandbytes missing
        return (Linear,)
    return (Linear, Linear4bit)


def is_lora_layer(module: torch.nn.Module) -> bool:
    """A PEFT LoRA linear layer (any state), dense or 4-bit."""
    try:
        return isinstance(module, _lora_linear_class())
    except ImportError:  # pragma: no cover - peft missing
        return False


def _base_reason(base: torch.nn.Module) -> str | None:
    """Why a LoRA layer's base layer cannot be read by fusetune's ops; None if it can."""
    if not isinstance(base, torch.nn.Linear):
        return f"its base layer is {type(base).__name__}, not a floating-point nn.Linear"
    if is_4bit(base.weight):
        compute = getattr(base, "compute_dtype", None)
        if compute is not None and compute != logical_dtype(base.weight):
            return (
                f"its 4-bit base computes in {compute} but was quantised from "
                f"{logical_dtype(base.weight)} (fusetune computes as the dense weight would)"
            )
        return None
    if not base.weight.dtype.is_floating_point:
        return f"its base layer is {type(base).__name__}, not a floating-point nn.Linear"
    return None


def lora_reason(layer: torch.nn.Module) -> str | None:
    """Why ``layer`` (a PEFT LoRA linear layer) cannot take fusetune's path now; None if it can."""
    base = layer.get_base_layer()
    reason = _base_reason(base)
    if reason is not None:
        return reason
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
    base_dtype = logical_dtype(base.weight)
    if lora_a.dtype != lora_b.dtype or lora_a.dtype not in (torch.float32, base_dtype):
        return (
            f"adapters in {lora_a.dtype} / {lora_b.dtype} beside a {base_dtype} base "
            "(fusetune takes float32 or the base dtype)"
        )
    return None


def _projection(layer: torch.nn.Module) -> Projection:
    """(weight, lora_a, lora_b, scaling, bias) of a qualifying layer's active adapter."""
    name = next(n for n in layer.active_adapters if n in layer.lora_A)
    base = layer.get_base_layer()
    return Projection(
        base.weight,
        layer.lora_A[name].weight,
        layer.lora_B[name].weight,
        layer.scaling[name],
        base.bias,
    )


def _qualify(layer: torch.nn.Module) -> tuple[str | None, Projection | None]:
    """(lora_reason, None) or (None, the projection, checked as lora_linear checks it)."""
    reason = lora_reason(layer)
    if reason is not None:
        return reason, None
    projection = _projection(layer)
    _check_projection("", projection)
    return None, projection


def _route(layer: torch.nn.Module) -> tuple[str | None, Projection | None]:
    """:func:`_qualify`, cached on the layer while its :func:`_state_key` stays the same."""
    if torch.compiler.is_compiling():
        return _qualify(layer)  # traced once per graph; Dynamo guards on what it reads
    try:
        key, tensors = _state_key(layer)
    except (AttributeError, KeyError):  # a PEFT layout this key does not know: no cache
        return _qualify(layer)
    route = layer.__dict__.get(_ROUTE)
    if route is not None and route.key == key:
        return route.reason, route.projection
    reason, projection = _qualify(layer)
    layer.__dict__[_ROUTE] = _Route(key, reason, projection, tensors)
    return reason, projection


def _state_key(layer: torch.nn.Module) -> tuple[tuple, tuple]:
    """(key, tensors): everything :func:`lora_reason` and the projection checks read from
    ``layer``, read without nn.Module's attribute fallback (tensors by id, dtype, shape and
    device; the base's requires_grad too; the scaling), and the tensors named by id. One flat
    tuple: it is built for every LoRA layer on every forward."""
    modules = layer._modules
    base = modules["base_layer"]
    while "base_layer" in base._modules:  # get_base_layer: a tuner layer around a tuner layer
        base = base._modules["base_layer"]
    weight, bias = base._parameters.get("weight"), base._parameters.get("bias")
    lora_as = modules["lora_A"]._modules
    active = layer.active_adapter
    if isinstance(active, str):
        names = (active,) if active in lora_as else ()
    else:
        names = tuple([name for name in active if name in lora_as])
    state = (type(base), layer.disable_adapters, bool(layer.merged_adapters), names)
    state += _tensor_key(weight) + _tensor_key(bias)
    if len(names) != 1:
        return state, (weight, bias)
    name = names[0]
    a_module, b_module = lora_as[name], modules["lora_B"]._modules[name]
    lora_a, lora_b = a_module._parameters["weight"], b_module._parameters["weight"]
    dropout = modules["lora_dropout"]._modules[name]
    attributes = layer.__dict__
    state += (
        id(lora_a),
        lora_a.dtype,
        lora_a.shape,
        lora_a.device,
        id(lora_b),
        lora_b.dtype,
        lora_b.shape,
        lora_b.device,
        a_module._parameters.get("bias") is None,
        b_module._parameters.get("bias") is None,
        type(dropout),
        dropout.__dict__.get("p"),
        attributes["use_dora"].get(name, False),
        attributes.get("lora_variant", _NO_VARIANTS).get(name) is None,
        attributes["scaling"][name],
    )
    return state, (weight, bias, lora_a, lora_b)


def _base_layer(module: torch.nn.Module) -> torch.nn.Module:
    """PEFT's ``get_base_layer`` (``base_layer`` followed down: a tuner layer around a tuner
    layer) read from ``_modules``: PEFT's loop asks hasattr, through nn.Module's attribute
    fallback, which raises for the last level (about 3 us a layer, on every forward)."""
    while "base_layer" in module._modules:
        module = module._modules["base_layer"]
    return module


def _tensor_key(tensor: torch.Tensor | None) -> tuple:
    if tensor is None:
        return (None,)
    return (id(tensor), tensor.dtype, tensor.shape, tensor.device, tensor.requires_grad)


def _same(checked: tuple | None, projections: tuple) -> bool:
    """``projections`` are the very objects last checked together."""
    return checked is not None and all(a is b for a, b in zip(checked, projections, strict=True))


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


def _fused_linear_forward(self, x, *args, **kwargs):
    """The forward of a patched LoRA linear layer's class: lora_linear, or PEFT's forward
    where the layer does not qualify now."""
    patch = getattr(self, _PATCH, None)
    if patch is None:  # unpatched, its class kept: see _class_forward.restore
        return _class_forward.base_forward(self)(x, *args, **kwargs)
    return _linear_forward(self, patch, x, *args, **kwargs)


def _fused_mlp_forward(self, x, *args, **kwargs):
    """The forward of a patched MLP's class: lora_mlp (gate, up and down in one op)."""
    patch = getattr(self, _PATCH, None)
    if patch is None:
        return _class_forward.base_forward(self)(x, *args, **kwargs)
    return _mlp_forward(self, patch, x, *args, **kwargs)


def _fused_qkv_forward(self, x, *args, **kwargs):
    """The forward of a patched q, k or v projection's class: its group's (lora_qkv)."""
    patch = getattr(self, _PATCH, None)
    if patch is None:
        return _class_forward.base_forward(self)(x, *args, **kwargs)
    return patch.group.forward(patch.index, x, *args, **kwargs)


def _original_forward(module: torch.nn.Module, patch: _Patch) -> Callable:
    if patch.had_instance_forward:
        return patch.original
    return patch.cls.forward.__get__(module)


def _linear_forward(layer, patch: _Patch, x, *args, **kwargs):
    if args or kwargs:
        reason, projection = "extra forward arguments (e.g. adapter_names)", None
    else:
        reason, projection = _route(layer)
    if reason is not None:
        return _call_original(layer, patch, reason, x, *args, **kwargs)
    return lora_linear_validated(x, projection)


def _call_original(module, patch: _Patch, reason: str, *args, **kwargs):
    if reason not in _QUIET_REASONS and reason not in patch.warned:
        patch.warned.add(reason)
        _warn(patch.name, reason)
    return _original_forward(module, patch)(*args, **kwargs)


def _group_route(layers, extra_arguments) -> tuple[str | None, tuple[Projection, ...]]:
    """(why the group stays on PEFT's path or None, the layers' projections)."""
    if extra_arguments:
        return "extra forward arguments", ()
    if _zero3_partitioned(layers) and not _zero3_gather(layers):
        return _PARTITIONED, ()
    projections = []
    for layer in layers:
        reason, projection = _route(layer)
        if reason is not None:
            return reason, ()
        projections.append(projection)
    return None, tuple(projections)


def _zero3_partitioned(layers) -> bool:
    """Whether DeepSpeed ZeRO-3 partitions the layers' weights: it gathers a layer's weights
    only inside that layer's own call, so one call cannot read its neighbours'."""
    for layer in layers:
        if hasattr(_base_layer(layer)._parameters.get("weight"), "ds_id"):
            return True
    return False


def _zero3_gather(layers) -> bool:
    """Gathers the ZeRO-3-partitioned parameters of ``layers`` for the group's one call; False
    where some stay partitioned. Inside a DeepSpeed engine's forward, reading a parameter
    through its module's ``_parameters[name]`` (DeepSpeed's ZeROOrderedDict) gathers it and
    registers it as an external parameter of the module whose forward runs (the MLP, or
    q_proj for the q/k/v group): from then on ZeRO gathers it for that module's forward and
    backward, frees it after each, and reduces its gradient as for any parameter."""
    available = True
    for layer in layers:
        for module in layer.modules():
            parameters = module._parameters
            for name in list(parameters):
                param = parameters[name]  # the subscript is DeepSpeed's gathering read
                status = getattr(param, "ds_status", None)
                available = available and (status is None or status.name == "AVAILABLE")
    return available


def _mlp_forward(mlp, patch: _Patch, x, *args, **kwargs):
    modules = mlp._modules
    layers = (modules["gate_proj"], modules["up_proj"], modules["down_proj"])
    reason, projections = _group_route(layers, args or kwargs)
    if reason is not None:
        return _call_original(mlp, patch, reason, x, *args, **kwargs)
    if torch.compiler.is_compiling():
        check_mlp_projections(list(projections), patch.activation)
    elif not _same(patch.checked, projections):
        check_mlp_projections(list(projections), patch.activation)
        patch.checked = projections
    return lora_mlp_validated(x, list(projections), patch.activation)


class _QKVGroup:
    """q_proj computes q, k and v in one lora_qkv call and keeps k and v for the k_proj and
    v_proj calls that follow with the same input (each result handed out once)."""

    def __init__(self, layers):
        self.layers = layers
        self.pending: list | None = None
        self.checked: tuple[Projection, ...] | None = None  # last checked together
        self.warned = False

    def forward(self, index: int, x, *args, **kwargs):
        layer = self.layers[index]
        patch = getattr(layer, _PATCH)
        if index > 0:
            pending, self.pending = self.pending, None
            if pending is not None and _same_input(pending[0], x) and not args and not kwargs:
                result = pending[index]
                if index == 1:
                    self.pending = [x, None, pending[2]]
                return result
            return _linear_forward(layer, patch, x, *args, **kwargs)
        self.pending = None
        reason, projections = _group_route(self.layers, args or kwargs)
        if reason is not None:
            if reason == _PARTITIONED and not self.warned:
                self.warned = True
                _warn(patch.name.rsplit(".", 1)[0] + ".q_proj/k_proj/v_proj", reason)
            return _linear_forward(layer, patch, x, *args, **kwargs)
        if torch.compiler.is_compiling():
            check_qkv_projections(list(projections))
        elif not _same(self.checked, projections):
            check_qkv_projections(list(projections))
            self.checked = projections
        q, k, v = lora_qkv_validated(x, list(projections))
        self.pending = [x, k, v]
        return q


def _same_input(seen: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether ``x`` is the input q_proj saw: the same tensor, or the same one as DeepSpeed
    ZeRO-3 hands it on. ZeRO-3 passes each module's inputs through an identity autograd
    Function (its post-backward hook), so q_proj and k_proj get two tensors of one storage
    whose graphs meet right above those hook nodes."""
    if seen is x:
        return True
    if torch.compiler.is_compiling():  # ZeRO's hooks run in eager forwards; Dynamo has no data_ptr
        return False
    same_view = (
        seen.data_ptr() == x.data_ptr()
        and seen.shape == x.shape
        and seen.stride() == x.stride()
        and seen.dtype == x.dtype
    )
    return same_view and _below_zero3_hooks(seen.grad_fn) is _below_zero3_hooks(x.grad_fn)


def _below_zero3_hooks(node):
    while node is not None and type(node).__name__ == "PostBackwardFunctionModuleBackward":
        node = node.next_functions[0][0]
    return node


# ----------------------------------------------------------------------------- apply / unpatch


def _warn(name: str, reason: str) -> None:
    warnings.warn(
        f"fusetune.integrations.peft: {name} stays on PEFT's path: {reason}",
        UserWarning,
        stacklevel=3,
    )


def _install(module: torch.nn.Module, forward: Callable, name: str, **arguments) -> None:
    """``forward`` (one of the ``_fused_*_forward`` functions) becomes ``module``'s through its
    class (:mod:`fusetune.integrations._class_forward`), its arguments on the module."""
    cls, original, had_instance = _class_forward.install(module, forward)
    setattr(module, _PATCH, _Patch(cls, original, had_instance, name, **arguments))


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
            _patch_mlp(name, module)
        elif _is_qkv(module):
            _patch_qkv(name, module, handled)
    for name, module in named.items():
        if name in handled or hasattr(module, _PATCH) or not is_lora_layer(module):
            continue
        reason = lora_reason(module)
        if reason is not None:
            _skip(module, name, reason)
        else:
            _install(module, _fused_linear_forward, name)
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


def _patch_mlp(name: str, mlp: torch.nn.Module) -> None:
    activation = mlp_activation(mlp.act_fn)
    if activation is None:
        _skip(mlp, name, f"act_fn {type(mlp.act_fn).__name__} is not silu, gelu or tanh-gelu")
        return  # its LoRA layers go through lora_linear one by one
    layers = (mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    reasons = [lora_reason(layer) for layer in layers]
    if any(reasons):
        return  # each layer is judged (and warned about) on its own below
    if len({logical_dtype(layer.get_base_layer().weight) for layer in layers}) > 1:
        _skip(mlp, name, "gate, up and down base weights of different dtypes")
        return
    # the children are patched one by one as well: where the group cannot run (ZeRO-3,
    # extra arguments) the MLP's own forward calls them
    _install(mlp, _fused_mlp_forward, name, activation=activation)


def _patch_qkv(name: str, attention: torch.nn.Module, handled: set[str]) -> None:
    layers = (attention.q_proj, attention.k_proj, attention.v_proj)
    if any(lora_reason(layer) for layer in layers):
        return
    if len({logical_dtype(layer.get_base_layer().weight) for layer in layers}) > 1:
        return  # one by one through lora_linear
    group = _QKVGroup(layers)
    for index, (suffix, layer) in enumerate(
        zip(("q_proj", "k_proj", "v_proj"), layers, strict=True)
    ):
        child = f"{name}.{suffix}" if name else suffix
        _install(layer, _fused_qkv_forward, child, group=group, index=index)
        handled.add(child)


def unpatch(model: torch.nn.Module) -> torch.nn.Module:
    """Restore every forward :func:`apply` patched in ``model`` (exactly: a module that had
    no instance-level forward gets none) and forget the skip notes. Returns ``model``."""
    for module in model.modules():
        patch = module.__dict__.pop(_PATCH, None)
        if patch is not None:
            _class_forward.restore(module, patch.cls, patch.original, patch.had_instance_forward)
        module.__dict__.pop(_SKIPPED, None)
        module.__dict__.pop(_ROUTE, None)
    return model


def patched(model: torch.nn.Module) -> list[str]:
    """Names of the modules whose forward :func:`apply` replaced."""
    return [name for name, module in model.named_modules() if hasattr(module, _PATCH)]
