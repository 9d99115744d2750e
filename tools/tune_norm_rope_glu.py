"""Sweep the launch constants of the RMSNorm, RoPE and SwiGLU kernels on the benchmark shapes.

Usage (GPU): PYTHONPATH=src python tools/tune_norm_rope_glu.py [rms_norm rope swiglu]
Prints forward+backward milliseconds (do_bench median) per configuration, best first.
"""

from __future__ import annotations

import itertools
import sys

import torch
import triton.testing

import fusetune
from fusetune.ops import activation, rms_norm, rope


def bench(step) -> float:
    step()
    return triton.testing.do_bench(step, warmup=10, rep=60)


def sweep_rms_norm() -> list[tuple[str, float]]:
    x = torch.randn(16384, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = torch.ones(4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(x)

    def step():
        fusetune.rms_norm(x, weight).backward(grad)
        x.grad = weight.grad = None

    results, original = [], rms_norm._launch_plan
    for rows, warps, per_sm in itertools.product((1, 2), (4, 8, 16), (1, 2, 4)):
        rms_norm._launch_plan = lambda n, r=rows, w=warps: rms_norm._LaunchPlan(
            r, triton.next_power_of_2(n), w
        )
        rms_norm.BACKWARD_PROGRAMS_PER_SM = per_sm
        results.append((f"rows={rows} warps={warps} per_sm={per_sm}", bench(step)))
    rms_norm._launch_plan = original
    return results


def sweep_rope() -> list[tuple[str, float]]:
    q = torch.randn(8, 32, 2048, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(8, 8, 2048, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    cos = torch.rand(8, 2048, 128, device="cuda", dtype=torch.bfloat16)
    sin = torch.rand_like(cos)
    grads = (torch.randn_like(q), torch.randn_like(k))

    def step():
        torch.autograd.backward(fusetune.rope(q, k, cos, sin, layout="BHTD"), grads)
        q.grad = k.grad = None

    results, original = [], rope._launch_plan
    for heads, warps in itertools.product((8, 16, 32), (2, 4, 8, 16)):
        rope._launch_plan = lambda n, d, r, h=heads, w=warps: rope._LaunchPlan(
            triton.next_power_of_2(r // 2), h, 64, w
        )
        results.append((f"heads={heads} warps={warps}", bench(step)))
    rope._launch_plan = original
    return results


def sweep_swiglu() -> list[tuple[str, float]]:
    gate = torch.randn(16384, 14336, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    up = torch.randn_like(gate, requires_grad=True)
    grad = torch.randn_like(gate)

    def step():
        fusetune.swiglu(gate, up).backward(grad)
        gate.grad = up.grad = None

    results = []
    original = activation.BLOCK, activation.NUM_WARPS
    for block, warps in itertools.product((1024, 2048, 4096), (4, 8, 16)):
        activation.BLOCK, activation.NUM_WARPS = block, warps
        activation._warps = lambda b, w=warps: w
        results.append((f"block={block} warps={warps}", bench(step)))
    activation.BLOCK, activation.NUM_WARPS = original
    return results


SWEEPS = {"rms_norm": sweep_rms_norm, "rope": sweep_rope, "swiglu": sweep_swiglu}

if __name__ == "__main__":
    for name in sys.argv[1:] or list(SWEEPS):
        results = sorted(SWEEPS[name](), key=lambda item: item[1])
        print(f"== {name}: best of {len(results)}")
        for label, ms in results[:6]:
            print(f"  {ms:7.3f} ms  {label}")
        print(f"  worst {results[-1][1]:.3f} ms  {results[-1][0]}", flush=True)
        torch.cuda.empty_cache()
