"""Benchmark cases for fusetune.rope: bf16 q and k in transformers' [B, H, T, D] layout, cos and
sin [B, T, D], forward + backward of q and k.

Providers: fusetune, torch eager as transformers' apply_rotary_pos_emb computes it, torch.compile
of that, and Liger-Kernel's liger_rotary_pos_emb when importable.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

import fusetune
from fusetune.bench.harness import Case, register

# batch, q heads, k heads, sequence, head_dim
SHAPES = [(8, 32, 8, 2048, 128)]
CPU_SHAPE = (1, 4, 2, 64, 32)
BF16_BYTES = 2


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _torch_rope(q, k, cos, sin):
    """transformers' apply_rotary_pos_emb (unsqueeze_dim=1)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _make(batch: int, q_heads: int, k_heads: int, seq_len: int, head_dim: int):
    def make(device: torch.device, quick: bool) -> dict[str, Callable[[], object]]:
        b, hq, hk, t, d = (
            (batch, q_heads, k_heads, seq_len, head_dim) if device.type == "cuda" else CPU_SHAPE
        )
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        q = torch.randn(b, hq, t, d, device=device, dtype=dtype, requires_grad=True)
        k = torch.randn(b, hk, t, d, device=device, dtype=dtype, requires_grad=True)
        inv_freq = 10000.0 ** (-torch.arange(0, d, 2, device=device, dtype=torch.float32) / d)
        positions = (
            torch.arange(t, device=device, dtype=torch.float32)[None]
            + torch.arange(b, device=device)[:, None]
        )
        angles = positions[..., None] * inv_freq
        angles = torch.cat((angles, angles), dim=-1)
        cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
        grads = (torch.randn_like(q), torch.randn_like(k))

        def step(rope_fn: Callable) -> Callable[[], None]:
            def run() -> None:
                torch.autograd.backward(rope_fn(q, k, cos, sin), grads)
                q.grad = k.grad = None

            return run

        providers = {
            "fusetune": step(lambda *a: fusetune.rope(*a, layout="BHTD")),
            "torch": step(_torch_rope),
        }
        if device.type == "cuda":
            providers["torch.compile"] = step(torch.compile(_torch_rope))
            try:
                from liger_kernel.transformers.rope import liger_rotary_pos_emb
            except ImportError:
                liger_rotary_pos_emb = None
            if liger_rotary_pos_emb is not None:
                providers["liger"] = step(liger_rotary_pos_emb)
        return providers

    return make


def _floor_bytes(batch, q_heads, k_heads, seq_len, head_dim) -> Callable[[bool], float]:
    # q and k read and written once forward, their gradients once backward (cos/sin: L2)
    return lambda quick: 4.0 * batch * (q_heads + k_heads) * seq_len * head_dim * BF16_BYTES


for _shape in SHAPES:
    _b, _hq, _hk, _t, _d = _shape
    register(
        Case(
            op="rope",
            name=f"q {_b}x{_hq}x{_t}x{_d} k {_b}x{_hk}x{_t}x{_d} bf16",
            make=_make(*_shape),
            floor_bytes=_floor_bytes(*_shape),
        )
    )
