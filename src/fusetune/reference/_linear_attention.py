"""Argument checks that the linear-attention ops share (gated slot attention and the gated delta
rule): one input dtype, the scale, boolean flags and packed-sequence offsets."""

from __future__ import annotations

import torch

from fusetune import _utils


def check_one_dtype(tensors: dict[str, torch.Tensor], others: str) -> None:
    """Raise TypeError unless ``tensors`` (name -> tensor) share one dtype; ``others`` names the
    inputs that may differ (they are read as fp32)."""
    names = list(tensors)
    if any(tensors[name].dtype != tensors[names[0]].dtype for name in names):
        joined = ", ".join(names[:-1]) + f" and {names[-1]}"
        got = ", ".join(f"{name} {tensor.dtype}" for name, tensor in tensors.items())
        raise TypeError(
            f"{joined} must share one dtype ({others} may differ; they are read as fp32), got {got}"
        )


def check_options(
    scale: float | None,
    flags: dict[str, object],
    cu_seqlens: torch.Tensor | None,
    batch: int,
    seq_len: int,
) -> int:
    """Check ``scale`` (a number or None), ``flags`` (name -> value, each a bool) and
    ``cu_seqlens`` against the batch and time sizes; return the number of sequences (B, or
    len(cu_seqlens) - 1). Raises TypeError / ValueError naming the argument."""
    _utils.check_number("scale", scale, optional=True)
    for name, flag in flags.items():
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    return batch if cu_seqlens is None else _utils.check_cu_seqlens(cu_seqlens, batch, seq_len)
