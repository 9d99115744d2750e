"""Shared memory, registers and spill stack of the gated delta rule chunk kernels, compiled
offline for sm_90 (no GPU needed: Triton's wheel ships ptxas and cuobjdump), per kernel with the
launcher's settings (stages, warps, value blocks), for checking NOTES.md's figures.

    python tools/gdr_shared_memory.py 128                 # K = V = 128 (chunk 64), IEEE, fp32
    python tools/gdr_shared_memory.py 256 split3 bf16     # K = V = 256 (chunk 32), split3, bf16

The second argument is the products' mode (ieee | split3 | tf32 | bf16: FUSETUNE_GDR_DOT; bf16
compiles with tf32's launch settings, as the launcher runs it), the third the
dtype of the inputs q, k, v, beta and dO (fp32 | bf16 | fp16; the 16-bit ones take 16-bit
tensor-core products in split3 mode), or l2norm: bf16 with the kernels normalising q and k rows
(L2NORM), as the models call it (use_qk_l2norm_in_kernel). A fourth argument
``hints`` compiles as a launch at such shapes does: every pointer and integer argument marked
divisible by 16 (Triton 3.6's LLVM aborted on GSA's recurrent kernels only with these hints).
W and the sequential kernels' products follow the launcher's rule (``gdr_chunk.sequential_bf16``:
bf16 in tf32 mode with bf16 inputs); FUSETUNE_GDR_W=fp32 compiles them as before (fp32 W, tf32),
FUSETUNE_GDR_W=w with bf16 W and bf16 products only where W is an operand, FUSETUNE_GDR_W=d
with the writes D (d_buf) in bf16 too. GDR_ONLY=name,name compiles only those kernels.

    PYTHONPATH=/tmp/t36:src python tools/gdr_shared_memory.py 128 tf32 l2norm hints  # default
    PYTHONPATH=/tmp/t36:src python tools/gdr_shared_memory.py 128 bf16 l2norm hints

Takes minutes on a CPU (the IEEE-product kernels compile slowly). H100 limit: 232448 bytes.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("FUSETUNE_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from fusetune.ops.linear_attention import gdr_chunk  # noqa: E402

FLOATS = ("scale",)
INPUTS = ("q", "k", "v", "beta", "do", "o", "dv")  # pointers in the input dtype
DOTS = gdr_chunk.DOT_MODES
INTS = ("T", "HV", "K", "V", "C0", "C1")  # every other non-constexpr argument is a pointer
ARCH = int(os.environ.get("GDR_ARCH", "90"))  # GDR_ARCH=80: an A100 (its limit 166912 bytes)
# Warps of states / dstates: the launcher's by default (states 4, 8 where its programs are
# fewer than the SMs; dstates 8); GDR_SEQ_WARPS=N sets both.
SEQ_WARPS = os.environ.get("GDR_SEQ_WARPS")
BWD_WARPS = int(os.environ.get("GDR_BWD_WARPS", "8"))  # bwd_chunk (the launcher's 8)
# GDR_ONLY=name,name: only those kernels (the names printed, e.g. bwd_chunk_kernel)
ONLY = [name for name in os.environ.get("GDR_ONLY", "").split(",") if name]


def input_dtype(dtype: str) -> torch.dtype:
    return {"fp32": torch.float32, "fp16": torch.float16}.get(dtype, torch.bfloat16)


def seq_bf16(dtype: str, dot: int) -> int:
    return gdr_chunk.sequential_bf16(input_dtype(dtype), dot)


def compile_kernel(
    kernel, consts: dict, num_warps: int, dtype: str, hints: bool = False, num_stages: int = 1
):
    signature, constexprs, attrs = {}, {}, {}
    for index, name in enumerate(kernel.arg_names):
        if hints and name not in consts and name not in FLOATS:
            attrs[(index,)] = [["tt.divisibility", 16]]
        if name in consts:
            signature[name], constexprs[name] = "constexpr", consts[name]
        elif name in FLOATS:
            signature[name] = "fp32"
        elif name in INTS or name.startswith("s"):
            signature[name] = "i32"
        elif name in INPUTS:
            signature[name] = "*" + dtype.replace("l2norm", "bf16")
        elif name in ("h_buf", "dh_buf"):  # the launcher's state_dtype (GDR_STATES=fp32: not)
            bf16 = gdr_chunk.state_dtype(input_dtype(dtype), consts["DOT"]) == torch.bfloat16
            keep = os.environ.get("GDR_STATES") == "fp32"
            signature[name] = "*bf16" if bf16 and not keep else "*fp32"
        elif name == "w_buf":  # the launcher's (FUSETUNE_GDR_W=fp32: fp32)
            bf16 = gdr_chunk.w_dtype(seq_bf16(dtype, consts["DOT"])) == torch.bfloat16
            signature[name] = "*bf16" if bf16 else "*fp32"
        elif name == "d_buf":  # the launcher's (FUSETUNE_GDR_W=d: bf16)
            bf16 = gdr_chunk.d_dtype(seq_bf16(dtype, consts["DOT"])) == torch.bfloat16
            signature[name] = "*bf16" if bf16 else "*fp32"
        else:
            signature[name] = "*fp32"
    options = dict(num_warps=num_warps, num_stages=num_stages)
    compiled = triton.compile(
        ASTSource(kernel, signature, constexprs, attrs),
        target=GPUTarget("cuda", ARCH, 32),
        options=options,
    )
    return compiled


def resources(compiled) -> str:
    """Shared memory, registers a thread and spill stack of a compiled kernel (cuobjdump from
    Triton's wheel reads the cubin's resource usage), and its SASS: instructions, barriers,
    shuffles and tensor-core instructions (for a latency-bound loop, fewer of the first three
    is a shorter chunk step: 2026-11-27, the sequential kernels' factors moved to wy_kernel)."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        usage, sass = (
            subprocess.run([tool, flag, cubin.name], capture_output=True, text=True).stdout
            for flag in ("--dump-resource-usage", "-sass")
        )
    regs, stack = (re.search(rf"{key}:(\d+)", usage) for key in ("REG", "STACK"))
    code = [line for line in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4,}\*/", line)]
    counts = ", ".join(
        f"{name} {sum(1 for line in code if re.search(pattern, line))}"
        for name, pattern in (("BAR", r"\bBAR\."), ("SHFL", r"\bSHFL\."), ("MMA", r"MMA"))
    )
    digest = hashlib.sha1("\n".join(code).encode()).hexdigest()[:12]  # (same code, same hash)
    return (
        f"{compiled.metadata.shared} bytes shared, {regs.group(1) if regs else '?'} registers, "
        f"stack {stack.group(1) if stack else '?'}; SASS {len(code)} instructions, {counts}, "
        f"sha1 {digest}"
    )


def main(dim: int, mode: str, dtype: str, hints: bool = False) -> None:
    bt = gdr_chunk.chunk_size(False, dim)
    state_bv = 32 if dim <= 128 else 16  # gdr_recurrent.block_v
    bwd_bv = gdr_chunk.bwd_block_v(dim, dim, DOTS[mode])
    base = dict(GROUP=1, BT=bt, BK=dim, VARLEN=False, DOT=DOTS[mode], L2NORM=dtype == "l2norm")
    tf32 = gdr_chunk.tf32_buffers(DOTS[mode])  # (tf32 and bf16 products)
    per_chunk = 4 if tf32 else 8  # the launcher's warps for wy and output
    sequential = seq_bf16(dtype, DOTS[mode])  # bf16 W and products (FUSETUNE_GDR_W)
    inverse = {n: base[n] for n in ("GROUP", "BT", "VARLEN", "DOT", "L2NORM")}
    wy = dict(inverse, BKW=min(dim, 64), BV=min(dim, 64))
    jobs = [
        ("inverse_kernel", gdr_chunk.inverse_kernel, inverse, 1),
        ("wy_kernel", gdr_chunk.wy_kernel, dict(wy, LOCAL_DD=False), per_chunk),
        ("wy_kernel (backward)", gdr_chunk.wy_kernel, dict(wy, LOCAL_DD=True), per_chunk),
        (
            "states_kernel",
            gdr_chunk.states_kernel,
            dict(base, BV=state_bv, HAS_H0=True, STORE_HT=True, SEQ_BF16=sequential),
            int(SEQ_WARPS or 4),
        ),
        ("output_kernel", gdr_chunk.output_kernel, dict(base, BVA=min(dim, 64)), per_chunk),
        (
            "dstates_kernel",
            gdr_chunk.dstates_kernel,
            dict(base, BV=state_bv, HAS_DHT=True, SEQ_BF16=sequential),
            int(SEQ_WARPS or 8),
        ),
        ("bwd_pairs_kernel", gdr_chunk.bwd_pairs_kernel, dict(base, BVA=bwd_bv), per_chunk),
        ("bwd_chunk_kernel", gdr_chunk.bwd_chunk_kernel, dict(base, BVA=bwd_bv), BWD_WARPS),
    ]
    if gdr_chunk.walks_in_key_blocks(dim, sequential):  # the launcher's walks there (4 warps)
        walks = dict(base, BV=state_bv)
        jobs += [
            ("states_k64_kernel", gdr_chunk.states_k64_kernel,
             dict(walks, HAS_H0=True, STORE_HT=True), int(SEQ_WARPS or 4)),
            ("dstates_k64_kernel", gdr_chunk.dstates_k64_kernel, dict(walks, HAS_DHT=True),
             int(SEQ_WARPS or 4)),
        ]  # fmt: skip
    # the launcher's stages (_ChunkRun): 2 for the sequential kernels with bf16 products, 3 for
    # the key-block walks (states_k64 only where its programs leave SMs idle: 2 elsewhere), 2
    # for bwd_pairs and 3 for bwd_chunk with tf32 products, else 1
    walk, pairs, chunk = (2 if sequential else 1), (2 if tf32 else 1), (3 if tf32 else 1)
    stages_of = {"states_kernel": walk, "dstates_kernel": walk, "states_k64_kernel": 3,
                 "dstates_k64_kernel": 3, "bwd_pairs_kernel": pairs,
                 "bwd_chunk_kernel": chunk}  # fmt: skip
    for name, kernel, consts, warps in jobs:
        if ONLY and name.split()[0] not in ONLY:
            continue
        stages = stages_of.get(name, 1)
        compiled = compile_kernel(kernel, consts, warps, dtype, hints, stages)
        print(
            f"K=V={dim} chunk {bt} {mode} {dtype} {name} ({warps} warps, {stages} stages): "
            f"{resources(compiled)}",
            flush=True,
        )


if __name__ == "__main__":
    args = sys.argv[1:] + ["128", "ieee", "fp32"][len(sys.argv) - 1 :]
    main(int(args[0]), args[1], args[2], "hints" in args[3:])
