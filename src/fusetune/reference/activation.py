"""Pure-PyTorch gated activations: the semantics of :func:`fusetune.swiglu` and
:func:`fusetune.geglu`, their CPU path and the tests' oracle.

    swiglu(gate, up) = silu(gate) * up
    geglu(gate, up)  = gelu(gate) * up        (erf gelu, or its tanh approximation)

Computed in fp32 (float64 for float64 inputs), rounded once to the promoted dtype of gate and up.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fusetune._utils import check_choice, check_floating, check_same_device

APPROXIMATIONS = ("none", "tanh")


def check_glu_args(gate: torch.Tensor, up: torch.Tensor, approximate: str = "none") -> None:
    """The argument checks the ops and these references share."""
    check_floating("gate", gate)
    check_floating("up", up)
    if tuple(gate.shape) != tuple(up.shape):
        raise ValueError(
            f"gate and up must have one shape, got {tuple(gate.shape)} and {tuple(up.shape)}"
        )
    if gate.dim() == 0:
        raise ValueError("gate and up must have at least one dim, got 0-dim tensors")
    check_same_device(gate=gate, up=up)
    check_choice("approximate", approximate, APPROXIMATIONS)


def _gated(gate: torch.Tensor, up: torch.Tensor, activation) -> torch.Tensor:
    out_dtype = torch.promote_types(gate.dtype, up.dtype)
    compute = torch.float64 if out_dtype == torch.float64 else torch.float32
    return (activation(gate.to(compute)) * up.to(compute)).to(out_dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Reference of :func:`fusetune.swiglu`."""
    check_glu_args(gate, up)
    return _gated(gate, up, F.silu)


def geglu(gate: torch.Tensor, up: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """Reference of :func:`fusetune.geglu`."""
    check_glu_args(gate, up, approximate)
    return _gated(gate, up, lambda g: F.gelu(g, approximate=approximate))
