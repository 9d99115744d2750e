"""GSA kernel timings on the GPU: the forward and backward ops alone, then a per-kernel profile.

    PYTHONPATH=src python tools/profile_gsa.py [B T H D M]
Uses the library's launch settings (``fusetune.ops.linear_attention.gsa_chunk``);
``tools/tune_gsa.py`` times variants of them.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
import triton.testing

from fusetune.ops.linear_attention import gsa as api


def main() -> None:
    b, t, h, d, m = (int(x) for x in sys.argv[1:6]) if len(sys.argv) > 5 else (4, 4096, 16, 64, 64)
    dev, dt = torch.device("cuda"), torch.bfloat16
    q, k, v = (torch.randn(b, t, h, d, device=dev, dtype=dt) for _ in range(3))
    g = F.logsigmoid(torch.randn(b, t, h, m, device=dev)) / 8
    s, g = (1 - g.exp()).to(dt), g.to(dt)
    do = torch.randn(b, t, h, d, device=dev, dtype=dt)
    args = (None, None, None, d**-0.5, "BTHD")

    def forward():
        return api._forward_impl(q, k, v, s, g, *args, False, True)

    def backward():
        return api._backward_impl(do, None, None, q, k, v, s, g, *args, False, True)

    fwd = triton.testing.do_bench(forward, warmup=25, rep=100)
    bwd = triton.testing.do_bench(backward, warmup=25, rep=100)
    print(
        f"B{b} T{t} H{h} D{d} M{m} bf16: fwd {fwd:.3f} ms  bwd {bwd:.3f} ms  "
        f"total {fwd + bwd:.3f} ms"
    )
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            forward()
            backward()
        torch.cuda.synchronize()
    print(
        prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=40)
    )


if __name__ == "__main__":
    main()
