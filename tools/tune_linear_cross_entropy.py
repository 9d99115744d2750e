"""Sweep linear_cross_entropy's rows per chunk on the GPU: fwd+bwd time and peak memory above
the inputs (gradients included), next to the three plain cuBLAS matmuls' time (the floor this
design can reach) for the same shapes.

Usage: PYTHONPATH=src python tools/tune_linear_cross_entropy.py [--rows 256 512 ...]
"""

from __future__ import annotations

import argparse

import torch
from triton.testing import do_bench

import fusetune
from fusetune.ops.linear_cross_entropy import chunk_rows

SHAPES = [(8192, 4096, 128256), (8192, 2304, 256000), (32768, 4096, 128256)]


def measure(step) -> tuple[float, float]:
    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    return do_bench(step, warmup=25, rep=200), peak


def matmul_floor(n: int, h: int, v: int) -> float:
    """logits = X W^T, grad X = G W, grad W = G^T X with cuBLAS, one row chunk of 2048."""
    rows = min(n, 2048)
    x = torch.randn(rows, h, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(v, h, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(rows, v, device="cuda", dtype=torch.bfloat16)
    gw = torch.zeros(v, h, device="cuda", dtype=torch.bfloat16)

    def three() -> None:
        x @ w.t()
        g @ w
        gw.addmm_(g.t(), x)

    return do_bench(three, warmup=25, rep=200) * n / rows


def sweep(n: int, h: int, v: int, candidates: list[int]) -> None:
    hidden = torch.randn(n, h, device="cuda").to(torch.bfloat16).requires_grad_()
    weight = (torch.randn(v, h, device="cuda") * 2 / h**0.5).to(torch.bfloat16)
    weight.requires_grad_()
    labels = torch.randint(0, v, (n,), device="cuda")
    default = chunk_rows(n, weight)
    for rows in sorted({default, *candidates}):

        def step(rows: int = rows) -> None:
            fusetune.linear_cross_entropy(hidden, weight, labels, chunk_size=rows).backward()
            hidden.grad = weight.grad = None

        ms, peak = measure(step)
        mark = " (default)" if rows == default else ""
        print(f"{n}x{h}x{v:>7} {rows:>6} {ms:8.2f} {peak:9.3f}{mark}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, nargs="*", default=[256, 512, 1024, 2048])
    args = parser.parse_args()
    print(f"{'shape':>20} {'rows':>6} {'ms':>8} {'peak GiB':>9}")
    for n, h, v in SHAPES:
        sweep(n, h, v, args.rows)
        print(f"{n}x{h}x{v:>7} cuBLAS 3 matmuls (2048-row chunks): {matmul_floor(n, h, v):.2f} ms")


if __name__ == "__main__":
    main()
