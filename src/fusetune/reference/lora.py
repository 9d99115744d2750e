"""Pure-PyTorch LoRA projections: the semantics of :func:`fusetune.lora_linear`,
:func:`fusetune.lora_qkv` and :func:`fusetune.lora_mlp`, their CPU path and the tests' oracle.

    lora_linear(x) = x W^T + scaling * (x A^T) B^T (+ bias)
    lora_qkv(x)    = three lora_linear of one x
    lora_mlp(x)    = down(act(gate(x)) * up(x)), each projection a lora_linear

W [out, in] is the frozen base weight, A [r, in] and B [out, r] the adapter. W may be a
bitsandbytes 4-bit weight (``Params4bit``, QLoRA): it then stands for its dequantised dense twin
(:mod:`fusetune.reference.quant4`) in every formula and check.

Precision (the ops follow the same rule): every matmul runs in one compute dtype, accumulating
in fp32. Under torch.autocast that is the autocast dtype, as F.linear would use. Outside it: the
dtype of x and the base weight when they agree; when float32 meets a 16-bit dtype, the 16-bit one
(as if autocast to it were on); float16 with bfloat16 is an error. The result comes back in the
compute dtype. Adapters are float32 or the base weight's dtype (A and B alike), as PEFT keeps
them; their gradients come back in their own dtype, x's gradient in x's. The base weight (and
bias) are frozen: they must not require grad.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from fusetune import _utils
from fusetune._utils import (
    check_choice,
    check_floating,
    check_ndim,
    check_number,
    check_same_device,
    check_tensor,
)
from fusetune.reference import quant4

ACTIVATIONS = ("swiglu", "geglu", "geglu_tanh")
ADAPTER_DTYPE_RULE = "float32 or the base weight's dtype"


class Projection(NamedTuple):
    """One LoRA projection: frozen base ``weight`` [out, in] (and ``bias`` [out]), adapter
    ``lora_a`` [r, in] and ``lora_b`` [out, r], and its ``scaling`` (PEFT: alpha / r)."""

    weight: torch.Tensor
    lora_a: torch.Tensor
    lora_b: torch.Tensor
    scaling: float
    bias: torch.Tensor | None = None


# ----------------------------------------------------------------------------- checks


def as_projection(name: str, spec: object) -> Projection:
    """``spec`` as a Projection: a (weight, lora_a, lora_b, scaling[, bias]) tuple."""
    if isinstance(spec, Projection):
        return spec
    if not isinstance(spec, (tuple, list)) or len(spec) not in (4, 5):
        length = len(spec) if isinstance(spec, (tuple, list)) else None
        raise TypeError(
            f"{name} must be a (weight, lora_a, lora_b, scaling) or (weight, lora_a, lora_b, "
            f"scaling, bias) tuple, got {type(spec).__name__} (length {length})"
        )
    return Projection(*spec)


def check_projection(prefix: str, p: Projection, in_features: int | None = None) -> None:
    """Shapes, dtypes, devices and frozenness of one projection; errors name ``prefix +
    argument``. Runs on every op call: one cheap test of the valid case, and only when it fails
    the detailed checks that find the fault and word the error."""
    p = checked_view(p, prefix)
    if not _projection_is_valid(p, in_features):
        _explain_projection(prefix, p, in_features)


def checked_view(p: Projection, prefix: str = "") -> Projection:
    """``p`` as the checks read it: a 4-bit base weight replaced by a stand-in of its dense
    shape, dtype and device (its quantisation state checked here)."""
    if not quant4.is_4bit(p.weight):
        return p
    quant4.check_4bit(f"{prefix}weight", p.weight)
    return p._replace(weight=quant4.stand_in(p.weight))


_PLAIN_NUMBERS = (float, int)


def _projection_is_valid(p: Projection, in_features: int | None) -> bool:
    """True when :func:`_explain_projection` would pass; False may also mean it passes (an
    unusual but valid argument, such as a symbolic scaling under torch.compile)."""
    weight, lora_a, lora_b, bias = p.weight, p.lora_a, p.lora_b, p.bias
    if not (
        isinstance(weight, torch.Tensor)
        and isinstance(lora_a, torch.Tensor)
        and isinstance(lora_b, torch.Tensor)
        and weight.dim() == 2
        and lora_a.dim() == 2
        and lora_b.dim() == 2
        and type(p.scaling) in _PLAIN_NUMBERS
        and -math.inf < p.scaling < math.inf
    ):
        return False
    out_features, base_in = weight.shape
    rank, a_in = lora_a.shape
    dtype, adapter_dtype, device = weight.dtype, lora_a.dtype, weight.device
    grad_enabled = torch.is_grad_enabled()
    return (
        (in_features is None or base_in == in_features)
        and a_in == base_in
        and rank != 0
        and lora_b.shape == (out_features, rank)
        and dtype.is_floating_point
        and adapter_dtype == lora_b.dtype
        and (adapter_dtype == torch.float32 or adapter_dtype == dtype)
        and lora_a.device == device
        and lora_b.device == device
        and not (grad_enabled and weight.requires_grad)
        and (
            bias is None
            or (
                isinstance(bias, torch.Tensor)
                and bias.dtype.is_floating_point
                and bias.shape == (out_features,)
                and bias.device == device
                and not (grad_enabled and bias.requires_grad)
            )
        )
    )


def _explain_projection(prefix: str, p: Projection, in_features: int | None) -> None:
    """Raise the error that names what is wrong with ``p`` (returns when nothing is)."""
    names = {k: f"{prefix}{k}" for k in ("weight", "lora_a", "lora_b", "scaling", "bias")}
    for key in ("weight", "lora_a", "lora_b"):
        check_floating(names[key], getattr(p, key))
        check_ndim(names[key], getattr(p, key), (2,), _LAYOUTS[key])
    out_features, base_in = p.weight.shape
    rank = p.lora_a.shape[0]
    if in_features is not None and base_in != in_features:
        raise ValueError(
            f"{names['weight']} must be [out, in] with in = x's last dim {in_features}, got "
            f"{tuple(p.weight.shape)}"
        )
    if p.lora_a.shape[1] != base_in or rank == 0:
        raise ValueError(
            f"{names['lora_a']} must be [r, in] with r >= 1 and in = {base_in} (the base "
            f"weight is {tuple(p.weight.shape)}), got {tuple(p.lora_a.shape)}"
        )
    if p.lora_b.shape[0] != out_features:
        raise ValueError(
            f"{names['lora_b']} must be [out, r] with out = {out_features} (the base weight is "
            f"{tuple(p.weight.shape)}), got {tuple(p.lora_b.shape)}"
        )
    if p.lora_b.shape[1] != rank:
        raise ValueError(
            f"{names['lora_b']}'s rank (dim 1) must equal {names['lora_a']}'s rank (dim 0) "
            f"{rank}: got lora_a {tuple(p.lora_a.shape)} and lora_b {tuple(p.lora_b.shape)}"
        )
    check_adapter_dtypes(prefix, p.weight, p.lora_a, p.lora_b)
    check_number(names["scaling"], p.scaling)
    if p.bias is not None:
        check_floating(names["bias"], p.bias)
        if tuple(p.bias.shape) != (out_features,):
            raise ValueError(
                f"{names['bias']} must have shape ({out_features},), got {tuple(p.bias.shape)}"
            )
    check_same_device(
        **{names["weight"]: p.weight, names["lora_a"]: p.lora_a, names["lora_b"]: p.lora_b},
        **({names["bias"]: p.bias} if p.bias is not None else {}),
    )
    _check_frozen(names["weight"], p.weight)
    if p.bias is not None:
        _check_frozen(names["bias"], p.bias)


_LAYOUTS = {
    "weight": "[out, in] (the frozen base weight)",
    "lora_a": "[r, in] (LoRA A, PEFT's lora_A.weight)",
    "lora_b": "[out, r] (LoRA B, PEFT's lora_B.weight)",
}


def check_adapter_dtypes(
    prefix: str, weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor
) -> None:
    if lora_a.dtype != lora_b.dtype:
        raise TypeError(
            f"{prefix}lora_a and {prefix}lora_b must share one dtype, got {lora_a.dtype} and "
            f"{lora_b.dtype}"
        )
    if lora_a.dtype not in (torch.float32, weight.dtype):
        raise TypeError(
            f"{prefix}lora_a and {prefix}lora_b must be {ADAPTER_DTYPE_RULE} ({weight.dtype}), "
            f"got {lora_a.dtype}"
        )


def _check_frozen(name: str, tensor: torch.Tensor) -> None:
    if tensor.requires_grad and torch.is_grad_enabled():
        raise ValueError(
            f"{name} requires grad, but LoRA keeps the base layer frozen and never computes its "
            f"gradient; pass {name}.detach() (or freeze it: requires_grad_(False))"
        )


def check_input(x: torch.Tensor, in_features: int) -> None:
    if (
        isinstance(x, torch.Tensor)
        and x.dtype.is_floating_point
        and x.dim() != 0
        and x.shape[-1] == in_features
    ):
        return
    check_floating("x", check_tensor("x", x))
    if x.dim() == 0 or x.shape[-1] != in_features:
        raise ValueError(
            f"x must be [..., in] with in = {in_features} (the base weight's in-features), got "
            f"shape {tuple(x.shape)}"
        )


def compute_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype every matmul of a LoRA projection of ``x`` runs in (see the module doc): the
    rule of :func:`fusetune._utils.matmul_dtype`."""
    return _utils.matmul_dtype(x, weight, ("x", "the base weight"))


def check_x(x: torch.Tensor, weight: torch.Tensor, weight_name: str = "weight") -> torch.dtype:
    """The per-call checks of ``x`` against (already checked) projections whose first base
    weight is ``weight``: x's type and last dim, its device; returns the compute dtype."""
    weight = quant4.stand_in(weight)
    check_input(x, weight.shape[1])
    _check_device(x, weight, weight_name)
    return compute_dtype(x, weight)


def _check_device(x: torch.Tensor, weight: torch.Tensor, weight_name: str) -> None:
    if x.device != weight.device:
        check_same_device(**{"x": x, weight_name: weight})


def check_lora_linear_args(x: torch.Tensor, p: Projection) -> torch.dtype:
    """Checks shared by :func:`fusetune.lora_linear` and its reference; the compute dtype."""
    check_tensor("weight", p.weight)
    p = checked_view(p)
    check_projection("", p)
    return check_x(x, p.weight)


def check_lora_qkv_args(
    x: torch.Tensor, q: object, k: object, v: object
) -> tuple[list[Projection], torch.dtype]:
    """Checks shared by :func:`fusetune.lora_qkv` and its reference."""
    projections = [as_projection(name, spec) for name, spec in zip("qkv", (q, k, v), strict=True)]
    check_tensor("q.weight", projections[0].weight)
    views = [checked_view(p, f"{name}.") for name, p in zip("qkv", projections, strict=True)]
    check_input(x, views[0].weight.shape[-1])
    _check_qkv_shapes(views)
    for name, p in zip("qkv", views, strict=True):
        _check_device(x, p.weight, f"{name}.weight")
    return projections, _one_compute_dtype(x, views, "qkv")


def check_qkv_projections(projections: list[Projection]) -> None:
    """The checks of :func:`check_lora_qkv_args` that do not involve x, for a caller that
    checks x per call with :func:`check_x` (x against ``q.weight``)."""
    check_tensor("q.weight", projections[0].weight)
    views = [checked_view(p, f"{name}.") for name, p in zip("qkv", projections, strict=True)]
    _check_qkv_shapes(views)
    _check_one_base_dtype(views, "qkv")
    _check_one_device(views, "qkv")


def _check_qkv_shapes(projections: list[Projection]) -> None:
    in_features = projections[0].weight.shape[-1]
    for name, p in zip("qkv", projections, strict=True):
        check_projection(f"{name}.", p, in_features)


def check_lora_mlp_args(
    x: torch.Tensor, gate: object, up: object, down: object, activation: str
) -> tuple[list[Projection], torch.dtype]:
    """Checks shared by :func:`fusetune.lora_mlp` and its reference."""
    check_choice("activation", activation, ACTIVATIONS)
    names = ("gate", "up", "down")
    projections = [as_projection(n, s) for n, s in zip(names, (gate, up, down), strict=True)]
    check_tensor("gate.weight", projections[0].weight)
    views = [checked_view(p, f"{name}.") for name, p in zip(names, projections, strict=True)]
    check_input(x, views[0].weight.shape[-1])
    _check_mlp_shapes(views)
    for name, p in zip(names, views, strict=True):
        _check_device(x, p.weight, f"{name}.weight")
    return projections, _one_compute_dtype(x, views, "gate, up and down")


def check_mlp_projections(projections: list[Projection], activation: str) -> None:
    """The checks of :func:`check_lora_mlp_args` that do not involve x, for a caller that
    checks x per call with :func:`check_x` (x against ``gate.weight``)."""
    check_choice("activation", activation, ACTIVATIONS)
    check_tensor("gate.weight", projections[0].weight)
    names = ("gate.", "up.", "down.")
    views = [checked_view(p, name) for name, p in zip(names, projections, strict=True)]
    _check_mlp_shapes(views)
    _check_one_base_dtype(views, "gate, up and down")
    _check_one_device(views, "gate, up and down")


def _check_mlp_shapes(projections: list[Projection]) -> None:
    hidden = projections[0].weight.shape[-1]
    check_projection("gate.", projections[0], hidden)
    check_projection("up.", projections[1], hidden)
    intermediate = projections[0].weight.shape[0]
    if projections[1].weight.shape[0] != intermediate:
        raise ValueError(
            f"up.weight must be [intermediate, in] like gate.weight "
            f"{tuple(projections[0].weight.shape)}, got {tuple(projections[1].weight.shape)}"
        )
    check_tensor("down.weight", projections[2].weight)
    check_projection("down.", projections[2], intermediate)


def _one_compute_dtype(x: torch.Tensor, projections: list[Projection], what: str) -> torch.dtype:
    _check_one_base_dtype(projections, what)
    return compute_dtype(x, projections[0].weight)


def _check_one_base_dtype(projections: list[Projection], what: str) -> None:
    first, second, third = (p.weight.dtype for p in projections)
    if not first == second == third:
        raise TypeError(
            f"the base weights of {what} must share one dtype, got {first}, {second}, {third}"
        )


def _check_one_device(projections: list[Projection], what: str) -> None:
    first, second, third = (p.weight.device for p in projections)
    if not first == second == third:
        raise ValueError(
            f"the base weights of {what} must be on one device, got {first}, {second}, {third}"
        )


# ----------------------------------------------------------------------------- references


def _project(x: torch.Tensor, p: Projection, dtype: torch.dtype) -> torch.Tensor:
    bias = None if p.bias is None else p.bias.to(dtype)
    base = F.linear(x, quant4.dense(p.weight, dtype), bias)
    return base + p.scaling * F.linear(F.linear(x, p.lora_a.to(dtype)), p.lora_b.to(dtype))


def _activate(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    compute = torch.float64 if gate.dtype == torch.float64 else torch.float32
    gate, up_c = gate.to(compute), up.to(compute)
    if activation == "swiglu":
        value = F.silu(gate)
    else:
        value = F.gelu(gate, approximate="tanh" if activation == "geglu_tanh" else "none")
    return (value * up_c).to(up.dtype)


def lora_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scaling: float,
    *,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference of :func:`fusetune.lora_linear` (same signature and semantics)."""
    p = Projection(weight, lora_a, lora_b, scaling, bias)
    return linear_checked(x, p, check_lora_linear_args(x, p))


def lora_qkv(
    x: torch.Tensor, q: object, k: object, v: object
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference of :func:`fusetune.lora_qkv` (same signature and semantics)."""
    projections, dtype = check_lora_qkv_args(x, q, k, v)
    return qkv_checked(x, projections, dtype)


def lora_mlp(
    x: torch.Tensor, gate: object, up: object, down: object, activation: str = "swiglu"
) -> torch.Tensor:
    """Reference of :func:`fusetune.lora_mlp` (same signature and semantics)."""
    projections, dtype = check_lora_mlp_args(x, gate, up, down, activation)
    return mlp_checked(x, projections, activation, dtype)


# The references after their checks (callers that ran them: the ops' CPU path), with the
# compute dtype the checks returned.


def linear_checked(x: torch.Tensor, p: Projection, dtype: torch.dtype) -> torch.Tensor:
    with torch.autocast(x.device.type, enabled=False):
        return _project(x.to(dtype), p, dtype)


def qkv_checked(
    x: torch.Tensor, projections: list[Projection], dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    with torch.autocast(x.device.type, enabled=False):
        xc = x.to(dtype)
        return tuple(_project(xc, p, dtype) for p in projections)


def mlp_checked(
    x: torch.Tensor, projections: list[Projection], activation: str, dtype: torch.dtype
) -> torch.Tensor:
    gate_p, up_p, down_p = projections
    with torch.autocast(x.device.type, enabled=False):
        xc = x.to(dtype)
        hidden = _activate(_project(xc, gate_p, dtype), _project(xc, up_p, dtype), activation)
        return _project(hidden, down_p, dtype)
