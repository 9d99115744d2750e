"""Benchmark cases for fusetune.causal_conv1d: bf16, forward + backward with the weight and
bias gradients, at a Qwen3.5 Gated DeltaNet layer's short convolution (B4 T4096, 8192 channels:
q and k of 16 heads of 128, v of 32; width 4, SiLU). x is the [B, T, C] projection output seen
as [B, C, T], as transformers passes it.

Providers: fusetune, transformers' fallback without the causal-conv1d package (cast, cuDNN's
depthwise F.conv1d, SiLU) and torch.compile of it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

import fusetune
from fusetune.bench.harness import Case, backward_step, register

SHAPE = (4, 8192, 4096)  # batch, channels, time
CPU_SHAPE = (2, 96, 64)
WIDTH = 4
BF16_BYTES = 2


def _transformers_fallback(x, weight, bias):
    """transformers' causal_conv1d_fn (Qwen3.5) without the causal-conv1d package."""
    out = F.conv1d(x.to(weight.dtype), weight.unsqueeze(1), bias, padding=WIDTH - 1,
                   groups=x.shape[1])[..., : x.shape[-1]]  # fmt: skip
    return F.silu(out).to(x.dtype)


def _make(device: torch.device, quick: bool) -> dict[str, Callable[[], object]]:
    batch, channels, time = SHAPE if device.type == "cuda" else CPU_SHAPE
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    btc = torch.randn(batch, time, channels, device=device).to(dtype)
    x = btc.transpose(1, 2).requires_grad_()
    weight = (torch.randn(channels, WIDTH, device=device) * 0.5).to(dtype).requires_grad_()
    bias = (torch.randn(channels, device=device) * 0.1).to(dtype).requires_grad_()
    # the output's gradient in the output's memory order, [B, T, C] seen as [B, C, T], as
    # transformers' transpose back hands it over (a [B, C, T]-contiguous one was timed before
    # 2026-11-26 (fourth): uncoalesced beside channel-contiguous x, for every provider)
    grads = [torch.randn(batch, time, channels, device=device, dtype=dtype).transpose(1, 2)]
    leaves = [x, weight, bias]
    providers = {
        "fusetune": backward_step(
            lambda: fusetune.causal_conv1d(x, weight, bias, "silu"), grads, leaves
        ),  # fmt: skip
        "transformers": backward_step(
            lambda: _transformers_fallback(x, weight, bias), grads, leaves
        ),  # fmt: skip
    }
    if device.type == "cuda":
        compiled = torch.compile(_transformers_fallback)
        providers["torch.compile"] = backward_step(lambda: compiled(x, weight, bias), grads, leaves)
    return providers


def _floor_bytes(quick: bool) -> float:
    # forward reads x, writes out; backward reads x and dout, writes dx
    batch, channels, time = SHAPE
    return float(5 * batch * channels * time * BF16_BYTES)


register(
    Case(
        op="causal_conv1d",
        name="4x8192x4096 bf16 width 4 silu",
        make=_make,
        floor_bytes=_floor_bytes,
    )
)
