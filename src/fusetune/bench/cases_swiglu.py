"""Benchmark cases for fusetune.swiglu (and geglu): bf16 gate and up [tokens, intermediate],
forward + backward.

Providers: fusetune, torch eager (``F.silu(gate) * up``, as LlamaMLP), torch.compile of that,
and Liger-Kernel's LigerSiLUMulFunction / LigerGELUMulFunction when importable.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

import fusetune
from fusetune.bench.harness import Case, register

SHAPES = [(16384, 14336)]
CPU_SHAPE = (64, 512)
BF16_BYTES = 2


def _torch_swiglu(gate, up):
    return F.silu(gate) * up


def _torch_geglu(gate, up):
    return F.gelu(gate, approximate="tanh") * up


def _liger(activation: str):
    try:
        if activation == "silu":
            from liger_kernel.ops.swiglu import LigerSiLUMulFunction as Function
        else:
            from liger_kernel.ops.geglu import LigerGELUMulFunction as Function
    except ImportError:
        return None
    return Function.apply


def _make(rows: int, cols: int, activation: str):
    def make(device: torch.device, quick: bool) -> dict[str, Callable[[], object]]:
        n, i = (rows, cols) if device.type == "cuda" else CPU_SHAPE
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        gate = (torch.randn(n, i, device=device) * 2).to(dtype).requires_grad_()
        up = torch.randn(n, i, device=device, dtype=dtype, requires_grad=True)
        grad = torch.randn(n, i, device=device, dtype=dtype)

        def step(fn: Callable) -> Callable[[], None]:
            def run() -> None:
                fn(gate, up).backward(grad)
                gate.grad = up.grad = None

            return run

        if activation == "silu":
            ours, eager = fusetune.swiglu, _torch_swiglu
        else:
            ours, eager = (lambda g, u: fusetune.geglu(g, u, "tanh")), _torch_geglu
        providers = {"fusetune": step(ours), "torch": step(eager)}
        if device.type == "cuda":
            providers["torch.compile"] = step(torch.compile(eager))
            liger = _liger(activation)
            if liger is not None:
                providers["liger"] = step(liger)
        return providers

    return make


def _floor_bytes(rows: int, cols: int) -> Callable[[bool], float]:
    # forward: read gate, up, write out; backward: read grad, gate, up, write both gradients
    return lambda quick: 8.0 * rows * cols * BF16_BYTES


for _rows, _cols in SHAPES:
    for _activation in ("silu", "gelu_tanh"):
        register(
            Case(
                op="swiglu",
                name=f"{_rows}x{_cols} bf16" + ("" if _activation == "silu" else " geglu-tanh"),
                make=_make(_rows, _cols, _activation),
                floor_bytes=_floor_bytes(_rows, _cols),
            )
        )
