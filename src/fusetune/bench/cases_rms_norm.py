"""Benchmark cases for fusetune.rms_norm, add_rms_norm and rms_norm_gated: bf16, forward +
backward with the weight gradient.

Providers: fusetune, torch eager as transformers' LlamaRMSNorm (Qwen3_5RMSNormGated for the
gated case) computes it, torch.compile of that, and Liger-Kernel's LigerRMSNorm /
LigerFusedAddRMSNorm (their defaults) when importable.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

import fusetune
from fusetune.bench.harness import Case, backward_step, register

SHAPES = [(16384, 4096)]
# Qwen3.5's Gated DeltaNet output norm at B4 T4096, 16 value heads of 128
GATED_SHAPE = (4 * 4096 * 16, 128)
CPU_SHAPE = (64, 384)
EPS = 1e-6
BF16_BYTES = 2


def _torch_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """transformers' LlamaRMSNorm.forward."""
    hidden = x.to(torch.float32)
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + EPS)
    return weight * hidden.to(x.dtype)


def _torch_add_norm(x, residual, weight):
    new_residual = x + residual
    return _torch_norm(new_residual, weight), new_residual


def _torch_gated_norm(x, gate, weight):
    """transformers' Qwen3_5RMSNormGated.forward."""
    y = _torch_norm(x, weight) * torch.nn.functional.silu(gate.to(torch.float32))
    return y.to(x.dtype)


def _liger(kind: str, hidden: int, device: torch.device):
    try:
        if kind == "add":
            from liger_kernel.transformers import LigerFusedAddRMSNorm as Module
        else:
            from liger_kernel.transformers import LigerRMSNorm as Module
    except ImportError:
        return None
    return Module(hidden, eps=EPS).to(device, torch.bfloat16)


def _make(rows: int, hidden: int, kind: str):
    """kind: "norm", "add" (residual add + norm) or "gated"."""
    add = kind == "add"

    def make(device: torch.device, quick: bool) -> dict[str, Callable[[], object]]:
        n, h = (rows, hidden) if device.type == "cuda" else CPU_SHAPE
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        x = (torch.randn(n, h, device=device) * 2).to(dtype).requires_grad_()
        residual = (torch.randn(n, h, device=device) * 2).to(dtype).requires_grad_()
        weight = (torch.rand(h, device=device) + 0.5).to(dtype).requires_grad_()
        grads = [torch.randn(n, h, device=device, dtype=dtype) for _ in range(2)]
        leaves = [x, residual, weight] if kind != "norm" else [x, weight]
        if kind == "gated":  # residual stands for the gate
            ours = lambda: fusetune.rms_norm_gated(x, residual, weight, EPS)  # noqa: E731
            eager, args = _torch_gated_norm, (x, residual, weight)
        elif add:
            ours = lambda: fusetune.add_rms_norm(x, residual, weight, EPS)  # noqa: E731
            eager, args = _torch_add_norm, (x, residual, weight)
        else:
            ours = lambda: fusetune.rms_norm(x, weight, EPS)  # noqa: E731
            eager, args = _torch_norm, (x, weight)
        providers = {
            "fusetune": backward_step(ours, grads, leaves),
            "torch": backward_step(lambda: eager(*args), grads, leaves),
        }
        if device.type == "cuda":
            compiled = torch.compile(eager)
            providers["torch.compile"] = backward_step(lambda: compiled(*args), grads, leaves)
            liger = _liger(kind, h, device) if kind != "gated" else None
            if liger is not None:
                with torch.no_grad():
                    liger.weight.copy_(weight)
                liger_leaves = [x, residual, liger.weight] if add else [x, liger.weight]
                liger_args = (x, residual) if add else (x,)
                providers["liger"] = backward_step(lambda: liger(*liger_args), grads, liger_leaves)
        return providers

    return make


def _floor_bytes(rows: int, hidden: int, kind: str) -> Callable[[bool], float]:
    # forward reads x (and the residual or gate) and writes y (and the new residual); backward
    # reads the norm input and dy (and the new residual's gradient, or the gate) and writes dx
    # (and dresidual or dgate)
    tensors = {"norm": 5, "add": 9, "gated": 8}[kind]
    return lambda quick: float(tensors * rows * hidden * BF16_BYTES)


_CASES = [(rows, hidden, kind) for rows, hidden in SHAPES for kind in ("norm", "add")]
for _rows, _hidden, _kind in [*_CASES, (*GATED_SHAPE, "gated")]:
    suffix = {"norm": "", "add": " add+norm", "gated": " gated"}[_kind]
    register(
        Case(
            op="rms_norm",
            name=f"{_rows}x{_hidden} bf16{suffix}",
            make=_make(_rows, _hidden, _kind),
            floor_bytes=_floor_bytes(_rows, _hidden, _kind),
        )
    )
