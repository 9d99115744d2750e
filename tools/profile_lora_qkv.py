"""Is the lora_qkv step bound by the GPU or by the host? (the bench's QKV case, one process)

Usage (GPU): PYTHONPATH=src python tools/profile_lora_qkv.py
Prints, per adapter dtype: the six base matmuls alone (the floor's work), the step
(triton.testing.do_bench, as the bench), the GPU time of its kernels (profiler, per step), the
host time to enqueue one step, and the number of kernel launches per step.
"""

from __future__ import annotations

import time

import torch
import triton.testing

import fusetune

N, H, KV, R, SCALING = 8192, 4096, 1024, 16, 2.0


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=200)


def main() -> None:
    dev, bf16 = torch.device("cuda"), torch.bfloat16
    x = torch.randn(N, H, device=dev, dtype=bf16, requires_grad=True)
    outs = (H, KV, KV)
    weights = [torch.randn(o, H, device=dev, dtype=bf16) / H**0.5 for o in outs]
    dys = [torch.randn(N, o, device=dev, dtype=bf16) for o in outs]
    xd = x.detach()

    def matmuls():
        for w, dy in zip(weights, dys, strict=True):
            xd @ w.t()
            dy @ w

    print(f"six base matmuls alone: {bench(matmuls):.3f} ms")
    for adapter_dtype in (torch.float32, bf16):
        profile(make_step(x, weights, dys, adapter_dtype), str(adapter_dtype))


def make_step(x, weights, dys, adapter_dtype):
    """One fwd+bwd of lora_qkv (fp32 adapters under bf16 autocast, as PEFT; bf16 without)."""
    dev, bf16 = x.device, torch.bfloat16
    lora = [
        (
            (torch.randn(R, H, device=dev, dtype=adapter_dtype) / H**0.5).requires_grad_(),
            (torch.randn(w.shape[0], R, device=dev, dtype=adapter_dtype) * 0.05).requires_grad_(),
        )
        for w in weights
    ]
    projections = [(w, a, b, SCALING) for w, (a, b) in zip(weights, lora, strict=True)]
    params = [x, *(t for pair in lora for t in pair)]

    def step():
        with torch.autocast("cuda", dtype=bf16, enabled=adapter_dtype == torch.float32):
            q, k, v = fusetune.lora_qkv(x, *projections)
        torch.autograd.backward((q, k, v), dys)
        for t in params:
            t.grad = None

    return step


def profile(step, label: str) -> None:
    """Prints the step's bench time, GPU kernel time, launches and host enqueue time."""
    step()
    torch.cuda.synchronize()
    ms = bench(step)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        step()
    host_ms = (time.perf_counter() - start) / 10 * 1e3
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu_ms = sum(e.self_device_time_total for e in kernels) / 5 / 1e3
    launches = sum(e.count for e in kernels) / 5
    print(
        f"{label}: step {ms:.3f} ms | kernels {gpu_ms:.3f} ms GPU, "
        f"{launches:.0f} launches | host enqueue {host_ms:.3f} ms"
    )
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))


if __name__ == "__main__":
    main()
