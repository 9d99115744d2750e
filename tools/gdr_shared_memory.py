"""Shared memory of the gated delta rule chunk kernels, compiled offline for sm_90 (no GPU
needed: Triton's wheel ships ptxas). Prints metadata.shared per kernel with the launcher's
settings (num_stages=1, warps, value blocks), for checking NOTES.md's figures.

    python tools/gdr_shared_memory.py 128        # K = V = 128 (chunk 64)
    python tools/gdr_shared_memory.py 256        # K = V = 256 (chunk 32)

Takes minutes on a CPU (the IEEE-product kernels compile slowly). H100 limit: 232448 bytes.
"""

from __future__ import annotations

import os
import sys

os.environ.pop("FUSETUNE_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from fusetune.ops.linear_attention import gdr_chunk  # noqa: E402

FLOATS = ("scale",)
INTS = ("T", "HV", "K", "V")  # every other non-constexpr argument is a pointer


def shared_bytes(kernel, consts: dict, num_warps: int) -> int:
    signature, constexprs = {}, {}
    for name in kernel.arg_names:
        if name in consts:
            signature[name], constexprs[name] = "constexpr", consts[name]
        elif name in FLOATS:
            signature[name] = "fp32"
        elif name in INTS or name.startswith("s"):
            signature[name] = "i32"
        else:
            signature[name] = "*fp32"
    options = dict(num_warps=num_warps, num_stages=1)
    compiled = triton.compile(
        ASTSource(kernel, signature, constexprs), target=GPUTarget("cuda", 90, 32), options=options
    )
    return compiled.metadata.shared


def main(dim: int) -> None:
    bt = gdr_chunk.chunk_size(False, dim)
    state_bv = 32 if dim <= 128 else 16  # gdr_recurrent.block_v
    bwd_bv = gdr_chunk.BWD_BLOCK_V if dim <= 128 else 32
    base = dict(GROUP=1, BT=bt, BK=dim, VARLEN=False, DOT=2)
    jobs = [
        ("wy_kernel", gdr_chunk.wy_kernel, base, 8),
        (
            "states_kernel",
            gdr_chunk.states_kernel,
            dict(base, BV=state_bv, HAS_H0=True, STORE_HT=True),
            4,
        ),
        ("output_kernel", gdr_chunk.output_kernel, dict(base, BVA=min(dim, 64)), 8),
        ("dstates_kernel", gdr_chunk.dstates_kernel, dict(base, BV=state_bv, HAS_DHT=True), 4),
        ("bwd_chunk_kernel", gdr_chunk.bwd_chunk_kernel, dict(base, BVA=min(dim, bwd_bv)), 8),
    ]
    for name, kernel, consts, warps in jobs:
        print(
            f"K=V={dim} chunk {bt} {name}: {shared_bytes(kernel, consts, warps)} bytes", flush=True
        )


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 128)
