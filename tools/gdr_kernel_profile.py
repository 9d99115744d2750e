"""Gated DeltaNet fwd+bwd, GPU time per kernel: fusetune beside FLA's chunk_gated_delta_rule on
the same inputs (bench/cases_gated_delta_rule.py's, bf16, l2norm in the kernels), one profiled
step each after warm-up. Says which of fusetune's kernels is slower than its FLA counterpart
(issue 20: fusetune 16.4 ms against FLA's 6.4 at B1 T32768; the sequential kernels cost ~6-14 us
a chunk step against FLA's ~2.4 before the bf16 products).

    PYTHONPATH=src:tests:tools:/tmp/site \
        python tools/gdr_kernel_profile.py --batch 1 --seq-len 32768

"us / chunk" divides a kernel's time by the chunks of one sequence (T / 64): the step latency
for the kernels that walk the chunks in order (fusetune's states / dstates, FLA's *_h / dhu).
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch
from gdr_modes_bench import DIM, HEADS, make_run

import fusetune
from fusetune.bench.cases_gated_delta_rule import _fla_chunk, _inputs

CHUNK = 64


def kernel_times(fwd_bwd) -> dict[str, tuple[float, int]]:
    """{kernel name: (GPU ms, calls)} of one ``fwd_bwd()`` after two untimed ones."""
    for _ in range(2):
        fwd_bwd()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fwd_bwd()
        torch.cuda.synchronize()
    times: dict[str, list] = defaultdict(lambda: [0.0, 0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            entry = times[event.name]
            entry[0] += event.device_time_total / 1e3
            entry[1] += 1
    return {name: (ms, calls) for name, (ms, calls) in times.items()}


def report(provider: str, times: dict[str, tuple[float, int]], chunks: int) -> None:
    total = sum(ms for ms, _ in times.values())
    print(f"\n{provider}: {total:.2f} ms of GPU time in {len(times)} kernels")
    print(f"  {'kernel':60s} {'ms':>7s} {'calls':>5s} {'us / chunk':>10s}")
    for name, (ms, calls) in sorted(times.items(), key=lambda item: -item[1][0]):
        print(f"  {name[:60]:60s} {ms:7.3f} {calls:5d} {ms * 1e3 / chunks:10.2f}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=4096)
    args = parser.parse_args()
    torch.manual_seed(0)
    shape = (args.batch, args.seq_len, HEADS, DIM)
    leaves = _inputs(*shape, torch.bfloat16, torch.device("cuda"))
    grad_out = torch.randn(*shape, device="cuda", dtype=torch.bfloat16)
    providers = {
        "fusetune": lambda: fusetune.gated_delta_rule(*leaves, use_qk_l2norm_in_kernel=True)[0]
    }
    fla = _fla_chunk()
    if fla is not None:
        name, chunk = fla
        providers[name] = lambda: chunk(*leaves, use_qk_l2norm_in_kernel=True)[0]
    print(f"B{args.batch} T{args.seq_len} H{HEADS} D{DIM} bf16 l2norm, fwd+bwd, one profiled step")
    for provider, forward in providers.items():
        fwd_bwd, _ = make_run(forward, leaves, grad_out)
        report(provider, kernel_times(fwd_bwd), -(-args.seq_len // CHUNK))


if __name__ == "__main__":
    main()
