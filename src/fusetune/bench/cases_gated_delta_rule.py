"""Benchmark cases for fusetune.gated_delta_rule: bf16, forward + backward.

Providers: fusetune (chunk mode), transformers' torch fallback (``torch_chunk_gated_delta_rule``
of Qwen3.5's modeling file, unwrapped from its hub/FLA dispatch), FLA's chunk_gated_delta_rule
(fla-core) when importable, and for scale torch's causal scaled_dot_product_attention (flash)
on the same B, T, H, D. Inputs as a Qwen3.5 layer makes them: raw q, k with
use_qk_l2norm_in_kernel=True, g = -A softplus(a) in fp32, beta = sigmoid(b) in bf16.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

import fusetune
from fusetune.bench.harness import Case, backward_step, register

HEAD_DIM, HEADS = 128, 16
CASES = [("B4 T4096", 4, 4096), ("B1 T32768", 1, 32768)]  # (name, batch, T)
CPU_SHAPE = (1, 40, 2, 16)  # B, T, H, D for the smoke run
BF16_BYTES = 2


def _fla_chunk() -> tuple[str, Callable] | None:
    """(provider name, FLA's chunk_gated_delta_rule), or None where FLA is not importable.
    FLA 0.6 refuses its gated backward on Hopper under Triton < 3.7.1 (its issue #640: wrong
    dq/dk/dw/dg from that compiler). The GPU image has Triton 3.6, so the bench lifts that
    guard for this process and names the row "timing only": the kernels FLA runs are the same,
    their results are not checked."""
    try:
        from fla.ops.common import chunk_o
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception as exc:  # noqa: BLE001 - a missing peer (or its dependency) is a result
        print(f"note: fla not importable: {type(exc).__name__}: {exc}", file=sys.stderr)
        return None
    # The lift is remembered on the module: the next case's row must keep its label too.
    lifted = getattr(chunk_o, "_lifted_by_fusetune", False)
    if getattr(chunk_o, "TRITON_ABOVE_3_7_1", True) and not lifted:
        return "fla", chunk_gated_delta_rule
    chunk_o.TRITON_ABOVE_3_7_1 = chunk_o._lifted_by_fusetune = True
    return "fla (Triton < 3.7.1 guard lifted: timing only)", chunk_gated_delta_rule


def _transformers_torch() -> Callable | None:
    try:
        from transformers.models.qwen3_5 import modeling_qwen3_5
    except Exception as exc:  # noqa: BLE001
        print(f"note: transformers' qwen3_5 not importable: {exc}", file=sys.stderr)
        return None
    function = modeling_qwen3_5.torch_chunk_gated_delta_rule
    return getattr(function, "__wrapped__", function)  # the torch loop, not hub / FLA


def _inputs(batch, seq_len, heads, dim, dtype, device):
    def leaf(tensor):
        return tensor.to(dtype).requires_grad_()

    q, k, v = (leaf(torch.randn(batch, seq_len, heads, dim, device=device)) for _ in range(3))
    decay_rate = torch.rand(heads, device=device) * 4 + 0.05
    a = torch.randn(batch, seq_len, heads, device=device)
    g = (-decay_rate * F.softplus(a)).requires_grad_()  # fp32, as the layer makes it
    beta = leaf(torch.sigmoid(torch.randn(batch, seq_len, heads, device=device)))
    return [q, k, v, g, beta]


def _make(batch: int, seq_len: int):
    def make(device: torch.device, quick: bool) -> dict[str, Callable[[], object]]:
        b, t, h, d = (batch, seq_len, HEADS, HEAD_DIM)
        if device.type != "cuda":
            b, t, h, d = CPU_SHAPE
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        leaves = _inputs(b, t, h, d, dtype, device)
        grad_out = torch.randn(b, t, h, d, device=device, dtype=dtype)

        def ours():
            return fusetune.gated_delta_rule(*leaves, use_qk_l2norm_in_kernel=True)[0]

        providers = {"fusetune": backward_step(ours, [grad_out], leaves)}
        torch_fallback = _transformers_torch()
        if torch_fallback is not None:
            providers["transformers-torch"] = backward_step(
                lambda: torch_fallback(*leaves, use_qk_l2norm_in_kernel=True)[0],
                [grad_out],
                leaves,
            )
        if device.type == "cuda":
            fla = _fla_chunk()
            if fla is not None:
                name, chunk = fla
                providers[name] = backward_step(
                    lambda: chunk(*leaves, use_qk_l2norm_in_kernel=True)[0], [grad_out], leaves
                )
            qkv = [x.detach().transpose(1, 2).contiguous().requires_grad_() for x in leaves[:3]]
            sdpa_grad = grad_out.transpose(1, 2).contiguous()
            providers["sdpa-causal"] = backward_step(
                lambda: F.scaled_dot_product_attention(*qkv, is_causal=True), [sdpa_grad], qkv
            )
        return providers

    return make


def _floor_bytes(batch: int, seq_len: int) -> Callable[[bool], float]:
    # Read q, k, v and the output gradient, write o and the q, k, v gradients (g, beta and
    # their gradients are per head, 1/D of that).
    return lambda quick: 8.0 * batch * seq_len * HEADS * HEAD_DIM * BF16_BYTES


for _name, _batch, _seq_len in CASES:
    register(
        Case(
            op="gated_delta_rule",
            name=f"{_name} H{HEADS} D{HEAD_DIM} bf16",
            make=_make(_batch, _seq_len),
            floor_bytes=_floor_bytes(_batch, _seq_len),
        )
    )
