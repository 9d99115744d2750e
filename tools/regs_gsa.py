"""Registers and spills of the chunked GSA kernels on sm_90, compiled on the CPU (no GPU).

    PYTHONPATH=src python tools/regs_gsa.py [bf16|fp16|fp32] [varlen] [flags] [warps=N]
        [dims=K,V,M] [recurrent] [hints]

Compiles every kernel of ``fusetune.ops.linear_attention.gsa_chunk`` at the benchmark's constants
(K = V = M = 64) with the library's warps, then prints ptxas's register count and spill bytes
per kernel (the cubin's resource usage, through the cuobjdump bundled with Triton) and the shared
memory a block takes (``metadata.shared``; H100 limit 232448 bytes). ``dims`` sets the head
sizes (BK, BV, BM) in place of 64; FUSETUNE_GSA_DOT picks the products' precision as it does for
the library. A proxy for
occupancy: 255 registers or any spill is a red flag; the GPU timings (tools/tune_gsa.py) decide.
With ``flags`` every optional path is compiled (initial and final states, final-state gradients,
the exact pass of bwd_b): a compile check of code the benchmark never runs. ``recurrent``
compiles the recurrent mode's three kernels instead. ``hints`` marks every pointer and integer
argument divisible by 16, as a launch at such shapes does (Triton 3.6's LLVM aborted compiling
the recurrent forward at K = V = 256 only with these hints).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from fusetune.ops.linear_attention import gsa_chunk as chunk
from fusetune.ops.linear_attention import gsa_recurrent as recurrent

# Pointer arguments that are fp32 buffers (everything else is an input-dtype tensor).
FP32_POINTERS = {
    "gc",
    "hk_buf",
    "hv_buf",
    "hkT",
    "hvT",
    "dhkT",
    "dhvT",
    "f_buf",
    "p_buf",
    "da_buf",
    "r_buf",
    "dhk_buf",
    "dhv_buf",
    "dhk0",
    "dhv0",
    "dgl_buf",
    "tot_buf",
    "x_buf",
}
INT_POINTERS = {"cu", "steep_buf"}
SIZES = dict(
    BK=64,
    BD=64,
    BV=64,
    BM=64,
    BMS=chunk.SLOT_BLOCK,
    BT=chunk.SUB_CHUNK,
    S=chunk.STATE_CHUNK,
    GROUP=1,
    UPCAST=False,
)


def signature(fn, dtype: str, flags: dict) -> tuple[dict, dict]:
    sig, constexprs = {}, {}
    for param in fn.params:
        name = param.name
        if param.is_constexpr:
            sig[name] = "constexpr"
            constexprs[name] = flags.get(name, SIZES.get(name, False))
        elif name in INT_POINTERS:
            sig[name] = "*i32"
        elif name in FP32_POINTERS:
            sig[name] = "*fp32"
        elif name == "scale":
            sig[name] = "fp32"
        elif name in (
            "q",
            "k",
            "v",
            "s",
            "g",
            "do",
            "o",
            "dq",
            "dk",
            "dv",
            "ds",
            "dg",
            "hk0",
            "hv0",
        ):
            sig[name] = f"*{dtype}"
        else:
            sig[name] = "i32"
    return sig, constexprs


def report(name: str, fn, dtype: str, flags: dict, warps: int, hints: bool = False) -> str:
    sig, constexprs = signature(fn, dtype, flags)
    attrs = {}
    if hints:
        divisible = [["tt.divisibility", 16]]
        skipped = ("constexpr", "fp32")
        attrs = {(i,): divisible for i, t in enumerate(sig.values()) if t not in skipped}
    src = ASTSource(fn, sig, constexprs, attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        out = subprocess.run(
            [os.path.join(bin_dir, "cuobjdump"), "--dump-resource-usage", f.name],
            capture_output=True,
            text=True,
        ).stdout
    regs = re.search(r"REG:(\d+)", out)
    stack = re.search(r"STACK:(\d+)", out)
    return (
        f"{name:10s} {warps} warps  regs {regs.group(1) if regs else '?':>3s}  "
        f"stack {stack.group(1) if stack else '?'} B  shared {compiled.metadata.shared} B"
    )


def main() -> None:
    dtype = sys.argv[1] if len(sys.argv) > 1 else "bf16"
    dot = {"bf16": 0, "fp16": 1, "fp32": 2}[dtype]
    flags = dict(DOT=dot, VARLEN="varlen" in sys.argv[2:])
    if "flags" in sys.argv[2:]:
        flags.update(HAS_H0=True, STORE_HT=True, HAS_DHT=True, EXACT=True)
    warps = [int(a[6:]) for a in sys.argv[2:] if a.startswith("warps=")]
    for arg in sys.argv[2:]:
        if arg.startswith("dims="):
            sizes = [max(16, triton.next_power_of_2(int(x))) for x in arg[5:].split(",")]
            SIZES.update(BK=sizes[0], BV=sizes[1], BM=sizes[2])
    kernels, default_warps = chunk.KERNELS, chunk.NUM_WARPS
    if "recurrent" in sys.argv[2:]:
        kernels = {n: getattr(recurrent, f"{n}_kernel") for n in ("fwd", "bwd_a", "bwd_b")}
        default_warps = dict.fromkeys(kernels, recurrent.constants(SIZES)["num_warps"])
    for name, fn in kernels.items():
        n_warps = warps[0] if warps else default_warps.get(name, 4)
        print(report(name, fn, dtype, flags, n_warps, "hints" in sys.argv[2:]), flush=True)


if __name__ == "__main__":
    main()
