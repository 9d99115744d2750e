"""Time the parts of a lora_mlp step at the benchmark shape and sweep its kernels' tiles.

Usage (GPU): PYTHONPATH=src python tools/tune_lora.py
Prints: the base matmuls alone (the floor's work), each kernel per tile config, and the full
fwd+bwd step (bf16 base, fp32 adapters under bf16 autocast) with its peak extra memory.
"""

from __future__ import annotations

import itertools

import torch
import triton.testing

import fusetune
from fusetune.ops import lora as L

N, H, INTER, R = 8192, 4096, 14336, 16
FORWARD = [(32, 128, 4), (32, 64, 4), (16, 128, 4), (32, 256, 4), (32, 128, 8), (64, 64, 4)]
BACKWARD = [
    (32, 64, 4, 4),
    (32, 64, 4, 2),
    (32, 64, 4, 8),
    (16, 64, 4, 4),
    (32, 32, 4, 4),
    (16, 128, 4, 4),
    (32, 128, 8, 4),
    (32, 64, 8, 4),
    (16, 64, 2, 4),
]


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100)


def attempt(fn) -> float:
    """bench(fn), or nan when the config does not launch (e.g. out of shared memory)."""
    try:
        return bench(fn)
    except Exception as exc:  # noqa: BLE001
        print(f"  ({type(exc).__name__}: {str(exc)[:80]})")
        return float("nan")


def main() -> None:
    dev = torch.device("cuda")
    bf16 = torch.bfloat16
    x = torch.randn(N, H, device=dev, dtype=bf16, requires_grad=True)
    shapes = ((INTER, H), (INTER, H), (H, INTER))
    w = [torch.randn(o, i, device=dev, dtype=bf16) / i**0.5 for o, i in shapes]
    a = [torch.randn(R, i, device=dev) / i**0.5 for i in (H, H, INTER)]
    b = [torch.randn(o, R, device=dev) * 0.05 for o in (INTER, INTER, H)]
    for t in a + b:
        t.requires_grad_()
    dy = torch.randn(N, H, device=dev, dtype=bf16)
    xd = x.detach()

    def matmuls():
        gate, up = xd @ w[0].t(), xd @ w[1].t()
        h = gate * 0  # stand-in, no activation
        y = h @ w[2].t()
        dh = dy @ w[2]
        return dh @ w[0] + up @ w[1], y

    print(f"base matmuls alone (6 x N x {H} x {INTER}): {bench(matmuls):.3f} ms")

    gate, up = xd @ w[0].t(), xd @ w[1].t()
    xa = torch.randn(N, 2 * R, device=dev, dtype=bf16)
    bg, bu, ad = b[0].to(bf16), b[1].to(bf16), a[2].to(bf16)
    gd = torch.randn(N, R, device=dev, dtype=bf16)
    dh = torch.randn(N, INTER, device=dev, dtype=bf16)
    out_g, out_u = torch.empty_like(gate), torch.empty_like(up)
    for bm, bn, warps in FORWARD:
        L.FORWARD_BM, L.FORWARD_BN, L.FORWARD_WARPS = bm, bn, warps
        ms = attempt(
            lambda: L._glu_forward(gate, up, xa[:, :R], xa[:, R:], bg, bu, 2.0, 2.0, "swiglu")
        )
        print(
            f"forward kernel BM={bm} BN={bn} warps={warps}: {ms:.3f} ms "
            f"({3 * N * INTER * 2 / ms / 1e6:.0f} GB/s)"
        )
    for bm, bn, warps, per_sm in BACKWARD:
        L.BACKWARD_BM, L.BACKWARD_BN, L.BACKWARD_WARPS = bm, bn, warps
        L.BACKWARD_PROGRAMS_PER_SM = per_sm
        ms = attempt(
            lambda: L._glu_backward(
                dh,
                gd,
                ad,
                2.0,
                gate,
                up,
                xa[:, :R],
                xa[:, R:],
                bg,
                bu,
                2.0,
                2.0,
                "swiglu",
                out_g,
                out_u,
            )
        )
        print(
            f"backward kernel BM={bm} BN={bn} warps={warps} per_sm={per_sm}: {ms:.3f} ms "
            f"({5 * N * INTER * 2 / ms / 1e6:.0f} GB/s)"
        )
    L.FORWARD_BM, L.FORWARD_BN, L.FORWARD_WARPS = 32, 128, 4
    L.BACKWARD_BM, L.BACKWARD_BN, L.BACKWARD_WARPS, L.BACKWARD_PROGRAMS_PER_SM = 32, 64, 4, 4

    projections = [(w[i], a[i], b[i], 2.0) for i in range(3)]

    def step():
        with torch.autocast("cuda", dtype=bf16):
            y = fusetune.lora_mlp(x, *projections)
        y.backward(dy)
        for t in [x, *a, *b]:
            t.grad = None

    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    print(f"full step (defaults): {bench(step):.3f} ms, peak extra {peak:.3f} GiB")
    for bwd in itertools.islice(BACKWARD, 1, 3):
        L.BACKWARD_BM, L.BACKWARD_BN, L.BACKWARD_WARPS, L.BACKWARD_PROGRAMS_PER_SM = bwd
        print(f"full step backward {bwd}: {attempt(step):.3f} ms")
    L.BACKWARD_BM, L.BACKWARD_BN, L.BACKWARD_WARPS, L.BACKWARD_PROGRAMS_PER_SM = BACKWARD[0]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18))


if __name__ == "__main__":
    main()
