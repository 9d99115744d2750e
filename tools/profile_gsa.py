"""GSA kernel timings on the GPU: forward op and backward op alone, per launch setting.

    PYTHONPATH=src python tools/profile_gsa.py [B T H D M]
Sweeps the chunk kernels' (S tokens per program, num_warps) and prints ms per op; the setting
the library uses is ``fusetune.gsa.chunk.constants``.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
import triton.testing

from fusetune.gsa import api, chunk

SETTINGS = [(64, 8), (64, 4), (128, 8)]


def main() -> None:
    b, t, h, d, m = (int(x) for x in sys.argv[1:6]) if len(sys.argv) > 5 else (4, 4096, 16, 64,
                                                                                 64)
    dev, dt = torch.device("cuda"), torch.bfloat16
    q, k, v = (torch.randn(b, t, h, d, device=dev, dtype=dt) for _ in range(3))
    g = F.logsigmoid(torch.randn(b, t, h, m, device=dev)) / 8
    s, g = (1 - g.exp()).to(dt), g.to(dt)
    do = torch.randn(b, t, h, d, device=dev, dtype=dt)
    args = (None, None, None, d**-0.5, "BTHD")
    original = chunk.constants
    print(f"B{b} T{t} H{h} D{d} M{m} bf16")
    for bt, warps in SETTINGS:
        chunk.constants = lambda seq_len, interp, bt=bt, warps=warps: dict(
            BT=chunk.SUB_CHUNK, S=bt, num_warps=warps)
        try:
            fwd = triton.testing.do_bench(
                lambda: api._forward_impl(q, k, v, s, g, *args, False, True), warmup=25, rep=100)
            bwd = triton.testing.do_bench(
                lambda: api._backward_impl(do, None, None, q, k, v, s, g, *args, False, True),
                warmup=25, rep=100)
            print(f"chunk S={bt:3d} warps={warps}: fwd {fwd:.3f} ms  bwd {bwd:.3f} ms  "
                  f"total {fwd + bwd:.3f} ms")
        except Exception as exc:  # noqa: BLE001 - a setting that fails to compile is a result
            print(f"chunk S={bt} warps={warps}: {type(exc).__name__}: {str(exc)[:200]}")
    chunk.constants = original
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            api._forward_impl(q, k, v, s, g, *args, False, True)
            api._backward_impl(do, None, None, q, k, v, s, g, *args, False, True)
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=12,
                                      max_name_column_width=40)
    print(table)


if __name__ == "__main__":
    main()
