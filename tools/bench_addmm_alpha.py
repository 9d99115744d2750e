"""Does addmm's alpha cost time? The LoRA up-projection y += s * xa @ B^T three ways, bf16 on a GPU.

    python tools/bench_addmm_alpha.py [--tokens 8192] [--rank 16] [--out 2048]

Rows: addmm_ with alpha 1 (B pre-scaled elsewhere), addmm_ with alpha = s, and B scaled per call
then addmm_ (the mul included). Columns: GPU time per call (CUDA events over 200 calls, median of
7 repeats) at the step's shape, and host time per call (perf_counter over 2000 calls at 16
tokens, where the GPU waits on the host). The three orders alternate within each repeat.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def variants(scale: float):
    def alpha_one(y, xa, b):
        return y.addmm_(xa, b.t())

    def alpha_s(y, xa, b):
        return y.addmm_(xa, b.t(), alpha=scale)

    def scale_b(y, xa, b):
        return y.addmm_(xa, (b * scale).t())

    return {"alpha 1": alpha_one, "alpha s": alpha_s, "B * s": scale_b}


def gpu_ms(fn, args, calls: int = 200) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn(*args)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / calls


def host_us(fn, args, calls: int = 2000) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn(*args)
    elapsed = time.perf_counter() - t0
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--out", type=int, default=2048)
    parser.add_argument("--scale", type=float, default=2.0)
    args = parser.parse_args()
    torch.manual_seed(0)

    def tensors(n):
        return (
            torch.randn(n, args.out, device="cuda", dtype=torch.bfloat16),
            torch.randn(n, args.rank, device="cuda", dtype=torch.bfloat16),
            torch.randn(args.out, args.rank, device="cuda", dtype=torch.bfloat16) * 0.01,
        )

    big, small = tensors(args.tokens), tensors(16)
    table = {name: ([], []) for name in variants(args.scale)}
    for fn in variants(args.scale).values():  # warm up cuBLAS's heuristics
        gpu_ms(fn, big, 20)
        host_us(fn, small, 100)
    for _ in range(7):
        for name, fn in variants(args.scale).items():
            table[name][0].append(gpu_ms(fn, big))
            table[name][1].append(host_us(fn, small))
    print(
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, "
        f"[{args.tokens}, {args.rank}] @ [{args.rank}, {args.out}]"
    )
    print(f"{'variant':8s}  GPU us/call (min/med/max)   host us/call (min/med/max)")
    for name, (gpu, host) in table.items():
        g = [1000 * x for x in gpu]
        print(
            f"{name:8s}  {min(g):6.1f} {statistics.median(g):6.1f} {max(g):6.1f}"
            f"        {min(host):5.1f} {statistics.median(host):5.1f} {max(host):5.1f}"
        )


if __name__ == "__main__":
    main()
