"""Which SDPA backend is fastest for the e2e shapes' causal attention, fwd + bwd (issue 18).

transformers calls ``scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)``
when there is no padding mask; PyTorch then picks a backend by its own priority order. This
times each backend that accepts the call (and the default pick) on one layer's attention,
bf16, median of Triton's do_bench (the log in docs/bench/session-2026-11-26-fourth/ was
taken with a plain CUDA-event median of 20 calls). Usage: python3 tools/sdpa_backends.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

# name: (batch, query heads, key/value heads, head dim), sequence 2048
SHAPES = {"llama-3.2-1b b4": (4, 32, 8, 64), "qwen2.5-0.5b b8": (8, 14, 2, 64),
          "gemma3-1b b4": (4, 4, 1, 256)}  # fmt: skip
BACKENDS = {"default": None, "flash": SDPBackend.FLASH_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}  # fmt: skip
SEQ = 2048


def time_ms(fn) -> float:
    """Median ms of ``fn`` (Triton's do_bench: CUDA events, L2 flushed between calls)."""
    return triton.testing.do_bench(fn, return_mode="median")


def attention_step(q, k, v, grad, gqa: bool):
    """One fwd + bwd as transformers calls it (enable_gqa) or with K/V repeated (repeat_kv)."""
    groups = q.shape[1] // k.shape[1]

    def step():
        kk, vv = (k, v) if gqa else (k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1))
        F.scaled_dot_product_attention(q, kk, vv, is_causal=True, enable_gqa=gqa).backward(grad)

    return step


def timed(step, backend) -> str:
    try:
        if backend is None:
            return f"{time_ms(step):.3f}"
        with sdpa_kernel([backend]):
            return f"{time_ms(step):.3f}"
    except RuntimeError as exc:
        return f"n/a ({str(exc).splitlines()[0][:60]})"


def main() -> None:
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, seq {SEQ}, bf16, fwd+bwd ms")
    for name, (batch, heads, kv_heads, dim) in SHAPES.items():
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(batch, h, SEQ, dim, device="cuda", dtype=torch.bfloat16,
                               generator=gen, requires_grad=True)
                   for h in (heads, kv_heads, kv_heads))  # fmt: skip
        grad = torch.randn(batch, heads, SEQ, dim, device="cuda", dtype=torch.bfloat16)
        for gqa in (True, False):
            step = attention_step(q, k, v, grad, gqa)
            row = [f"{label} {timed(step, backend)}" for label, backend in BACKENDS.items()]
            how = "enable_gqa" if gqa else "repeat_kv"
            print(f"{name:18s} {how:10s} | " + " | ".join(row), flush=True)


if __name__ == "__main__":
    main()
