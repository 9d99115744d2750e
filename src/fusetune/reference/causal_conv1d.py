"""Pure-PyTorch causal depthwise convolution: the semantics of :func:`fusetune.causal_conv1d`,
its CPU path and the tests' oracle.

    out[b, c, t] = act(bias[c] + sum_j weight[c, j] * x[b, c, t - (W - 1) + j]),  x = 0 before t = 0

The short convolution in front of Gated DeltaNet (Qwen3.5, Qwen3-Next) and Mamba layers
(transformers' ``causal_conv1d_fn`` fallback, the ``causal-conv1d`` package's function). Computed
in fp32 (float64 for float64 inputs), the activation too, and rounded once to x's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fusetune._utils import check_choice, check_floating, check_same_device

ACTIVATIONS = (None, "silu", "swish")


def check_causal_conv1d_args(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None
) -> None:
    """The argument checks the op and this reference share."""
    check_floating("x", x)
    check_floating("weight", weight)
    if x.dim() != 3:
        raise ValueError(f"x must be [batch, channels, time], got shape {tuple(x.shape)}")
    if weight.dim() != 2 or weight.shape[0] != x.shape[1] or weight.shape[1] == 0:
        raise ValueError(
            f"weight must be [channels, width] with channels = x.shape[1] = {x.shape[1]}, got "
            f"{tuple(weight.shape)}"
        )
    if bias is not None:
        check_floating("bias", bias)
        if tuple(bias.shape) != (x.shape[1],):
            raise ValueError(f"bias must have shape ({x.shape[1]},), got {tuple(bias.shape)}")
    check_same_device(x=x, weight=weight, bias=bias)
    check_choice("activation", activation, ACTIVATIONS)


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
) -> torch.Tensor:
    """Reference of :func:`fusetune.causal_conv1d` (same signature and semantics)."""
    check_causal_conv1d_args(x, weight, bias, activation)
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    width = weight.shape[1]
    out = F.conv1d(
        x.to(compute),
        weight.to(compute).unsqueeze(1),
        None if bias is None else bias.to(compute),
        padding=width - 1,
        groups=x.shape[1],
    )[..., : x.shape[-1]]
    if activation is not None:
        out = F.silu(out)
    return out.to(x.dtype)
