"""Where a cross-entropy step's time goes: GPU kernels vs host overhead (one GPU run).

python tools/profile_cross_entropy.py          timings and the CUDA-kernel table per vocab
python tools/profile_cross_entropy.py --host   cProfile of the host side (launch overhead)
"""

from __future__ import annotations

import cProfile
import pstats
import sys
import time
from collections.abc import Callable

import torch
import triton

import fusetune

ROWS = 8192
VOCABS = (32000, 128256)


def make_inputs(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    logits = (torch.randn(ROWS, vocab, device="cuda") * 3).bfloat16().requires_grad_()
    return logits, torch.randint(0, vocab, (ROWS,), device="cuda")


def make_step(logits: torch.Tensor, labels: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        fusetune.cross_entropy(logits, labels).backward()
        logits.grad = None

    return step


def median_ms(fn: Callable[[], object]) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def graph_replay_ms(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """The same step captured in a CUDA graph: its time without host overhead."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        make_step(logits, labels)()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fusetune.cross_entropy(logits, labels).backward()
    return median_ms(graph.replay)


def report(vocab: int) -> None:
    logits, labels = make_inputs(vocab)
    step = make_step(logits, labels)
    weight = torch.ones((), device="cuda")
    step_ms = median_ms(step)
    kernel_ms = median_ms(
        lambda: torch.ops.fusetune.cross_entropy_forward(
            logits, labels, weight, -100, 0.0, 0.0, None, None, True
        )
    )
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(50):
        step()
    host_ms = (time.perf_counter() - start) / 50 * 1e3  # launches queue: this is host time
    torch.cuda.synchronize()
    try:
        graph_ms = graph_replay_ms(logits, labels)
    except Exception as exc:  # capture is a diagnostic; report and go on
        print("graph capture failed:", repr(exc)[:200])
        graph_ms = float("nan")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    print(
        f"V={vocab}: step {step_ms:.3f} ms | forward kernels only {kernel_ms:.3f} ms | "
        f"host per step {host_ms:.3f} ms | cuda graph replay {graph_ms:.3f} ms"
    )
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8))


def host_profile(vocab: int) -> None:
    step = make_step(*make_inputs(vocab))
    for _ in range(20):
        step()
    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    profiler.runcall(lambda: [step() for _ in range(100)])
    pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    for vocab in VOCABS:
        (host_profile if "--host" in sys.argv else report)(vocab)
