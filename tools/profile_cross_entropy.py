"""Where a cross-entropy step's time goes: GPU kernels vs host overhead (one GPU run).

python tools/profile_cross_entropy.py
"""

from __future__ import annotations

import time

import torch
import triton

import fusetune

ROWS = 8192


def profile(vocab: int) -> None:
    if True:
        logits = (torch.randn(ROWS, vocab, device="cuda") * 3).bfloat16().requires_grad_()
        labels = torch.randint(0, vocab, (ROWS,), device="cuda")
        weight = torch.ones((), device="cuda")

        def step():
            fusetune.cross_entropy(logits, labels).backward()
            logits.grad = None

        def kernel_only():
            torch.ops.fusetune.cross_entropy_forward(
                logits, labels, weight, -100, 0.0, 0.0, None, None, True
            )

        step_ms = triton.testing.do_bench(step, warmup=25, rep=200, return_mode="median")
        kernel_ms = triton.testing.do_bench(kernel_only, warmup=25, rep=200, return_mode="median")
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(50):
            step()
        host_ms = (time.perf_counter() - start) / 50 * 1e3  # launches queue: host time/step
        torch.cuda.synchronize()
        graph_ms = float("nan")
        try:  # the same step without host overhead
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                step()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fusetune.cross_entropy(logits, labels).backward()
            graph_ms = triton.testing.do_bench(
                graph.replay, warmup=25, rep=200, return_mode="median"
            )
        except Exception as exc:
            print("graph capture failed:", repr(exc)[:200])
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                step()
            torch.cuda.synchronize()
        print(
            f"V={vocab}: step {step_ms:.3f} ms | forward kernels only {kernel_ms:.3f} ms | "
            f"host per step {host_ms:.3f} ms | cuda graph replay {graph_ms:.3f} ms"
        )
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8))


if __name__ == "__main__":
    for vocab in (32000, 128256):
        profile(vocab)
