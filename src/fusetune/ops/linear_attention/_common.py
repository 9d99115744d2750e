"""What the linear-attention kernels share: sequence bounds of (packed) sequences (Gated
DeltaNet's kernels and GSA's, still in ``fusetune/gsa``) and the host view of [B, T, H, ...]
strides."""

from __future__ import annotations

import torch

from fusetune._triton import tl, triton


@triton.jit
def sequence_bounds(cu_ptr, i_n, T, VARLEN: tl.constexpr):
    """(batch index, first token, end token) of sequence ``i_n``; packed offsets are clamped
    into [0, T] so that a bad cu_seqlens on the GPU (not value-checked there: that needs a host
    sync) never reads out of bounds."""
    i_b = i_n
    bos = i_n * 0
    eos = bos + T
    if VARLEN:
        i_b = i_n * 0
        bos = tl.minimum(tl.maximum(tl.load(cu_ptr + i_n).to(tl.int64), 0), eos)
        eos = tl.minimum(tl.maximum(tl.load(cu_ptr + i_n + 1).to(tl.int64), bos), eos)
    return i_b, bos, eos


def bth_strides(tensor: torch.Tensor) -> tuple[int, int, int]:
    """(stride_b, stride_t, stride_h) of a [B, T, H, ...] tensor."""
    return tensor.stride(0), tensor.stride(1), tensor.stride(2)


def unit_last_stride(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.stride(-1) == 1 else tensor.contiguous()
