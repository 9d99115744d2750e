"""Pure-PyTorch gated activation followed by a linear layer: the semantics of
:func:`fusetune.glu_linear`, its CPU path and the tests' oracle.

    glu_linear(gate, up, W, b) = linear(act(gate) * up, W, b)      (a gated MLP's down projection)

act(gate) * up is :func:`fusetune.reference.swiglu` / :func:`fusetune.reference.geglu` (fp32,
rounded once to the promoted dtype of gate and up). The linear layer then runs in one compute
dtype: under torch.autocast the autocast dtype, as F.linear casts there; outside it the dtype of
act(gate) * up and the weight when they agree, the 16-bit one when float32 meets a 16-bit dtype
(as if autocast to it were on); float16 with bfloat16, or float64 with another dtype, is a
TypeError. The result comes back in the compute dtype; every gradient in its input's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fusetune._utils import check_choice, check_floating, check_ndim, check_same_device
from fusetune.reference.activation import check_glu_args, geglu, swiglu

ACTIVATIONS = ("silu", "gelu", "gelu_tanh")


def compute_dtype(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype the linear layer of :func:`fusetune.glu_linear` runs in (see the module doc)."""
    device_type = gate.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    product = torch.promote_types(gate.dtype, up.dtype)
    if product == weight.dtype:
        return product
    narrow = {product, weight.dtype} - {torch.float32}
    if len(narrow) == 1 and torch.float64 not in narrow:
        return narrow.pop()
    raise TypeError(
        f"act(gate) * up ({product}, from gate {gate.dtype} and up {up.dtype}) and weight "
        f"({weight.dtype}) mix dtypes with no single matmul dtype (float16 with bfloat16, or "
        f"float64 with another): cast one of them or use torch.autocast"
    )


def check_glu_linear_args(
    gate: torch.Tensor,
    up: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str,
) -> torch.dtype:
    """The argument checks :func:`fusetune.glu_linear` and this reference share; returns the
    compute dtype."""
    check_glu_args(gate, up)
    check_floating("weight", weight)
    check_ndim("weight", weight, (2,), "2-D [out_features, in_features]")
    if weight.shape[1] != gate.shape[-1]:
        raise ValueError(
            f"weight's in-features (shape[1]) must equal gate's last dim (the intermediate "
            f"size); got weight {tuple(weight.shape)} and gate {tuple(gate.shape)}"
        )
    if bias is not None:
        check_floating("bias", bias)
        if tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(
                f"bias must be 1-D [out_features] = [{weight.shape[0]}] (weight's rows), got "
                f"{tuple(bias.shape)}"
            )
    check_same_device(gate=gate, weight=weight, bias=bias)
    check_choice("activation", activation, ACTIVATIONS)
    return compute_dtype(gate, up, weight)


def glu_product(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """act(gate) * up (reference), ``activation`` "silu", "gelu" or "gelu_tanh"."""
    if activation == "silu":
        return swiglu(gate, up)
    return geglu(gate, up, "none" if activation == "gelu" else "tanh")


def glu_linear(
    gate: torch.Tensor,
    up: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    activation: str = "silu",
) -> torch.Tensor:
    """Reference of :func:`fusetune.glu_linear`."""
    dtype = check_glu_linear_args(gate, up, weight, bias, activation)
    h = glu_product(gate, up, activation).to(dtype)
    return F.linear(h, weight.to(dtype), None if bias is None else bias.to(dtype))
