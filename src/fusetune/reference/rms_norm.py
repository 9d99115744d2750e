"""Pure-PyTorch RMSNorm: the semantics of :func:`fusetune.rms_norm`,
:func:`fusetune.add_rms_norm` and :func:`fusetune.rms_norm_gated`, their CPU path and the tests'
oracle.

    y = x / sqrt(mean(x^2) + eps) * (offset + weight)
    gated: y = x / sqrt(mean(x^2) + eps) * (offset + weight) * silu(gate)

``casting`` says where results are rounded to the input dtype (float64 inputs are never rounded):
* "llama": normalise in fp32, round to x's dtype, then multiply by (offset + weight) in fp32
  (LlamaRMSNorm's order, weight not downcast);
* "gemma": everything in fp32, one rounding at the end (Gemma's RMSNorm, offset 1 by default);
* "none": the normalised value and the scale are each rounded to x's dtype before the multiply,
  as when the whole computation runs in x's dtype (the mean of squares still accumulates in fp32).
The gated form multiplies the unrounded product by silu(gate) (gate in fp32) and rounds once.
"""

from __future__ import annotations

import torch

from fusetune._utils import check_choice, check_floating, check_number, check_same_device

CASTINGS = ("llama", "gemma", "none")


def resolve_offset(offset: float | None, casting: str) -> float:
    """The default offset: 1 for "gemma" (its (1 + w) weight), else 0."""
    if offset is not None:
        return float(offset)
    return 1.0 if casting == "gemma" else 0.0


def check_rms_norm_args(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    offset: float | None,
    casting: str,
    residual: torch.Tensor | None = None,
) -> None:
    """The argument checks the op and this reference share."""
    check_floating("x", x)
    check_floating("weight", weight)
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(f"x must have a non-empty last (hidden) dim, got shape {tuple(x.shape)}")
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(
            f"weight must have shape {tuple(x.shape[-1:])}, the last dim of x (x is "
            f"{tuple(x.shape)}), got {tuple(weight.shape)}"
        )
    if residual is not None:
        check_floating("residual", residual)
        if tuple(residual.shape) != tuple(x.shape):
            raise ValueError(
                f"residual must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}"
            )
    check_same_device(x=x, weight=weight, residual=residual)
    check_number("eps", eps, low=0.0)
    check_number("offset", offset, optional=True)
    check_choice("casting", casting, CASTINGS)


def _scaled(
    x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, casting: str
) -> torch.Tensor:
    """RMSNorm of ``x`` (no checks), before the final rounding: in fp32 (float64 for float64)."""
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf = x.to(compute)
    h = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    scale = offset + weight.to(compute)
    if casting == "llama":
        h = h.to(x.dtype).to(compute)
    elif casting == "none":
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps).to(x.dtype).to(compute)
        h = (xf * rstd).to(x.dtype).to(compute)
        scale = scale.to(x.dtype).to(compute)
    return h * scale


def normalize(
    x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, casting: str
) -> torch.Tensor:
    """RMSNorm of ``x`` (no checks), in x's dtype."""
    return _scaled(x, weight, eps, offset, casting).to(x.dtype)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    *,
    offset: float | None = None,
    casting: str = "llama",
) -> torch.Tensor:
    """Reference of :func:`fusetune.rms_norm` (same signature and semantics)."""
    check_rms_norm_args(x, weight, eps, offset, casting)
    return normalize(x, weight, eps, resolve_offset(offset, casting), casting)


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    *,
    offset: float | None = None,
    casting: str = "llama",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of :func:`fusetune.add_rms_norm`: (rms_norm(x + residual), x + residual), the
    sum rounded to the promoted dtype of x and residual before it is normalised."""
    check_rms_norm_args(x, weight, eps, offset, casting, residual)
    dtype = torch.promote_types(x.dtype, residual.dtype)
    new_residual = x.to(dtype) + residual.to(dtype)
    normed = normalize(new_residual, weight, eps, resolve_offset(offset, casting), casting)
    return normed, new_residual


def check_gate(x: torch.Tensor, gate: torch.Tensor) -> None:
    check_floating("gate", gate)
    if tuple(gate.shape) != tuple(x.shape):
        raise ValueError(f"gate must have x's shape {tuple(x.shape)}, got {tuple(gate.shape)}")
    check_same_device(x=x, gate=gate)


def rms_norm_gated(
    x: torch.Tensor,
    gate: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    *,
    offset: float | None = None,
    casting: str = "llama",
) -> torch.Tensor:
    """Reference of :func:`fusetune.rms_norm_gated`: ``rms_norm(x) * silu(gate)``, the norm as
    ``casting`` says but not rounded, times silu of gate in fp32, one rounding to x's dtype."""
    check_rms_norm_args(x, weight, eps, offset, casting)
    check_gate(x, gate)
    scaled = _scaled(x, weight, eps, resolve_offset(offset, casting), casting)
    g = gate.to(scaled.dtype)
    return (scaled * (g * torch.sigmoid(g))).to(x.dtype)
