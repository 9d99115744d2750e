"""Where the time of an RMSNorm / RoPE / SwiGLU step goes: GPU kernels or host Python.

Usage (GPU): PYTHONPATH=src python tools/profile_norm_rope_glu.py
For each op, with the eager fast path on and off: do_bench of the forward+backward step, the
same step replayed from a CUDA graph (GPU time alone), host microseconds per step, and the
kernels' GPU times from torch.profiler.
"""

from __future__ import annotations

import time

import torch
import triton.testing

import fusetune
from fusetune.ops import activation, rms_norm, rope


def _steps():
    x = torch.randn(16384, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = torch.ones(4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)

    def norm_step():
        fusetune.rms_norm(x, weight).backward(dy)
        x.grad = weight.grad = None

    q = torch.randn(8, 32, 2048, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(8, 8, 2048, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    cos = torch.rand(8, 2048, 128, device="cuda", dtype=torch.bfloat16)
    sin = torch.rand_like(cos)
    grads = (torch.randn_like(q), torch.randn_like(k))

    def rope_step():
        torch.autograd.backward(fusetune.rope(q, k, cos, sin, layout="BHTD"), grads)
        q.grad = k.grad = None

    gate = torch.randn(16384, 14336, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    up = torch.randn_like(gate, requires_grad=True)
    grad = torch.randn_like(gate)

    def swiglu_step():
        fusetune.swiglu(gate, up).backward(grad)
        gate.grad = up.grad = None

    return {
        "rms_norm": (rms_norm, norm_step),
        "rope": (rope, rope_step),
        "swiglu": (activation, swiglu_step),
    }


def host_us(step, n: int = 20) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        step()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / n * 1e6


def graph_ms(step) -> float | None:
    try:
        return triton.testing.do_bench_cudagraph(step, rep=50)
    except Exception as exc:  # noqa: BLE001 - a diagnostic only
        print(f"    (cuda graph failed: {type(exc).__name__}: {str(exc)[:80]})")
        return None


def kernel_table(step) -> str:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    rows = []
    for event in prof.key_averages():
        cuda_us = getattr(event, "device_time", None) or getattr(event, "cuda_time", 0.0)
        if cuda_us:
            rows.append((cuda_us, event.count, event.key[:70]))
    rows.sort(reverse=True)
    return "\n".join(f"      {us:8.1f} us x{count:<3d} {name}" for us, count, name in rows[:6])


def main() -> None:
    for name, (module, step) in _steps().items():
        original = module._plain
        for fast in (True, False):
            if not fast:
                module._plain = lambda *tensors: False
            step()
            ms = triton.testing.do_bench(step, warmup=10, rep=80)
            print(
                f"{name} fast_path={fast}: step {ms:.3f} ms | graph {graph_ms(step) or 0:.3f} ms"
                f" | host {host_us(step):.0f} us/step"
            )
            if fast:
                print(kernel_table(step))
            module._plain = original
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
