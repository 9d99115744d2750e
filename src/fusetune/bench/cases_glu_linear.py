"""Benchmark cases for fusetune.glu_linear: a gated MLP's product and down projection, bf16
gate and up [tokens, intermediate], a trained bf16 weight [hidden, intermediate], forward +
backward (dgate, dup, dW).

Providers: fusetune (the product recomputed in the backward, not kept), fusetune's swiglu then
torch's linear (the product kept for dW, as ``fusetune.apply`` ran before glu_linear), torch
eager (``F.linear(F.silu(gate) * up, W)``, as LlamaMLP) and torch.compile of that. The peak
column is the point: the same three matmuls, one [tokens, intermediate] tensor fewer kept.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

import fusetune
from fusetune.bench.harness import Case, register, three_products_floor

SHAPES = [(8192, 8192, 2048)]  # Llama-3.2-1B's MLP at 4 x 2048 tokens
CPU_SHAPE = (64, 256, 128)


def _torch(gate, up, weight):
    return F.linear(F.silu(gate) * up, weight)


def _swiglu_then_linear(gate, up, weight):
    return F.linear(fusetune.swiglu(gate, up), weight)


def _make(tokens: int, intermediate: int, hidden: int):
    def make(device: torch.device, quick: bool) -> dict[str, Callable[[], object]]:
        n, i, o = (tokens, intermediate, hidden) if device.type == "cuda" else CPU_SHAPE
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        gate = (torch.randn(n, i, device=device) * 2).to(dtype).requires_grad_()
        up = torch.randn(n, i, device=device, dtype=dtype, requires_grad=True)
        weight = (torch.randn(o, i, device=device) / i**0.5).to(dtype).requires_grad_()
        grad = torch.randn(n, o, device=device, dtype=dtype)

        def step(fn: Callable) -> Callable[[], None]:
            def run() -> None:
                fn(gate, up, weight).backward(grad)
                gate.grad = up.grad = weight.grad = None

            return run

        providers = {
            "fusetune": step(fusetune.glu_linear),
            "swiglu + linear": step(_swiglu_then_linear),
            "torch": step(_torch),
        }
        if device.type == "cuda":
            providers["torch.compile"] = step(torch.compile(_torch))
        return providers

    return make


for _tokens, _intermediate, _hidden in SHAPES:
    register(
        Case(
            op="glu_linear",
            name=f"{_tokens}x{_intermediate}->{_hidden} bf16",
            make=_make(_tokens, _intermediate, _hidden),
            floor_flops=three_products_floor((_tokens, _intermediate, _hidden), CPU_SHAPE),
        )
    )
