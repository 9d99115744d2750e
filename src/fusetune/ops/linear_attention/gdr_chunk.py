"""Chunked gated delta rule (the WY / UT-transform form of the GDN paper), fp32 inside.

Per sequence and value head, a chunk of BT tokens with start state S0, chunk-local cumulative
log decays G_t = g_1 + ... + g_t, and Gamma_ts = exp(G_t - G_s) for t >= s:
    A_ts = beta_t Gamma_ts (k_t . k_s) for t > s (strictly lower), T = (I + A)^-1
    W = T (beta exp(G) K),  U = T (beta V)           # delta_t = U_t - W_t S0 (the writes)
    D = U - W S0
    O = scale [(exp(G) Q) S0 + ((Q K^T) * Gamma, t >= s) D]
    S_end = exp(G_last) S0 + (exp(G_last - G) K)^T D
Forward, four launches: ``inverse_kernel`` (per chunk, in parallel: A and T, in 16 x 16
blocks at one warp), ``wy_kernel`` (per chunk: W and U from T, kept, and the per-token factors
the sequential kernels scale by, so that their chunk steps hold only the state's products),
``states_kernel`` (per sequence, value head and block of value columns, sequential over
chunks: every chunk's S0 and D from W and U, the final state), ``output_kernel`` (per chunk and
block of value columns: O); where the walk leaves half the SMs idle, in two parts of the chunks,
each part's walk beside the next part's inverse and wy (``forward_parts``). Backward: below.
The sequential kernels carry the state in fp32; the per-chunk copies of S0 and dS they store
for the parallel kernels are bf16 for bf16 inputs (``state_dtype``), fp32 otherwise. For bf16
inputs W is stored in bf16 too and the sequential kernels' products are bf16 ones, each fp32
operand rounded to bf16 for its product alone (``sequential_bf16``).
Products are fp32-exact (``mm``, ``DOT``): tensor cores (3, the default,
``FUSETUNE_GDR_DOT=split3``: input tiles enter in their own dtype, fp32 operands as two tf32
halves) or IEEE FMA (2, ``ieee``); for bf16 inputs tf32 (4), and opt-in bf16 (5,
``FUSETUNE_GDR_DOT=bf16``: fp32 operands rounded to bf16, FLA's precision; ``dot_mode``).
Where an input meets a per-token factor, the factor moves onto the other operand
(W = (T diag(beta e^G)) K, U = (T diag(beta)) V, (e^G Q) S0 = diag(e^G) (Q S0)) so that the
input stays a 16-bit tile. exp arguments are <= 0. The models' l2norm of q and k (L2NORM) is
such a factor too: each kernel takes 1 / ||q_t||, 1 / ||k_t|| from the rows it loads
(``inv_norms``) and folds them in (Q_n K_n^T = diag(rq) (Q K^T) diag(rk), ...), and the
backward takes dq, dk back through the normalisation at the end (``_l2norm_grad``).
"""

from __future__ import annotations

import itertools
import os

import torch

from fusetune._triton import INTERPRET, tl, triton
from fusetune._utils import cdiv, next_power_of_2, num_programs_in_flight
from fusetune.ops.linear_attention._common import chunk_slot, gate_sums, sequence_bounds

UPCAST_BF16 = tl.constexpr(INTERPRET)  # the interpreter's bf16 tl.dot is wrong
# The interpreter's tf32 tl.dot is full fp32: it drops the operands' 13 low mantissa bits itself,
# as the tensor cores ignore them, so that the CPU tests see tf32 mode's rounding.
EMULATE_TF32 = tl.constexpr(INTERPRET)
# The interpreter's fp32 -> bf16 conversion truncates; the GPU's rounds to nearest (see to_bf16).
ROUND_BF16 = tl.constexpr(INTERPRET)
INTERPRET_CHUNK = 16  # tests raise it to run the blocked inverse
BWD_BLOCK_V = 64  # value columns a step of the backward kernels' loops (tests lower it)
# SHARED MEMORY (H100: 232448 bytes a block). Triton stages every tl.dot operand through shared
# memory (fp32 for IEEE products: a [64, 128] tile is 32 KB) and, with num_stages > 1, keeps
# num_stages copies of the loads inside loops. At K = V = 128, chunk 64, num_stages 3 (Triton's
# default) states_kernel took 182 KB, dstates_kernel 280 KB and bwd_chunk_kernel 311 KB (the
# GPU's failure: "Required: 280064"). The launcher sets num_stages=1 for every kernel but the
# sequential ones with bf16 products, whose W tile is half the size: they run at 2 (prefetching
# the next chunk's loads, which do not wait on the state; _ChunkRun's comment has the times),
# and the backward's per-chunk kernels with tf32 products: bwd_pairs at 2, bwd_chunk at 3.
# Measured by compiling for sm_90 offline (Triton 3.9, ``triton.compile`` with
# GPUTarget("cuda", 90, 32), metadata.shared; bytes, num_stages=1), before the split modes:
#   K = V = 128, BT 64:  wy 32768 (8 warps), states 65536 (BV 64; the launcher uses 32),
#                        output 114688 (BVA 64), dstates 147456 (BV 64), bwd_chunk 164096 (BVA 64)
#   K = V = 256, BT 64:  output 212992, dstates 237568, bwd_chunk 295168: too close or over,
#                        hence chunk 32 for K > 128 (chunk_size) with BVA 32:
#   K = V = 256, BT 32:  output 139264, dstates 110592 (BV 32), bwd_chunk 139392 (BVA 32)
# After the split3 rewrite (``python tools/gdr_shared_memory.py K MODE DTYPE``, the launcher's
# blocks: states / dstates BV 32 at K 128, 16 at K 256; bwd_chunk BVA from bwd_block_v;
# l2norm = bf16 inputs with fp32 q, k):
#   K = V = 128, BT 64      wy      states  output  dstates  bwd_chunk
#     ieee fp32             32768   90112   114688  106752   147456 (BVA 64)
#     split3 fp32           98304   98304   65536   114688   196608 (BVA 32)
#     split3 bf16 / fp16    98304   65536   65536   114688   163840 (BVA 32; 229376 at 64)
#     split3 l2norm (bf16 q, k normalised in the kernels; Triton 3.6 with the launch's hints)
#                           98304   49152   65536   98304    163840 (fp32 q, k before: 98304,
#                                                   98304, 65536, 114688, 196608)
#     tf32 l2norm (bf16's default since the session of 2026-11-27; one tf32 product per
#     fp32 operand pairing)
#                           49152   65536   98304   114688   229376 (BVA 32)
#     bwd_chunk after dA's sum became dD D^T (2026-11-27; Triton 3.6, hints; spill stack a
#     thread at 8 warps): tf32 212992 (4224 -> 3632 B), split3 fp16 180224 (163840 before;
#     3824 -> 3000 B), split3 fp32 196608 (4888 -> 3832 B); sm_80 (GDR_ARCH=80): tf32 131072,
#     split3 fp16 81920
#     bf16 W and bf16 products in states / dstates (``sequential_bf16`` 2; Triton 3.9, hints,
#     tf32 l2norm; bytes, spill stack a thread; states 4 warps, dstates 8): states 57344, 24 B
#     -> 32768, 0 B; dstates 40960, 552 B -> 28672, 0 B; wy (backward) 98304, spill 208 -> 96
#     B; the others unchanged. K = V = 256: states 34816, 104 B -> 18432, 0 B; dstates 34816,
#     216 B -> 18432, 0 B. sm_80, K = V = 128: states 40960 -> 24576, dstates 32768 -> 20480
#   K = V = 256, BT 32
#     ieee fp32             32768   71680   139264  75904    102528
#     split3 fp32 / l2norm  65536   34816   65536   81920    98304
#     split3 bf16           20480   32768   81920   69632    65536


def chunk_size(interpreting: bool, key_dim: int = 128) -> int:
    """64 on the GPU up to K = 128, 32 above (the [BT, K] fp32 tiles in shared memory: see
    SHARED MEMORY below); ``FUSETUNE_GDR_CHUNK=16|32|64`` overrides it, for measuring. 16 under
    the interpreter, so that the tests' short sequences cross several chunks."""
    if interpreting:
        return INTERPRET_CHUNK
    size = int(os.environ.get("FUSETUNE_GDR_CHUNK", "64" if key_dim <= 128 else "32"))
    if size not in (16, 32, 64):
        raise ValueError(f"FUSETUNE_GDR_CHUNK must be 16, 32 or 64, got {size}")
    return size


def min_block(dot: int) -> int:
    """The smallest tile side: 16 for IEEE products, 32 on tensor cores. Triton 3.6 on Hopper
    compiles tf32 and bf16 tl.dot on 16-wide fp32 tiles in bwd_chunk_kernel to out-of-range
    shared-memory reads (compute-sanitizer: "Out-of-range shared or local address" at dot3's
    first product; K = 12 padded to 16; with mma.sync instead of wgmma no fault). Tiles of 32
    were exact (1e-7 of IEEE in every kernel, K = 32, V = 40). Only tiny heads pay: the models'
    are 128."""
    return 16 if dot == 2 else 32


def bwd_block_v(key_dim: int, value_dim: int, dot: int) -> int:
    """Value columns a step of bwd_pairs_kernel's and bwd_chunk_kernel's loops: 64
    (BWD_BLOCK_V) up to K = 128 with IEEE products, 32 above and in split3 mode (the one
    backward kernel's split operands and 16-bit tiles took 229376 of the 232448 bytes at K = V
    = 128, bf16, 64 columns; 163840 at 32: see SHARED MEMORY)."""
    cap = BWD_BLOCK_V if key_dim <= 128 and dot == 2 else min(BWD_BLOCK_V, 32)
    return max(min(max(16, next_power_of_2(value_dim)), cap), min_block(dot))


def output_block(value_block: int) -> int:
    """Value columns an output_kernel program takes, of the launcher's padded ``value_block``:
    at most 64, so that its S0 slice stays [K, 64] (98304 bytes of shared memory at K = 128:
    two blocks an SM). Each program of a chunk forms Q K^T and the decays again. A function
    the launcher looks up at every call, so that tools/gdr_launch_sweep.py can time others."""
    return min(value_block, 64)


DOT_MODES = {"ieee": 2, "split3": 3, "tf32": 4, "bf16": 5}


def tf32_buffers(dot: int) -> bool:
    """Whether mode ``dot`` takes tf32 mode's buffers and launch settings (bf16 S0 / dS copies,
    bf16 W and sequential products, the launcher's warps and stages): tf32 and bf16 products,
    whose fp32 operands are rounded either way (bf16 mode rounds further: ``dot_mode``)."""
    return dot in (DOT_MODES["tf32"], DOT_MODES["bf16"])


# bwd_chunk_kernel's shared memory with tf32 products at K = V = 128, compiled offline (Triton
# 3.6): 212992 bytes on sm_90 (wgmma; the H100 and H200 hold 232448 a block) and 131072 on sm_80
# (mma.sync; the A100 holds 166912). GPUs with less (consumer parts: about 101376) keep split3,
# which takes 81920 there.
TF32_SHARED_MEMORY = 131072


def dot_mode(dtype: torch.dtype, shared_memory: int | None = None) -> int:
    """The products' precision for inputs of ``dtype`` (q's) on a GPU whose blocks may take
    ``shared_memory`` bytes (None: no limit, the interpreter): tensor cores throughout, with
    fp32 operands at about fp32's accuracy through ``mm``'s splits for fp32 and fp16 inputs
    (3: split3; fp32 operands as two tf32 halves, 16-bit inputs as they are) and rounded once
    to tf32 for bf16 inputs (4: tf32) where the GPU holds its tiles, as GSA does: tf32's
    rounding (2^-11) is 4x finer than bf16's own (2^-8), while fp16's 11-bit mantissa is finer
    than tf32's (tf32 there cost GSA 1.5e-2 on dg). The gate sums and dg's span sums take no
    product in any mode (``_decays``' double-fp32 cumsum, fp32 scans): exp and dg's
    cancellations amplify rounding.
    ``FUSETUNE_GDR_DOT=ieee|split3|tf32|bf16`` forces one mode for every dtype (ieee: IEEE fp32
    FMA, 12x slower at Qwen3.5's sizes, kept as the second oracle; bf16 (5), an opt-in trade of
    exactness for speed: tf32's buffers and launch settings, but each per-chunk product's fp32
    operand rounded to bf16 in registers, one bf16 tensor-core product with fp32 accumulation,
    FLA's precision; (I + A)^-1 is IEEE fp32 in every mode, ``inverse_kernel``; see ``mm``).
    Triton's own
    input_precision="tf32x3" is not used: under Triton 3.6 it faulted on small shapes (see
    min_block), and a bf16x6 mode faulted at K = 128."""
    mode = os.environ.get("FUSETUNE_GDR_DOT", "auto")
    if mode == "auto":
        holds_tf32 = shared_memory is None or shared_memory >= TF32_SHARED_MEMORY
        mode = "tf32" if dtype == torch.bfloat16 and holds_tf32 else "split3"
    if mode not in DOT_MODES:
        raise ValueError(
            f"FUSETUNE_GDR_DOT must be 'auto' or one of {tuple(DOT_MODES)}, got {mode!r}"
        )
    return DOT_MODES[mode]


def state_dtype(dtype: torch.dtype, dot: int, gradient: bool = False) -> torch.dtype:
    """The dtype the chunked kernels store each chunk's start state S0 (``gradient``: the state
    gradient dS) in for inputs of ``dtype`` with products of mode ``dot``: bf16 for bf16 inputs
    in tf32 mode, else fp32 (one rule for both; the argument lets tools time them apart). A
    bf16 copy is rounded once (2^-9) from the fp32 state the sequential kernels carry, and is
    exact in the products it feeds: with a bf16 input tile (Q S0, dO S0^T) a bf16
    tensor-core product, with an fp32 tile tf32's (bf16's 8 mantissa bits fit tf32's 10).
    Half the memory and traffic of the largest buffers (B4 T4096 H16 D128: 256 MiB each)."""
    bf16 = dtype == torch.bfloat16 and tf32_buffers(dot)
    return torch.bfloat16 if bf16 else torch.float32


W_MODES = {"fp32": 0, "w": 1, "auto": 2, "d": 3}


def sequential_bf16(dtype: torch.dtype, dot: int) -> int:
    """How far the sequential kernels (states_kernel, dstates_kernel: their SEQ_BF16) go in
    bf16 for inputs of ``dtype`` with products of mode ``dot``; W = T (beta e^G K) is stored
    in bf16 (``w_dtype``) from 1 up. 2 for bf16 inputs in tf32 mode: every product of those two
    kernels is one bf16 tensor-core product, its fp32 operand (the state, dS, D, dD, e^G dO)
    rounded to bf16 in registers for that product alone, while the state itself stays fp32 and
    accumulates in fp32 (as FLA's state kernels do). Against tf32 on fp32 operands, the operand
    tiles are half the bytes through shared memory and the products run at twice the rate
    (offline, sm_90, K = V = 128: no spill left in either kernel); each operand rounding is
    bf16's to nearest (2^-8 relative) instead of tf32's truncation (2^-10), the rounding bf16
    inputs already carry. Measured against float64 (interpreter): the final state's error
    grows about 4x (4e-4 -> 1.8e-3), o's and the gradients' by at most 1.6x (dbeta), all within
    bf16's 1e-2. 0 otherwise (fp16 and fp32 inputs keep fp32 W and split products).
    ``FUSETUNE_GDR_W`` (read at every call, for timing them in one process): ``fp32`` = 0,
    fp32 W and tf32 products as before; ``w`` = 1, bf16 W and bf16 products with W only
    (W S0, W^T dD), the products with q and k tf32 as before; ``auto`` the default; ``d`` = 3,
    level 2 with the writes D stored in bf16 too (``d_dtype``: beside the fp32 U that wy_kernel
    writes, where level 2 turns U into D in place), so that the per-chunk kernels' dO D^T and D
    dS^T are one bf16 product and D's reads half the bytes (an opt-in precision trade; with
    FUSETUNE_GDR_DOT=bf16, whose products round D to bf16 anyway, it adds no error)."""
    mode = os.environ.get("FUSETUNE_GDR_W", "auto")
    if mode not in W_MODES:
        raise ValueError(f"FUSETUNE_GDR_W must be one of {tuple(W_MODES)}, got {mode!r}")
    if dtype != torch.bfloat16 or not tf32_buffers(dot):
        return 0
    return W_MODES[mode]


_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The CUDA stream the sequential kernels run on beside the others (one a device)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SIDE_STREAMS:
        _SIDE_STREAMS[index] = torch.cuda.Stream(device=index)
    return _SIDE_STREAMS[index]


def forward_parts(device: torch.device, programs: int, chunks: int) -> list[tuple[int, int]]:
    """The chunk ranges [c0, c1) the forward goes by, in order. Where states_kernel's
    ``programs`` leave half the SMs or more idle (B1 T32768 H16 V128: 64 on an H200's 132), its
    walk over part p runs on ``side_stream`` beside inverse and wy over part p + 1 and the
    output over part p - 1; else one part, the forward as before. ``FUSETUNE_GDR_FWD_PARTS``
    (read at every call): ``auto`` (2 parts there) or a number. On the GPU a part is a
    multiple of 16 chunks, so that the kernels' chunk offsets keep one specialisation.
    H200, B1 T32768 H16 D128 bf16, fwd (fwd+bwd) ms in one run: 1 part 2.61 (8.35), 2 parts
    2.18 (7.88), 4 parts 2.34 (7.95), 8 parts 3.53 (9.79); in another 1 part 2.56 (8.45), 2
    parts 2.31 (8.00), 4 parts 2.01 (7.92) (docs/bench/session-2026-12-02-twentyseventh). Many
    parts lose: each part's walk starts after its wy, whose blocks by then hold the SMs the
    walk's blocks wait for."""
    mode = os.environ.get("FUSETUNE_GDR_FWD_PARTS", "auto")
    if mode == "auto":
        wanted = 2 if 2 * programs <= num_programs_in_flight(device) else 1
    elif mode.isdigit() and int(mode) >= 1:
        wanted = int(mode)
    else:
        raise ValueError(
            f"FUSETUNE_GDR_FWD_PARTS must be 'auto' or a positive number, got {mode!r}"
        )
    unit = 16 if device.type == "cuda" else 1
    count = max(1, min(wanted, chunks // unit))  # (fewer where the chunks are too few)
    step = unit * cdiv(chunks, unit * count)
    return list(itertools.pairwise([*range(0, chunks, step), chunks]))


def walks_in_key_blocks(key_dim: int, seq_bf16: int) -> bool:
    """Whether the walks take FLA's shape (states_k64_kernel, dstates_k64_kernel: the state as
    two [64, BV] key blocks, each product untransposed into it) rather than states_kernel and
    dstates_kernel's transposed products: where every walk product is bf16 (``seq_bf16`` 2)
    and 64 < K <= 128. ``FUSETUNE_GDR_WALK`` (read at every call): ``auto`` (that) or
    ``transposed``. H200, GPU ms per kernel (4 warps against the launcher's): B4 T4096 H16 D128
    bf16 states 0.436 -> 0.343 and 0.439 -> 0.347, dstates 0.351 -> 0.312 and 0.358 -> 0.309
    in two runs; at B1 T32768, where the forward's walks share the GPU, states 2.168 -> 1.979
    and 2.195 -> 2.323, dstates 1.360 -> 1.181 and 1.385 -> 1.341
    (docs/bench/session-2026-12-02-twentyeighth/call-04, -05). At BV 32 their bf16 products
    take [64, 32] B operands, the tile of the 2026-11-27 H100 faults (above ``mm_state``).
    The H200 shows that fault class: main with mm_state's products untransposed faulted or
    gave wrong results in 2 of 14 fault-probe cases there (an illegal address in
    dstates_kernel, dk = inf); these walks ran clean in 35 cases at B4 T4096, B1 T32768 and
    B2 T700 (docs/bench/session-2026-12-02-twentyninth/call-02, twentyeighth/call-06). Not
    probed on an H100 (none lent since); ``transposed`` is the way back if one faults."""
    walk = os.environ.get("FUSETUNE_GDR_WALK", "auto")
    if walk not in ("auto", "transposed"):
        raise ValueError(f"FUSETUNE_GDR_WALK must be 'auto' or 'transposed', got {walk!r}")
    return walk == "auto" and seq_bf16 >= 2 and 64 < key_dim <= 128


def backward_side_stream(device: torch.device, programs: int) -> torch.cuda.Stream | None:
    """The CUDA stream the backward's states recompute runs on beside dstates_kernel, or None
    (one stream, one after the other): ``FUSETUNE_GDR_BWD_SEQ`` (read at every call) ``beside``
    / ``apart``, or ``auto`` (the default): beside where the two launches' ``programs`` fit the
    SMs at once (B1 T32768 H16 V128: 64 + 64 for 132 on an H100, where each alone leaves half
    the GPU idle); apart off CUDA."""
    mode = os.environ.get("FUSETUNE_GDR_BWD_SEQ", "auto")
    if mode not in ("auto", "beside", "apart"):
        raise ValueError(
            f"FUSETUNE_GDR_BWD_SEQ must be 'auto', 'beside' or 'apart', got {mode!r}"
        )
    if device.type != "cuda" or mode == "apart":
        return None
    if mode == "auto" and programs > num_programs_in_flight(device):
        return None
    return side_stream(device)


def w_dtype(level: int) -> torch.dtype:
    """w_buf's dtype for a ``sequential_bf16`` level: bf16 from 1 up."""
    return torch.bfloat16 if level >= 1 else torch.float32


def d_dtype(level: int) -> torch.dtype:
    """The writes D's dtype (d_buf) for a ``sequential_bf16`` level: bf16 from 3 (W=d) up."""
    return torch.bfloat16 if level >= 3 else torch.float32


# The bf16 products' H100 faults (2026-11-27, Triton 3.6, never on a CPU: illegal address in
# dstates_kernel, garbage o / dh0): each bf16 product staged its narrow operand (the state / dS /
# D / dD / e^G dO block, BV = 32 columns) as a [K, 32] bf16 tile with 64-byte rows, 64-byte
# swizzle, for wgmma (compute-sanitizer: an out-of-range shared address in dstates_kernel). So
# ``mm_state`` computes each bf16 product transposed, C^T = B^T A^T: the 32-wide block is the M
# side, below wgmma's M = 64, and Triton takes mma.sync (no swizzled wgmma operand tile). Of the
# three work-arounds tried on the H100 (tools/gdr_fault_probe.py: BV 64; the operand padded with
# zero columns to 64; transposed), each was clean at B4 T4096, B1 T32768 and B2 T700 with strong
# decays, 5 repeats; transposed passed the GDR GPU tests and took 6.77 / 17.17 ms fwd+bwd (B4
# T4096 / B1 T32768 H16 D128 bf16) against BV 64's 6.37 / 18.21 and padding's 6.69 / 16.93.


@triton.jit
def tf32_round(x):
    """fp32 x rounded to the nearest tf32 (10 mantissa bits, ties away from zero): add half a
    tf32 unit to the bit pattern, clear the 13 low bits (a carry moves into the exponent, as
    rounding up to the next binade should)."""
    bits = x.to(tl.uint32, bitcast=True)
    return ((bits + 0x1000) & 0xFFFFE000).to(tl.float32, bitcast=True)


@triton.jit
def _tf32_truncate(x):
    """x (widened to fp32) with its 13 low mantissa bits cleared: what a tf32 tensor-core
    product reads of an fp32 operand (truncation, the coarser of the two roundings)."""
    bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
    return (bits & 0xFFFFE000).to(tl.float32, bitcast=True)


@triton.jit
def tf32_split(x):
    """x = hi + lo with hi a tf32 value and lo = x - hi exact (|lo| <= 2^-11 |x|, Sterbenz); lo
    rounded to tf32 too (relative error 2^-12 of lo, 2^-23 of x), so that the tensor cores see
    exactly these values on the GPU and the interpreter computes the same products."""
    hi = tf32_round(x)
    return hi, tf32_round(x - hi)


@triton.jit
def dot3(a, b):
    """fp32 a @ b as three tf32 tensor-core products, a_hi b_hi + a_hi b_lo + a_lo b_hi (a_lo
    b_lo is below 2^-22 of the product), the small terms first."""
    a_hi, a_lo = tf32_split(a)
    b_hi, b_lo = tf32_split(b)
    acc = tl.dot(a_lo, b_hi, input_precision="tf32")
    acc = tl.dot(a_hi, b_lo, acc, input_precision="tf32")
    return tl.dot(a_hi, b_hi, acc, input_precision="tf32")


@triton.jit
def _dot2_left(a, b):
    """a @ b with b exact in tf32 (a 16-bit input widened, or 0 / 1): two products."""
    a_hi, a_lo = tf32_split(a)
    acc = tl.dot(a_lo, b, input_precision="tf32")
    return tl.dot(a_hi, b, acc, input_precision="tf32")


@triton.jit
def _dot2_right(a, b):
    """a @ b with a exact in tf32: two products."""
    b_hi, b_lo = tf32_split(b)
    acc = tl.dot(a, b_lo, input_precision="tf32")
    return tl.dot(a, b_hi, acc, input_precision="tf32")


@triton.jit
def _dot_16bit(a, b, acc):
    """acc + a @ b of two tiles of one 16-bit dtype, summed in fp32 (the products exact: see
    _dot_inputs); through fp32 in the interpreter, whose bf16 tl.dot is wrong."""
    if UPCAST_BF16:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _dot_inputs(a, b):
    """a @ b of two 16-bit tiles (fp32 accumulation): the products are exact in fp32 (8 or 11
    mantissa bits a factor). bf16 goes through fp32 in the interpreter, whose bf16 tl.dot is
    wrong (see fusetune._triton.dot)."""
    if a.dtype == b.dtype:
        return _dot_16bit(a, b, tl.zeros([a.shape[0], b.shape[1]], dtype=tl.float32))
    else:  # fp16 with bf16: both exact in tf32
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="tf32")


@triton.jit
def to_bf16(x):
    """x rounded to the nearest bf16 (ties to even), as the GPU's conversion does; a bf16 tile
    stays as it is. The interpreter's conversion truncates (coarser, and biased toward zero),
    so there the bits are rounded first and the conversion is then exact."""
    if x.dtype == tl.bfloat16:
        return x
    else:
        if ROUND_BF16:
            bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
            bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
            return bits.to(tl.float32, bitcast=True).to(tl.bfloat16)
        else:
            return x.to(tl.bfloat16)


@triton.jit
def mm_state(a, b, BF16: tl.constexpr, DOT: tl.constexpr):
    """A product of the sequential kernels (``sequential_bf16``): with BF16 one bf16
    tensor-core product, each fp32 operand rounded to bf16 for it alone (the caller keeps its
    fp32 value), the sum in fp32, computed as (b^T a^T)^T (b is the narrow [*, BV] block: M = BV
    takes mma.sync; see the H100 faults above); else ``mm_tf32`` (the levels below 2 keep tf32
    products, in bf16 mode too: there an untransposed bf16 product would meet those faults)."""
    if BF16:
        return tl.trans(_dot_inputs(to_bf16(tl.trans(b)), to_bf16(tl.trans(a))))
    else:
        return mm_tf32(a, b, DOT)


@triton.jit
def _mm_split(a, b):
    """fp32 ``a @ b`` from tensor-core products: a 16-bit operand is an input tile as loaded,
    exact in tf32 (bf16 has 8 mantissa bits, fp16 11 with tf32's exponent range covering fp16's),
    so only fp32 operands are split."""
    if a.dtype == tl.float32:
        if b.dtype == tl.float32:
            return dot3(a, b)
        else:
            return _dot2_left(a, b.to(tl.float32))
    else:
        if b.dtype == tl.float32:
            return _dot2_right(a.to(tl.float32), b)
        else:
            return _dot_inputs(a, b)


@triton.jit
def _bf16_operand(x):
    """An fp32 tile rounded to bf16 for a bf16 product (``to_bf16``); a 16-bit input tile as it
    is (an fp16 one then meets bf16 in ``_dot_inputs``' exact tf32 product)."""
    if x.dtype == tl.float32:
        return to_bf16(x)
    else:
        return x


@triton.jit
def mm(a, b, DOT: tl.constexpr):
    """fp32 ``a @ b``: tensor cores (DOT == 3: ``_mm_split``; 4: fp32 operands rounded to tf32;
    5: fp32 operands rounded to bf16, one bf16 product, fp32 accumulation; computed as (b^T
    a^T)^T where b has under 64 columns, so that no [*, 32] bf16 tile is a wgmma B operand: at
    K = V = 128 that is bwd_pairs' T^T dD alone, at small V also wy's and output's value
    blocks) or IEEE fp32 FMA (2). Operands are fp32 tiles or input tiles in their own dtype
    (fp32, fp16, bf16); two 16-bit input tiles always take one 16-bit product."""
    if DOT == 4 and (a.dtype == tl.float32 or b.dtype == tl.float32):
        if EMULATE_TF32:
            return tl.dot(_tf32_truncate(a), _tf32_truncate(b), input_precision="ieee")
        else:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="tf32")
    elif DOT == 5 and (a.dtype == tl.float32 or b.dtype == tl.float32):
        if b.shape[1] < 64:  # a narrow bf16 B operand: transposed, as mm_state (H100 faults)
            return tl.trans(_dot_inputs(_bf16_operand(tl.trans(b)), _bf16_operand(tl.trans(a))))
        else:
            return _dot_inputs(_bf16_operand(a), _bf16_operand(b))
    else:
        return mm_exact(a, b, DOT)


@triton.jit
def _bf16_pair_product(a, b):
    """a @ b for an fp32 tile and a bf16 input tile: the fp32 one as the bf16 pair hi =
    bf16(x), lo = bf16(x - hi) (|x - hi - lo| <= 2^-17 |x|), two bf16 tensor-core products
    summed in fp32 (each exact there), the small one first."""
    if a.dtype == tl.float32:
        hi = to_bf16(a)
        return _dot_inputs(to_bf16(a - hi.to(tl.float32)), b) + _dot_inputs(hi, b)
    else:
        hi = to_bf16(b)
        return _dot_inputs(a, to_bf16(b - hi.to(tl.float32))) + _dot_inputs(a, hi)


@triton.jit
def mm_pair(a, b, DOT: tl.constexpr):
    """``mm`` with tf32 mode's fp32 x bf16 products taken as a bf16 pair
    (``_bf16_pair_product``): finer than tf32's truncation (2^-17 against 2^-10), and no
    operand is widened, so the two staged tiles take half the shared memory of tf32's. Where
    shared memory bounds the kernel (wy_kernel: Nsight, H200, L1 80 % busy) that is faster;
    where registers do (bwd_chunk_kernel), the pair's second tile cost more than it saved
    (2026-12-02: 2.35 -> 2.91 ms at B1 T32768), so only wy_kernel takes it (H200, fwd+bwd
    B1 T32768 H16 D128 bf16 8.29 / 8.36 -> 8.10 / 8.16 ms, wy's two calls 1.15 -> 0.96 ms;
    docs/bench/session-2026-12-02-twentyseventh). A narrow bf16 B operand is transposed, as in
    ``mm`` (the H100 faults)."""
    if DOT == 4 and (a.dtype == tl.float32) != (b.dtype == tl.float32) and (
            a.dtype == tl.bfloat16 or b.dtype == tl.bfloat16):
        if b.shape[1] < 64:
            return tl.trans(_bf16_pair_product(tl.trans(b), tl.trans(a)))
        else:
            return _bf16_pair_product(a, b)
    else:
        return mm(a, b, DOT)


@triton.jit
def mm_tf32(a, b, DOT: tl.constexpr):
    """``mm`` with bf16 mode's products at tf32 instead: the sequential kernels' products below
    level 2 (``mm_state``)."""
    if DOT == 5:
        return mm(a, b, 4)
    else:
        return mm(a, b, DOT)


@triton.jit
def mm_exact(a, b, DOT: tl.constexpr):
    """``mm`` at about fp32's accuracy in every tensor-core mode (split3 for tf32)."""
    if DOT == 2:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return _mm_split(a, b)


@triton.jit
def _chunk_program(cu, T, HV, BT: tl.constexpr, VARLEN: tl.constexpr, C0):
    """(chunk index, sequence, value head, batch row, chunk start, chunk end, sequence start)
    of a program; program axis 0 counts chunks from chunk C0 (the forward's parts)."""
    i_c = tl.program_id(0).to(tl.int64) + C0
    pid = tl.program_id(1).to(tl.int64)
    i_n, i_h = pid // HV, pid % HV
    i_b, bos, eos = sequence_bounds(cu, i_n, T, VARLEN)
    start = bos + i_c * BT
    end = tl.minimum(start + BT, eos)
    return i_c, i_n, i_h, i_b, start, end, bos


@triton.jit
def _load_gates(g_buf, buf_rows, mt):
    """A chunk's log decays g (0 past the end: padding sees no decay), their cumsum G and the
    chunk's total G_last."""
    g = tl.load(g_buf + buf_rows, mask=mt, other=0.0)
    gcum, total = gate_sums(g)
    return g, gcum, total


@triton.jit
def _add2(a_hi, a_lo, b_hi, b_lo):
    """(a_hi + a_lo) + (b_hi + b_lo) as an unevaluated pair (hi, lo) with hi = fl(hi + lo):
    Knuth's TwoSum for the heads' rounding error, then one renormalising step (double-fp32,
    about 2^-44 relative). Adds only: no FMA contraction can change it."""
    s = a_hi + b_hi
    b_virtual = s - a_hi
    error = (a_hi - (s - b_virtual)) + (b_hi - b_virtual)
    lo = (a_lo + b_lo) + error
    hi = s + lo
    return hi, lo - (hi - s)


@triton.jit
def _decays(g, r, LOWER: tl.constexpr):
    """exp(g_{s+1} + ... + g_t) on t > s (LOWER) or t >= s, else 0. G_t - G_s in fp32 would not
    do: cumsums reach -1000 and more in these models, where fp32 keeps only 1e-4 absolute, and
    exp turns that into a 1e-4 relative error of the decay. So the cumsum is carried as a
    double-fp32 pair (hi, lo) and the span is (hi_t - hi_s) + (lo_t - lo_s): the heads'
    difference is exact where it is small (Sterbenz) and the tails restore what the heads
    rounded off, so the span keeps fp32's relative accuracy (elementwise: no product)."""
    hi, lo = tl.associative_scan((g, tl.zeros_like(g)), 0, _add2)
    span = (hi[:, None] - hi[None, :]) + (lo[:, None] - lo[None, :])
    if LOWER:
        keep = r[:, None] > r[None, :]
    else:
        keep = r[:, None] >= r[None, :]
    return tl.exp(tl.where(keep, span, float("-inf")))


@triton.jit
def _tail(g, r):
    """g_{s+1} + ... + g_last for every s (the decay from token s to the chunk's end)."""
    return tl.sum(tl.where(r[None, :] > r[:, None], g[None, :], 0.0), axis=1)


@triton.jit
def _tail_sums(next_gates, rows, end):
    """``_tail`` for tokens ``rows`` of a chunk ending before ``end``, from the pointers to each
    token's next gate (a shifted load; floored as wy_kernel floors them), summed by a reverse
    scan: no [BT, BT] tile."""
    g_next = tl.load(next_gates, mask=rows + 1 < end, other=0.0).to(tl.float32)
    return tl.cumsum(tl.maximum(g_next, -1.0e4), axis=0, reverse=True)


@triton.jit
def inv_norms(x_in, BT: tl.constexpr, L2NORM: tl.constexpr):
    """1 / ||x_t|| for each row of an input tile (tokens along axis 0, the whole head dim along
    axis 1), as the models' l2norm has it (x rsqrt(sum x^2 + 1e-6)), or ones without L2NORM.
    The kernels fold these into per-token factors, so that q and k enter the products as the
    16-bit input tiles they are (one tensor-core product where fp32 q, k took a split one)."""
    return _inv_norm(_square_sum(x_in), BT, L2NORM)


@triton.jit
def _load_norms(norm_buf, buf_rows, mt, BT: tl.constexpr, L2NORM: tl.constexpr):
    """(1 / ||q_t||, 1 / ||k_t||) of a chunk's rows as the backward's wy_kernel stored them in
    norm_buf [rows, 2], or ones without L2NORM: bwd_pairs takes them from there instead of
    forming the rows' square sums, square roots and divisions again."""
    if L2NORM:
        rq = tl.load(norm_buf + 2 * buf_rows, mask=mt, other=1.0)
        rk = tl.load(norm_buf + 2 * buf_rows + 1, mask=mt, other=1.0)
        return rq, rk
    else:
        return tl.full([BT], 1.0, tl.float32), tl.full([BT], 1.0, tl.float32)


@triton.jit
def _square_sum(x):
    x = x.to(tl.float32)
    return tl.sum(x * x, axis=1)


@triton.jit
def _inv_norm(square_sum, N: tl.constexpr, L2NORM: tl.constexpr):
    """1 / ||x|| from the rows' summed squares, as the models' l2norm (rsqrt(sum x^2 + 1e-6));
    ones without L2NORM."""
    if L2NORM:
        return tl.div_rn(1.0, tl.sqrt_rn(square_sum + 1e-6))
    else:
        return tl.full([N], 1.0, tl.float32)


@triton.jit
def _l2norm_grad(x_in, r, dy):
    """The gradient of x from that of y = x r (r = 1 / ||x||, rows): r (dy - y <y, dy>)."""
    y = x_in.to(tl.float32) * r[:, None]
    return r[:, None] * (dy - y * tl.sum(y * dy, axis=1)[:, None])


BLOCK = tl.constexpr(16)  # the inverse's block side (inverse_kernel)
KEY_STEP = tl.constexpr(32)  # key columns a step of its k k^T loop


@triton.jit
def _block_factors(g_rows, beta_rows, mt, key_sq, L2NORM: tl.constexpr):
    """Per token of a block (its gates' and betas' pointers): beta_t / ||k_t|| (A's row factor),
    1 / ||k_s|| (its column factor; ``key_sq`` the keys' squared norms), the floored gates."""
    gq = tl.maximum(tl.load(g_rows, mask=mt, other=0.0).to(tl.float32), -1.0e4)
    bc = tl.load(beta_rows, mask=mt, other=0.0).to(tl.float32)
    rk = _inv_norm(key_sq, BLOCK, L2NORM)
    return bc * rk, rk, gq


@triton.jit
def _diagonal_block(kk, left, rk, gq):
    """A's strictly lower diagonal block beta_t (k_t . k_s) exp(g_{s+1} + ... + g_t) / norms."""
    return left[:, None] * kk * rk[None, :] * _decays(gq, tl.arange(0, BLOCK), True)


@triton.jit
def _pair_block(kk, left_t, head_t, rk_s, tail_s, between):
    """A's block of rows t (a later block) and columns s: the decay's span sum is the tail of s's
    block after s, the totals of the blocks between (``between``) and the head of t's block up
    to t, all terms <= 0 (no G_t - G_s: see _decays)."""
    span = (head_t[:, None] + tail_s[None, :]) + between
    return left_t[:, None] * kk * rk_s[None, :] * tl.exp(span)


@triton.jit
def _substitute(X, i, o):
    """Row i of (I + L)^-1 - I by forward substitution, X starting as -L: rows < i final, rows
    from i still -L's, so X's row i is a = -L's (zero from column i on), and the row is a + a X."""
    a = tl.sum(tl.where((o == i)[:, None], X, 0.0), 0)
    a = a + tl.sum(a[:, None] * X, 0)
    return tl.where((o == i)[:, None], a[None, :], X)


@triton.jit
def _ieee(a, b):
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _row_block(row_ptrs, mt, c0, WIDTH: tl.constexpr, K):
    """Columns c0 to c0 + WIDTH - 1 (of K) of the rows at ``row_ptrs`` (rows masked by mt), in
    their own dtype: a key or query block."""
    ck = c0 + tl.arange(0, WIDTH)
    return tl.load(row_ptrs[:, None] + ck[None, :], mask=mt[:, None] & (ck < K)[None, :],
                   other=0.0)


@triton.jit
def _store_block(t_buf, buf_rows, mt, j: tl.constexpr, X, BT: tl.constexpr):
    o = tl.arange(0, BLOCK)
    tl.store(t_buf + buf_rows[:, None] * BT + (o + j * BLOCK)[None, :], X, mask=mt[:, None])


@triton.jit
def inverse_kernel(
    k, g, beta, t_buf, cu, sk_b, sk_t, sk_h, sg_b, sg_t, sg_h, sb_b, sb_t, sb_h,
    T, HV, C0, GROUP: tl.constexpr, K, BT: tl.constexpr, VARLEN: tl.constexpr,
    DOT: tl.constexpr, L2NORM: tl.constexpr,
):
    """T = (I + A)^-1 per chunk [T, HV, BT] (fp32), A_ts = beta_t Gamma_ts (k_t . k_s) on t > s,
    in blocks of 16 tokens (NB = BT / 16 of them), as FLA's kkt_solve: k k^T's NB (NB + 1) / 2
    lower blocks summed over steps of 32 key columns (``mm``'s mode), the diagonal blocks of T
    by forward substitution (interleaved: independent chains), then T_ij = -T_ii sum_{j <= m <
    i} A_im T_mj by distance from the diagonal, in IEEE fp32 block products. Run at one warp:
    the substitution's row reductions stay inside it (at 4 warps they crossed warps and the
    inverse took 3x as long: tools/gdr_inverse_bench.py). The block products are 16 x 16 IEEE
    ones (no tensor cores: none of Triton 3.6's 16-wide Hopper faults, see min_block), about
    1e4 times closer to float64 than wy_kernel's former tf32 doubling (1.8e-8 vs 2.2e-4)."""
    i_c, i_n, i_h, i_b, start, end, bos = _chunk_program(cu, T, HV, BT, VARLEN, C0)
    if start >= end:
        return
    NB: tl.constexpr = BT // BLOCK
    o = tl.arange(0, BLOCK)
    k += i_b * sk_b + (i_h // GROUP) * sk_h
    g += i_b * sg_b + i_h * sg_h
    beta += i_b * sb_b + i_h * sb_h
    rows0, rows1 = start + o, start + BLOCK + o
    rows2, rows3 = rows0 + 2 * BLOCK, rows0 + 3 * BLOCK
    mt0, mt1, mt2, mt3 = rows0 < end, rows1 < end, rows2 < end, rows3 < end
    zero = tl.zeros([BLOCK, BLOCK], tl.float32)
    KK00, KK10, KK11, KK20, KK21 = zero, zero, zero, zero, zero
    KK22, KK30, KK31, KK32, KK33 = zero, zero, zero, zero, zero
    n0 = tl.sum(zero, 0)
    n1, n2, n3 = n0, n0, n0
    for c0 in range(0, K, KEY_STEP):  # the ten blocks of k k^T; the keys' squared norms
        k0 = _row_block(k + rows0 * sk_t, mt0, c0, KEY_STEP, K)
        KK00 += mm(k0, tl.trans(k0), DOT)
        n0 += _square_sum(k0)
        if NB > 1:
            k1 = _row_block(k + rows1 * sk_t, mt1, c0, KEY_STEP, K)
            KK10 += mm(k1, tl.trans(k0), DOT)
            KK11 += mm(k1, tl.trans(k1), DOT)
            n1 += _square_sum(k1)
        if NB > 2:
            k2 = _row_block(k + rows2 * sk_t, mt2, c0, KEY_STEP, K)
            k3 = _row_block(k + rows3 * sk_t, mt3, c0, KEY_STEP, K)
            KK20 += mm(k2, tl.trans(k0), DOT)
            KK21 += mm(k2, tl.trans(k1), DOT)
            KK22 += mm(k2, tl.trans(k2), DOT)
            KK30 += mm(k3, tl.trans(k0), DOT)
            KK31 += mm(k3, tl.trans(k1), DOT)
            KK32 += mm(k3, tl.trans(k2), DOT)
            KK33 += mm(k3, tl.trans(k3), DOT)
            n2 += _square_sum(k2)
            n3 += _square_sum(k3)
    left0, rk0, g0 = _block_factors(g + rows0 * sg_t, beta + rows0 * sb_t, mt0, n0, L2NORM)
    X0 = -_diagonal_block(KK00, left0, rk0, g0)
    if NB > 1:
        left1, rk1, g1 = _block_factors(g + rows1 * sg_t, beta + rows1 * sb_t, mt1, n1, L2NORM)
        X1 = -_diagonal_block(KK11, left1, rk1, g1)
        tail0 = _tail(g0, o)
        A10 = _pair_block(KK10, left1, tl.cumsum(g1, 0), rk0, tail0, 0.0)
    if NB > 2:
        left2, rk2, g2 = _block_factors(g + rows2 * sg_t, beta + rows2 * sb_t, mt2, n2, L2NORM)
        left3, rk3, g3 = _block_factors(g + rows3 * sg_t, beta + rows3 * sb_t, mt3, n3, L2NORM)
        X2 = -_diagonal_block(KK22, left2, rk2, g2)
        X3 = -_diagonal_block(KK33, left3, rk3, g3)
        head2, head3 = tl.cumsum(g2, 0), tl.cumsum(g3, 0)
        tail1 = _tail(g1, o)
        total1, total2 = tl.sum(g1, 0), tl.sum(g2, 0)
        A20 = _pair_block(KK20, left2, head2, rk0, tail0, total1)
        A21 = _pair_block(KK21, left2, head2, rk1, tail1, 0.0)
        A30 = _pair_block(KK30, left3, head3, rk0, tail0, total1 + total2)
        A31 = _pair_block(KK31, left3, head3, rk1, tail1, total2)
        A32 = _pair_block(KK32, left3, head3, rk2, _tail(g2, o), 0.0)
    for i in range(2, BLOCK):  # the diagonal blocks' rows, NB independent chains
        X0 = _substitute(X0, i, o)
        if NB > 1:
            X1 = _substitute(X1, i, o)
        if NB > 2:
            X2 = _substitute(X2, i, o)
            X3 = _substitute(X3, i, o)
    eye = tl.where(o[:, None] == o[None, :], 1.0, 0.0)
    out0 = (i_b * T + rows0) * HV + i_h  # block j's buffer rows: out0 + j * step
    step = BLOCK * HV
    X0 += eye
    _store_block(t_buf, out0, mt0, 0, X0, BT)
    for j in tl.static_range(1, NB):
        _store_block(t_buf, out0, mt0, j, zero, BT)
    if NB > 1:
        X1 += eye
        X10 = -_ieee(_ieee(X1, A10), X0)
        _store_block(t_buf, out0 + step, mt1, 0, X10, BT)
        _store_block(t_buf, out0 + step, mt1, 1, X1, BT)
        for j in tl.static_range(2, NB):
            _store_block(t_buf, out0 + step, mt1, j, zero, BT)
    if NB > 2:
        X2 += eye
        X3 += eye
        X21 = -_ieee(_ieee(X2, A21), X1)
        X32 = -_ieee(_ieee(X3, A32), X2)
        X20 = -_ieee(X2, _ieee(A20, X0) + _ieee(A21, X10))
        X31 = -_ieee(X3, _ieee(A31, X1) + _ieee(A32, X21))
        X30 = -_ieee(X3, _ieee(A30, X0) + _ieee(A31, X10) + _ieee(A32, X20))
        _store_block(t_buf, out0 + 2 * step, mt2, 0, X20, BT)
        _store_block(t_buf, out0 + 2 * step, mt2, 1, X21, BT)
        _store_block(t_buf, out0 + 2 * step, mt2, 2, X2, BT)
        _store_block(t_buf, out0 + 2 * step, mt2, 3, zero, BT)
        _store_block(t_buf, out0 + 3 * step, mt3, 0, X30, BT)
        _store_block(t_buf, out0 + 3 * step, mt3, 1, X31, BT)
        _store_block(t_buf, out0 + 3 * step, mt3, 2, X32, BT)
        _store_block(t_buf, out0 + 3 * step, mt3, 3, X3, BT)


@triton.jit
def wy_kernel(
    q, k, v, g, beta, do, gc_buf, t_buf, w_buf, u_buf, dd_buf, kd_buf, qd_buf, norm_buf,
    decay_buf, cu,
    sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, sg_b, sg_t, sg_h, sb_b, sb_t, sb_h,
    sd_b, sd_t, sd_h,
    scale, T, HV, C0, GROUP: tl.constexpr, K, V, BT: tl.constexpr, BKW: tl.constexpr,
    BV: tl.constexpr, VARLEN: tl.constexpr, DOT: tl.constexpr, L2NORM: tl.constexpr,
    LOCAL_DD: tl.constexpr,
):
    """Per chunk, everything that does not depend on the state (fp32, rows of the contiguous
    buffers r = (b * T + t) * HV + h), from inverse_kernel's T = (I + A)^-1 in t_buf: the
    floored gates g [T, HV], W = (T diag(beta e^G)) K [T, HV, K] and U = (T diag(beta)) V
    [T, HV, V] (states_kernel turns U into D = U - W S0 in place); for the backward
    (LOCAL_DD) also dD's local part P^T dO into dd_buf (dstates_kernel adds the state's). So
    the sequential kernels do only the products that carry the state: two a chunk forward,
    three backward, where they formed W, U and P per block of value columns. Their per-token
    factors come from here too (no gate sums, key norms or exp in their loops): kd_buf [T, HV]
    = exp(g_{t+1} + ... + g_last) rk_t (a key's decay to the chunk's end), decay_buf [slot, HV]
    = exp(G_last), and for the backward qd_buf [T, HV] = scale rq_t exp(G_t). Keys (and
    queries) go by in blocks of BKW columns, values in blocks of BV, so that no [BT, K] tile
    or accumulator is held whole (holding them, it took 224 registers and 49 KB of shared
    memory: two blocks an SM, L1 76 % busy; Nsight, H200, 2026-12-01)."""
    i_c, i_n, i_h, i_b, start, end, bos = _chunk_program(cu, T, HV, BT, VARLEN, C0)
    if start >= end:
        return
    r = tl.arange(0, BT)
    rows = start + r
    mt = rows < end
    i_hk = i_h // GROUP
    k_rows = k + i_b * sk_b + i_hk * sk_h + rows * sk_t
    q_rows = q + i_b * sq_b + i_hk * sq_h + rows * sq_t
    gq = tl.load(g + i_b * sg_b + i_h * sg_h + rows * sg_t, mask=mt, other=0.0).to(tl.float32)
    gq = tl.maximum(gq, -1.0e4)  # exp(-1e4) is 0 to fp32; -inf would give 0 * inf below
    bc = tl.load(beta + i_b * sb_b + i_h * sb_h + rows * sb_t, mask=mt, other=0.0).to(tl.float32)
    out_rows = (i_b * T + rows) * HV + i_h
    k_sq = tl.zeros([BT], dtype=tl.float32)
    q_sq = tl.zeros([BT], dtype=tl.float32)
    QK = tl.zeros([BT, BT], dtype=tl.float32)
    if L2NORM or LOCAL_DD:  # the norms' sums (and Q K^T) over the key columns
        for c0 in range(0, K, BKW):
            k_in = _row_block(k_rows, mt, c0, BKW, K)  # (input dtype: see mm)
            k_sq += _square_sum(k_in)
            if LOCAL_DD:
                q_in = _row_block(q_rows, mt, c0, BKW, K)
                q_sq += _square_sum(q_in)
                QK += mm(q_in, tl.trans(k_in), DOT)
    rk = _inv_norm(k_sq, BT, L2NORM)
    gc, total = gate_sums(gq)
    tl.store(gc_buf + out_rows, gq, mask=mt)
    tail = _tail_sums(g + i_b * sg_b + i_h * sg_h + (rows + 1) * sg_t, rows, end)
    tl.store(kd_buf + out_rows, tl.where(mt, tl.exp(tail), 0.0) * rk, mask=mt)
    slot = chunk_slot(i_n, bos, i_c, BT, tl.cdiv(T, BT), VARLEN)
    tl.store(decay_buf + slot * HV + i_h, tl.exp(total))
    Tinv = tl.load(t_buf + out_rows[:, None] * BT + r[None, :], mask=mt[:, None], other=0.0)
    Tf = Tinv * (bc * rk * tl.exp(gc))[None, :]
    for c0 in range(0, K, BKW):
        ck = c0 + tl.arange(0, BKW)
        mtk = mt[:, None] & (ck < K)[None, :]
        Wc = mm_pair(Tf, _row_block(k_rows, mt, c0, BKW, K), DOT)  # K stays an input tile
        if w_buf.dtype.element_ty == tl.bfloat16:  # (sequential_bf16)
            Wc = to_bf16(Wc)
        tl.store(w_buf + out_rows[:, None] * K + ck[None, :], Wc, mask=mtk)
    Tb = Tinv * bc[None, :]
    if LOCAL_DD:
        rq = _inv_norm(q_sq, BT, L2NORM)
        P = QK * (scale * _decays(gq, r, False))
        Pt = tl.trans(P * (rq[:, None] * rk[None, :]))
        tl.store(qd_buf + out_rows, scale * rq * tl.exp(gc), mask=mt)
        if L2NORM:  # (bwd_pairs reads them: _load_norms)
            tl.store(norm_buf + 2 * out_rows, rq, mask=mt)
            tl.store(norm_buf + 2 * out_rows + 1, rk, mask=mt)
    for v0 in range(0, V, BV):
        cv = v0 + tl.arange(0, BV)
        mtv = mt[:, None] & (cv < V)[None, :]
        out = out_rows[:, None] * V + cv[None, :]
        v_in = tl.load(v + i_b * sv_b + i_h * sv_h + rows[:, None] * sv_t + cv[None, :],
                       mask=mtv, other=0.0)
        tl.store(u_buf + out, mm_pair(Tb, v_in, DOT), mask=mtv)
        if LOCAL_DD:
            dO_in = tl.load(do + i_b * sd_b + i_h * sd_h + rows[:, None] * sd_t + cv[None, :],
                            mask=mtv, other=0.0)
            tl.store(dd_buf + out, mm_pair(Pt, dO_in, DOT), mask=mtv)


@triton.jit
def states_kernel(
    k, kd_buf, decay_buf, w_buf, u_buf, d_buf, h_buf, h0, hT, cu, sk_b, sk_t, sk_h,
    T, HV, C0, C1, GROUP: tl.constexpr, K, V, BT: tl.constexpr, BK: tl.constexpr,
    BV: tl.constexpr,
    HAS_H0: tl.constexpr, STORE_HT: tl.constexpr, VARLEN: tl.constexpr, DOT: tl.constexpr,
    L2NORM: tl.constexpr, SEQ_BF16: tl.constexpr,
):
    """Sequential over the chunks of one sequence, value head and block of value columns: store
    each chunk's start state S0 [slot, HV, K, V] and turn wy_kernel's U into the writes D = U
    - W S0 [T, HV, V]: over U in d_buf (u_buf unread), or at level 3 (FUSETUNE_GDR_W=d) into a
    bf16 d_buf beside U in u_buf. SEQ_BF16: W in bf16 from 1, bf16 products with W from 1, all
    from 2 (``sequential_bf16``); the state takes D in fp32 at every level. Only chunks C0 to
    C1 - 1 of each sequence (the forward's parts): the state starts from h0 (HAS_H0) and ends
    in hT (STORE_HT), fp32 [N, HV, K, V], which carry it from one part to the next."""
    i_v = tl.program_id(0)
    pid = tl.program_id(1).to(tl.int64)
    i_n, i_h = pid // HV, pid % HV
    i_b, bos, eos = sequence_bounds(cu, i_n, T, VARLEN)
    ck, cv = tl.arange(0, BK), i_v * BV + tl.arange(0, BV)
    mk, mv = ck < K, cv < V
    tile = ck[:, None] * V + cv[None, :]
    mkv = mk[:, None] & mv[None, :]
    k += i_b * sk_b + (i_h // GROUP) * sk_h
    S = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_H0:
        S += tl.load(h0 + (i_n * HV + i_h) * K * V + tile, mask=mkv, other=0.0).to(tl.float32)
    first_slot = chunk_slot(i_n, bos, 0, BT, tl.cdiv(T, BT), VARLEN)
    r = tl.arange(0, BT)
    for i_c in range(C0, tl.minimum(tl.cdiv(eos - bos, BT), C1)):
        start = bos + i_c * BT
        rows = start + r
        mt = rows < eos
        mtk = mt[:, None] & mk[None, :]
        mtv = mt[:, None] & mv[None, :]
        buf_rows = (i_b * T + rows) * HV + i_h
        tl.store(h_buf + ((first_slot + i_c) * HV + i_h) * K * V + tile,
                 S.to(h_buf.dtype.element_ty), mask=mkv)
        kd = tl.load(kd_buf + buf_rows, mask=mt, other=0.0)  # (wy_kernel's factors)
        decay = tl.load(decay_buf + (first_slot + i_c) * HV + i_h)
        k_in = tl.load(k + rows[:, None] * sk_t + ck[None, :], mask=mtk, other=0.0)
        Wc = tl.load(w_buf + buf_rows[:, None] * K + ck[None, :], mask=mtk, other=0.0)
        d_rows = d_buf + buf_rows[:, None] * V + cv[None, :]
        if d_buf.dtype.element_ty == tl.bfloat16:  # (FUSETUNE_GDR_W=d: U apart, in fp32)
            U = tl.load(u_buf + buf_rows[:, None] * V + cv[None, :], mask=mtv, other=0.0)
        else:  # (D goes over U: u_buf unread, the code as before W=d)
            U = tl.load(d_rows, mask=mtv, other=0.0)
        Dc = U - mm_state(Wc, S, SEQ_BF16 >= 1, DOT)
        if d_buf.dtype.element_ty == tl.bfloat16:  # to nearest (see to_bf16)
            tl.store(d_rows, to_bf16(Dc), mask=mtv)
        else:
            tl.store(d_rows, Dc, mask=mtv)
        S = S * decay + mm_state(tl.trans(k_in), kd[:, None] * Dc, SEQ_BF16 >= 2, DOT)
    if STORE_HT:
        tl.store(hT + (i_n * HV + i_h) * K * V + tile, S, mask=mkv)


@triton.jit
def _key_blocks(K, V, BV: tl.constexpr):
    """A key-block walk's value columns (program axis 0: a block of BV) and the two [64, BV] key
    blocks of its [K, V] state: (cv, mv, c1, c2, m2, tile1, tile2, mkv1, mkv2)."""
    c1, cv = tl.arange(0, 64), tl.program_id(0) * BV + tl.arange(0, BV)
    c2 = 64 + c1
    m2, mv = c2 < K, cv < V
    tile1, tile2 = c1[:, None] * V + cv[None, :], c2[:, None] * V + cv[None, :]
    mkv1, mkv2 = (c1 < 64)[:, None] & mv[None, :], m2[:, None] & mv[None, :]
    return cv, mv, c1, c2, m2, tile1, tile2, mkv1, mkv2


@triton.jit
def _load_key_blocks(state, tile1, tile2, mkv1, mkv2):
    """A [K, V] state's two key blocks (``_key_blocks``) as fp32."""
    first = tl.load(state + tile1, mask=mkv1, other=0.0).to(tl.float32)
    return first, tl.load(state + tile2, mask=mkv2, other=0.0).to(tl.float32)


@triton.jit
def _start_key_blocks(state, tile1, tile2, mkv1, mkv2, BV: tl.constexpr, GIVEN: tl.constexpr):
    """A walk's start in two fp32 key blocks: ``state``'s (GIVEN) or zeros."""
    S1 = tl.zeros([64, BV], dtype=tl.float32)
    S2 = tl.zeros([64, BV], dtype=tl.float32)
    if GIVEN:
        H1, H2 = _load_key_blocks(state, tile1, tile2, mkv1, mkv2)
        S1 += H1
        S2 += H2
    return S1, S2


@triton.jit
def _store_key_blocks(state, S1, S2, tile1, tile2, mkv1, mkv2):
    """The two key blocks into a [K, V] state, in its dtype."""
    tl.store(state + tile1, S1.to(state.dtype.element_ty), mask=mkv1)
    tl.store(state + tile2, S2.to(state.dtype.element_ty), mask=mkv2)


@triton.jit
def states_k64_kernel(
    k, kd_buf, decay_buf, w_buf, u_buf, d_buf, h_buf, h0, hT, cu, sk_b, sk_t, sk_h,
    T, HV, C0, C1, GROUP: tl.constexpr, K, V, BT: tl.constexpr, BV: tl.constexpr,
    HAS_H0: tl.constexpr, STORE_HT: tl.constexpr, VARLEN: tl.constexpr,
):
    """states_kernel for 64 < K <= 128 with every product in bf16 (SEQ_BF16 2), in FLA's
    shape: the state as two [64, BV] key blocks, each product untransposed (the chunk's rows
    or a key block on M) with the state, or W S0's sum, as its accumulator, and k^T loaded
    transposed (``walks_in_key_blocks``)."""
    pid = tl.program_id(1).to(tl.int64)
    i_n, i_h = pid // HV, pid % HV
    i_b, bos, eos = sequence_bounds(cu, i_n, T, VARLEN)
    cv, mv, c1, c2, m2, tile1, tile2, mkv1, mkv2 = _key_blocks(K, V, BV)
    k += i_b * sk_b + (i_h // GROUP) * sk_h
    S1, S2 = _start_key_blocks(h0 + (i_n * HV + i_h) * K * V, tile1, tile2, mkv1, mkv2, BV,
                               HAS_H0)
    first_slot = chunk_slot(i_n, bos, 0, BT, tl.cdiv(T, BT), VARLEN)
    r = tl.arange(0, BT)
    for i_c in range(C0, tl.minimum(tl.cdiv(eos - bos, BT), C1)):
        rows = bos + i_c * BT + r
        mt = rows < eos
        mtv = mt[:, None] & mv[None, :]
        buf_rows = (i_b * T + rows) * HV + i_h
        copy = h_buf + ((first_slot + i_c) * HV + i_h) * K * V
        _store_key_blocks(copy, S1, S2, tile1, tile2, mkv1, mkv2)
        kd = tl.load(kd_buf + buf_rows, mask=mt, other=0.0)  # (wy_kernel's factors)
        decay = tl.load(decay_buf + (first_slot + i_c) * HV + i_h)
        w_rows = w_buf + buf_rows[:, None] * K
        W1 = tl.load(w_rows + c1[None, :], mask=mt[:, None], other=0.0)
        W2 = tl.load(w_rows + c2[None, :], mask=mt[:, None] & m2[None, :], other=0.0)
        k_cols = k + rows[None, :] * sk_t  # k^T's key blocks [64, BT]
        kt1 = tl.load(k_cols + c1[:, None], mask=mt[None, :], other=0.0)
        kt2 = tl.load(k_cols + c2[:, None], mask=m2[:, None] & mt[None, :], other=0.0)
        d_rows = d_buf + buf_rows[:, None] * V + cv[None, :]
        if d_buf.dtype.element_ty == tl.bfloat16:  # (FUSETUNE_GDR_W=d: U apart, in fp32)
            U = tl.load(u_buf + buf_rows[:, None] * V + cv[None, :], mask=mtv, other=0.0)
        else:
            U = tl.load(d_rows, mask=mtv, other=0.0)
        WS = _dot_inputs(W1, to_bf16(S1))
        Dc = U - _dot_16bit(W2, to_bf16(S2), WS)
        if d_buf.dtype.element_ty == tl.bfloat16:
            tl.store(d_rows, to_bf16(Dc), mask=mtv)
        else:
            tl.store(d_rows, Dc, mask=mtv)
        kD = to_bf16(kd[:, None] * Dc)
        S1 = _dot_16bit(kt1, kD, S1 * decay)
        S2 = _dot_16bit(kt2, kD, S2 * decay)
    if STORE_HT:
        _store_key_blocks(hT + (i_n * HV + i_h) * K * V, S1, S2, tile1, tile2, mkv1, mkv2)


@triton.jit
def output_kernel(
    q, k, gc_buf, d_buf, h_buf, o, cu,
    sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, so_b, so_t, so_h,
    scale, T, HV, C0, GROUP: tl.constexpr, K, V, BT: tl.constexpr, BK: tl.constexpr,
    BVA: tl.constexpr, VARLEN: tl.constexpr, DOT: tl.constexpr, L2NORM: tl.constexpr,
):
    """O = scale [(exp(G) Q) S0 + ((Q K^T) * Gamma) D] for one chunk, value head and block of
    BVA value columns (program axis 2)."""
    i_c, i_n, i_h, i_b, start, end, bos = _chunk_program(cu, T, HV, BT, VARLEN, C0)
    if start >= end:
        return
    rows = start + tl.arange(0, BT)
    mt = rows < end
    ck, cv = tl.arange(0, BK), tl.program_id(2) * BVA + tl.arange(0, BVA)
    mk, mv = ck < K, cv < V
    i_hk = i_h // GROUP
    q_in = tl.load(q + i_b * sq_b + i_hk * sq_h + rows[:, None] * sq_t + ck[None, :],
                   mask=mt[:, None] & mk[None, :], other=0.0)  # q, k in their input dtype
    k_in = tl.load(k + i_b * sk_b + i_hk * sk_h + rows[:, None] * sk_t + ck[None, :],
                   mask=mt[:, None] & mk[None, :], other=0.0)
    buf_rows = (i_b * T + rows) * HV + i_h
    r = tl.arange(0, BT)
    gq, gc, _ = _load_gates(gc_buf, buf_rows, mt)
    Dc = tl.load(d_buf + buf_rows[:, None] * V + cv[None, :], mask=mt[:, None] & mv[None, :],
                 other=0.0)
    slot = chunk_slot(i_n, bos, i_c, BT, tl.cdiv(T, BT), VARLEN)
    S0 = tl.load(h_buf + (slot * HV + i_h) * K * V + ck[:, None] * V + cv[None, :],
                 mask=mk[:, None] & mv[None, :], other=0.0)
    rq, rk = inv_norms(q_in, BT, L2NORM), inv_norms(k_in, BT, L2NORM)
    attn = mm(q_in, tl.trans(k_in), DOT) * (scale * _decays(gq, r, False))
    attn = attn * (rq[:, None] * rk[None, :])
    out = (scale * rq * tl.exp(gc))[:, None] * mm(q_in, S0, DOT) + mm(attn, Dc, DOT)
    tl.store(o + i_b * so_b + i_h * so_h + rows[:, None] * so_t + cv[None, :],
             out.to(o.dtype.element_ty), mask=mt[:, None] & mv[None, :])


# ============================================================================ backward
# Recompute T (inverse_kernel), g, W, U (wy_kernel, which also leaves dD's local part P^T dO)
# and S0, D (states_kernel) as the forward does; then
# ``dstates_kernel`` walks the chunks in reverse carrying dS (the gradient of the state after a
# chunk), storing it per chunk with dD. dstates reads no state (only wy_kernel's outputs and the
# inputs), so the launcher may run the states recompute beside it on a second stream
# (``backward_side_stream``). ``bwd_pairs_kernel`` (the terms that need no state) and
# ``bwd_chunk_kernel`` (the state terms) form every input gradient of a chunk from those. dg
# is formed term by term with each term's decay factor (no reverse running sum of O(1) terms:
# that loses the strongly decaying heads, where dg is O(exp(g))).


@triton.jit
def dstates_kernel(
    q, k, do, kd_buf, qd_buf, decay_buf, w_buf, dd_buf, dh_buf, dhT, dh0, cu,
    sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sd_b, sd_t, sd_h,
    scale, T, HV, GROUP: tl.constexpr, K, V, BT: tl.constexpr, BK: tl.constexpr,
    BV: tl.constexpr, HAS_DHT: tl.constexpr, VARLEN: tl.constexpr, DOT: tl.constexpr,
    L2NORM: tl.constexpr, SEQ_BF16: tl.constexpr,
):
    """Reverse over chunks: dS (the gradient of the state after the chunk) per chunk into
    dh_buf, dD = exp(G_last - G) K dS + P^T dO into dd_buf (wy_kernel left P^T dO there), and
    dS before the chunk: exp(G_last) dS + (exp(G) Q)^T dO - W^T dD; dh0 at the end. SEQ_BF16:
    as in states_kernel."""
    i_v = tl.program_id(0)
    pid = tl.program_id(1).to(tl.int64)
    i_n, i_h = pid // HV, pid % HV
    i_b, bos, eos = sequence_bounds(cu, i_n, T, VARLEN)
    ck, cv = tl.arange(0, BK), i_v * BV + tl.arange(0, BV)
    mk, mv = ck < K, cv < V
    tile = ck[:, None] * V + cv[None, :]
    mkv = mk[:, None] & mv[None, :]
    i_hk = i_h // GROUP
    q += i_b * sq_b + i_hk * sq_h
    k += i_b * sk_b + i_hk * sk_h
    do += i_b * sd_b + i_h * sd_h
    dS = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_DHT:
        dS += tl.load(dhT + (i_n * HV + i_h) * K * V + tile, mask=mkv, other=0.0).to(tl.float32)
    first_slot = chunk_slot(i_n, bos, 0, BT, tl.cdiv(T, BT), VARLEN)
    r = tl.arange(0, BT)
    n_chunks = tl.cdiv(eos - bos, BT)
    for j in range(0, n_chunks):
        i_c = n_chunks - 1 - j
        start = bos + i_c * BT
        rows = start + r
        mt = rows < eos
        mtk = mt[:, None] & mk[None, :]
        mtv = mt[:, None] & mv[None, :]
        buf_rows = (i_b * T + rows) * HV + i_h
        tl.store(dh_buf + ((first_slot + i_c) * HV + i_h) * K * V + tile,
                 dS.to(dh_buf.dtype.element_ty), mask=mkv)
        # q, k, dO in their input dtype: see mm
        q_in = tl.load(q + rows[:, None] * sq_t + ck[None, :], mask=mtk, other=0.0)
        k_in = tl.load(k + rows[:, None] * sk_t + ck[None, :], mask=mtk, other=0.0)
        dO_in = tl.load(do + rows[:, None] * sd_t + cv[None, :], mask=mtv, other=0.0)
        Wc = tl.load(w_buf + buf_rows[:, None] * K + ck[None, :], mask=mtk, other=0.0)
        kd = tl.load(kd_buf + buf_rows, mask=mt, other=0.0)  # (wy_kernel's factors)
        qd = tl.load(qd_buf + buf_rows, mask=mt, other=0.0)
        decay = tl.load(decay_buf + (first_slot + i_c) * HV + i_h)
        dd_rows = dd_buf + buf_rows[:, None] * V + cv[None, :]
        dDc = tl.load(dd_rows, mask=mtv, other=0.0) + kd[:, None] * mm_state(
            k_in, dS, SEQ_BF16 >= 2, DOT)
        tl.store(dd_rows, dDc, mask=mtv)
        dOe = qd[:, None] * dO_in.to(tl.float32)  # (e^G Q)^T dO = Q^T dOe
        dS = (dS * decay + mm_state(tl.trans(q_in), dOe, SEQ_BF16 >= 2, DOT)
              - mm_state(tl.trans(Wc), dDc, SEQ_BF16 >= 1, DOT))
    tl.store(dh0 + (i_n * HV + i_h) * K * V + tile, dS, mask=mkv)


@triton.jit
def dstates_k64_kernel(
    q, k, do, kd_buf, qd_buf, decay_buf, w_buf, dd_buf, dh_buf, dhT, dh0, cu,
    sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sd_b, sd_t, sd_h,
    T, HV, GROUP: tl.constexpr, K, V, BT: tl.constexpr, BV: tl.constexpr,
    HAS_DHT: tl.constexpr, VARLEN: tl.constexpr,
):
    """dstates_kernel for 64 < K <= 128 with every product in bf16 (SEQ_BF16 2), in FLA's
    shape (see states_k64_kernel): dS as two [64, BV] key blocks, K dS from the two key blocks
    of k, and each block's update untransposed into it from q^T's and W^T's blocks, loaded
    transposed (``walks_in_key_blocks``)."""
    pid = tl.program_id(1).to(tl.int64)
    i_n, i_h = pid // HV, pid % HV
    i_b, bos, eos = sequence_bounds(cu, i_n, T, VARLEN)
    cv, mv, c1, c2, m2, tile1, tile2, mkv1, mkv2 = _key_blocks(K, V, BV)
    i_hk = i_h // GROUP
    q += i_b * sq_b + i_hk * sq_h
    k += i_b * sk_b + i_hk * sk_h
    do += i_b * sd_b + i_h * sd_h
    dS1, dS2 = _start_key_blocks(dhT + (i_n * HV + i_h) * K * V, tile1, tile2, mkv1, mkv2, BV,
                                 HAS_DHT)
    first_slot = chunk_slot(i_n, bos, 0, BT, tl.cdiv(T, BT), VARLEN)
    r = tl.arange(0, BT)
    n_chunks = tl.cdiv(eos - bos, BT)
    for j in range(0, n_chunks):
        i_c = n_chunks - 1 - j
        rows = bos + i_c * BT + r
        mt = rows < eos
        mtv = mt[:, None] & mv[None, :]
        buf_rows = (i_b * T + rows) * HV + i_h
        copy = dh_buf + ((first_slot + i_c) * HV + i_h) * K * V
        _store_key_blocks(copy, dS1, dS2, tile1, tile2, mkv1, mkv2)
        k_rows = k + rows[:, None] * sk_t
        k1 = tl.load(k_rows + c1[None, :], mask=mt[:, None], other=0.0)
        k2 = tl.load(k_rows + c2[None, :], mask=mt[:, None] & m2[None, :], other=0.0)
        q_cols = q + rows[None, :] * sq_t  # q^T's and W^T's key blocks [64, BT]
        qt1 = tl.load(q_cols + c1[:, None], mask=mt[None, :], other=0.0)
        qt2 = tl.load(q_cols + c2[:, None], mask=m2[:, None] & mt[None, :], other=0.0)
        w_cols = w_buf + buf_rows[None, :] * K
        wt1 = tl.load(w_cols + c1[:, None], mask=mt[None, :], other=0.0)
        wt2 = tl.load(w_cols + c2[:, None], mask=m2[:, None] & mt[None, :], other=0.0)
        dO_in = tl.load(do + rows[:, None] * sd_t + cv[None, :], mask=mtv, other=0.0)
        kd = tl.load(kd_buf + buf_rows, mask=mt, other=0.0)  # (wy_kernel's factors)
        qd = tl.load(qd_buf + buf_rows, mask=mt, other=0.0)
        decay = tl.load(decay_buf + (first_slot + i_c) * HV + i_h)
        dd_rows = dd_buf + buf_rows[:, None] * V + cv[None, :]
        KdS = _dot_inputs(k1, to_bf16(dS1))
        dDc = tl.load(dd_rows, mask=mtv, other=0.0) + kd[:, None] * _dot_16bit(
            k2, to_bf16(dS2), KdS)
        tl.store(dd_rows, dDc, mask=mtv)
        dOe = to_bf16(qd[:, None] * dO_in.to(tl.float32))  # (e^G Q)^T dO = Q^T dOe
        minus_dD = to_bf16(-dDc)
        dS1 = _dot_16bit(wt1, minus_dD, _dot_16bit(qt1, dOe, dS1 * decay))
        dS2 = _dot_16bit(wt2, minus_dD, _dot_16bit(qt2, dOe, dS2 * decay))
    _store_key_blocks(dh0 + (i_n * HV + i_h) * K * V, dS1, dS2, tile1, tile2, mkv1, mkv2)


@triton.jit
def _pack_pairs(dQK, dKK, r):
    """The two token-pair gradients of a chunk in one tile: dQK (lower triangle and diagonal:
    Q K^T's pairs are causal) below, dKK^T (dKK strictly lower: A's pairs) above. One tile in
    place of two, and T's tile stays for a second backward (bwd_pairs_kernel wrote dKK + dKK^T
    over T before 2026-12-02)."""
    return tl.where(r[:, None] >= r[None, :], dQK, tl.trans(dKK))


@triton.jit
def _unpack_pairs(pair_buf, buf_rows, mt, r, BT: tl.constexpr):
    """_pack_pairs' tile as (dQK, dKK + dKK^T): the upper triangle taken once as loaded (dKK^T)
    and once transposed (dKK), so no value is added or rounded. (A second load through
    transposed pointers took 104 more SASS instructions and 48 B more spill a thread.)"""
    packed = tl.load(pair_buf + buf_rows[:, None] * BT + r[None, :], mask=mt[:, None], other=0.0)
    mirror = tl.trans(packed)
    dQK = tl.where(r[:, None] >= r[None, :], packed, 0.0)
    dKK2 = (tl.where(r[:, None] < r[None, :], packed, 0.0)
            + tl.where(r[:, None] > r[None, :], mirror, 0.0))
    return dQK, dKK2


@triton.jit
def bwd_pairs_kernel(
    q, k, v, beta, do, gc_buf, norm_buf, t_buf, d_buf, dd_buf, pair_buf, dv, dbeta_buf, dg_buf,
    cu,
    sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, sb_b, sb_t, sb_h, sd_b, sd_t, sd_h,
    sdv_b, sdv_t, sdv_h,
    scale, T, HV, GROUP: tl.constexpr, K, V, BT: tl.constexpr, BK: tl.constexpr,
    BVA: tl.constexpr, VARLEN: tl.constexpr, DOT: tl.constexpr, L2NORM: tl.constexpr,
):
    """The backward's per-chunk gradients, first half (one chunk and value head): what needs
    no state. Over the value columns dP = dO D^T, dDD = dD D^T and d(beta V) = T^T dD (dU =
    dD), whence dv and dbeta's value part; T^T dD goes over dD in dd_buf, so that the second
    half's dW term (T^T dW = -(T^T dD) S0^T) needs no T. Then the token-pair gradients, packed
    in one [BT, BT] tile of pair_buf (_pack_pairs): dQK (the gradient of Q K^T's decayed, scaled
    products) and dKK (that of K K^T); and dbeta's and dg's pair parts into dbeta_buf and dg_buf.
    T in t_buf stays as the forward left it. (One kernel with the second half held 255
    registers and spilled 1304 B a thread, one block an SM.)"""
    i_c, i_n, i_h, i_b, start, end, bos = _chunk_program(cu, T, HV, BT, VARLEN, 0)
    if start >= end:
        return
    r = tl.arange(0, BT)
    rows = start + r
    mt = rows < end
    ck = tl.arange(0, BK)
    mtk = mt[:, None] & (ck < K)[None, :]
    i_hk = i_h // GROUP
    bc = tl.load(beta + i_b * sb_b + i_h * sb_h + rows * sb_t, mask=mt, other=0.0).to(tl.float32)
    buf_rows = (i_b * T + rows) * HV + i_h
    pair_tile = buf_rows[:, None] * BT + r[None, :]
    Tinv = tl.load(t_buf + pair_tile, mask=mt[:, None], other=0.0)
    dP = tl.zeros([BT, BT], dtype=tl.float32)
    dDD = tl.zeros([BT, BT], dtype=tl.float32)
    dbeta = tl.zeros([BT], dtype=tl.float32)
    for v0 in range(0, V, BVA):
        cv = v0 + tl.arange(0, BVA)
        mtv = mt[:, None] & (cv < V)[None, :]
        v_in = tl.load(v + i_b * sv_b + i_h * sv_h + rows[:, None] * sv_t + cv[None, :],
                       mask=mtv, other=0.0)
        dO_in = tl.load(do + i_b * sd_b + i_h * sd_h + rows[:, None] * sd_t + cv[None, :],
                        mask=mtv, other=0.0)
        Dc = tl.load(d_buf + buf_rows[:, None] * V + cv[None, :], mask=mtv, other=0.0)
        dd_tile = dd_buf + buf_rows[:, None] * V + cv[None, :]
        dDc = tl.load(dd_tile, mask=mtv, other=0.0)
        dP += mm(dO_in, tl.trans(Dc), DOT)
        dDD += mm(dDc, tl.trans(Dc), DOT)
        dvb = mm(tl.trans(Tinv), dDc, DOT)
        tl.store(dd_tile, dvb, mask=mtv)
        dbeta += tl.sum(v_in.to(tl.float32) * dvb, axis=1)
        tl.store(dv + i_b * sdv_b + i_h * sdv_h + rows[:, None] * sdv_t + cv[None, :],
                 (bc[:, None] * dvb).to(dv.dtype.element_ty), mask=mtv)
    # q, k as loaded (input dtype) go into the products (see mm). With L2NORM they stand for
    # their normalised rows (rq, rk: 1 / norms, folded into the per-token factors).
    # O = (e^G Q) S0 + P D, P = (Q K^T) * Gamma (Q scaled): dg_u gathers every term whose decay
    # factor spans token u; here the pairs' (e^{G_t - G_s}: s < u <= t).
    q_in = tl.load(q + i_b * sq_b + i_hk * sq_h + rows[:, None] * sq_t + ck[None, :], mask=mtk,
                   other=0.0)
    k_in = tl.load(k + i_b * sk_b + i_hk * sk_h + rows[:, None] * sk_t + ck[None, :], mask=mtk,
                   other=0.0)
    rq, rk = _load_norms(norm_buf, buf_rows, mt, BT, L2NORM)
    gq, gc, g_last = _load_gates(gc_buf, buf_rows, mt)
    gamma = _decays(gq, r, False)
    P = mm(q_in, tl.trans(k_in), DOT) * (scale * gamma) * (rq[:, None] * rk[None, :])
    pairs = dP * P
    # dA = -T^T (dW W^T + dU U^T), and dW W^T + dU U^T = dD D^T: W S0 = U - D, so
    # dW W^T = -dD S0^T W^T = -dD (U - D)^T (no W, no U, no two products that cancel).
    dA = -mm(tl.trans(Tinv), dDD, DOT)
    dA = tl.where(r[:, None] > r[None, :], dA, 0.0)
    gamma_lower = tl.where(r[:, None] > r[None, :], gamma, 0.0)  # (the same values)
    KK = mm(k_in, tl.trans(k_in), DOT) * (rk[:, None] * rk[None, :])
    dKK = dA * gamma_lower * bc[:, None]  # A = beta KK Gamma (strictly lower)
    tl.store(pair_buf + pair_tile, _pack_pairs(dP * gamma, dKK, r), mask=mt[:, None])
    dbeta += tl.sum(dA * gamma_lower * KK, axis=1)
    pairs += dKK * KK  # dA * A
    pairs = tl.where(r[:, None] > r[None, :], pairs, 0.0)
    # dg_u = sum over t >= u, s < u of pairs[t, s] = below[u - 1], below[v] = sum over t > v of
    # the row prefix sums over s <= v (fp32 scans, no product; no inclusive-minus-own difference
    # that would lose a small prefix beside a large term)
    prefix = tl.cumsum(pairs, 1)
    below = tl.sum(tl.where(r[:, None] > r[None, :], prefix, 0.0), axis=0)
    tl.store(dbeta_buf + buf_rows, dbeta, mask=mt)
    # below[u - 1] lands on token u by the store's row (one token on), the chunk's first token
    # takes 0 (no s < u): no [BT, BT] tile to shift it
    tl.store(dg_buf + buf_rows + HV, below, mask=rows + 1 < end)
    tl.store(dg_buf + (i_b * T + start) * HV + i_h, 0.0)


@triton.jit
def _state_products(do_rows, d_buf, dd_buf, h_buf, dh_buf, buf_rows, mt, state0, ck, mk, V,
                    BT: tl.constexpr, BK: tl.constexpr, BVA: tl.constexpr, DOT: tl.constexpr):
    """The backward's sums over the value columns (blocks of BVA) for key columns ck of one
    chunk: dO S0^T, D dS^T, -(T^T dD) S0^T as [BT, BK] fp32, and <dS, S0> (bwd_chunk_kernel's
    value loop). do_rows: the chunk's dO row pointers."""
    dQe = tl.zeros([BT, BK], dtype=tl.float32)
    dKd = tl.zeros([BT, BK], dtype=tl.float32)
    dkb = tl.zeros([BT, BK], dtype=tl.float32)
    x0 = tl.sum(tl.zeros([BT], dtype=tl.float32), axis=0)
    for v0 in range(0, V, BVA):
        cv = v0 + tl.arange(0, BVA)
        mv = cv < V
        mtv = mt[:, None] & mv[None, :]
        dO_in = tl.load(do_rows[:, None] + cv[None, :], mask=mtv, other=0.0)
        Dc = tl.load(d_buf + buf_rows[:, None] * V + cv[None, :], mask=mtv, other=0.0)
        dvb = tl.load(dd_buf + buf_rows[:, None] * V + cv[None, :], mask=mtv, other=0.0)
        state = state0 + ck[:, None] * V + cv[None, :]
        S0 = tl.load(h_buf + state, mask=mk[:, None] & mv[None, :], other=0.0)
        dS = tl.load(dh_buf + state, mask=mk[:, None] & mv[None, :], other=0.0)
        dQe += mm(dO_in, tl.trans(S0), DOT)
        dKd += mm(Dc, tl.trans(dS), DOT)
        dkb -= mm(dvb, tl.trans(S0), DOT)  # T^T dW, dW = -dD S0^T
        x0 += tl.sum(tl.sum(dS.to(tl.float32) * S0.to(tl.float32), axis=1), axis=0)
    return dQe, dKd, dkb, x0


@triton.jit
def bwd_chunk_kernel(
    q, k, beta, do, gc_buf, d_buf, dd_buf, pair_buf, h_buf, dh_buf, dq_buf, dk_buf,
    dbeta_buf, dg_buf, cu,
    sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sb_b, sb_t, sb_h, sd_b, sd_t, sd_h,
    scale, T, HV, GROUP: tl.constexpr, K, V, BT: tl.constexpr, BK: tl.constexpr,
    BVA: tl.constexpr, VARLEN: tl.constexpr, DOT: tl.constexpr, L2NORM: tl.constexpr,
):
    """The backward's per-chunk gradients, second half: dq, dk (per value head in fp32, or in
    their dtype without groups) whole, and dbeta, dg completed, from S0, dS (the gradient
    after the chunk) and bwd_pairs_kernel's outputs. The value columns go by in blocks of
    BVA, each adding into three [BT, K] sums (dO S0^T, D dS^T, (T^T dD) S0^T) and <dS, S0>."""
    i_c, i_n, i_h, i_b, start, end, bos = _chunk_program(cu, T, HV, BT, VARLEN, 0)
    if start >= end:
        return
    r = tl.arange(0, BT)
    rows = start + r
    mt = rows < end
    ck = tl.arange(0, BK)
    mk = ck < K
    mtk = mt[:, None] & mk[None, :]
    i_hk = i_h // GROUP
    buf_rows = (i_b * T + rows) * HV + i_h
    state0 = (chunk_slot(i_n, bos, i_c, BT, tl.cdiv(T, BT), VARLEN) * HV + i_h) * K * V
    do_rows = do + i_b * sd_b + i_h * sd_h + rows * sd_t
    dQe, dKd, dkb, x0 = _state_products(do_rows, d_buf, dd_buf, h_buf, dh_buf, buf_rows, mt,
                                        state0, ck, mk, V, BT, BK, BVA, DOT)
    q_in = tl.load(q + i_b * sq_b + i_hk * sq_h + rows[:, None] * sq_t + ck[None, :], mask=mtk,
                   other=0.0)
    k_in = tl.load(k + i_b * sk_b + i_hk * sk_h + rows[:, None] * sk_t + ck[None, :], mask=mtk,
                   other=0.0)
    rq, rk = inv_norms(q_in, BT, L2NORM), inv_norms(k_in, BT, L2NORM)
    bc = tl.load(beta + i_b * sb_b + i_h * sb_h + rows * sb_t, mask=mt, other=0.0).to(tl.float32)
    _, gc, g_last = _load_gates(gc_buf, buf_rows, mt)
    eg = tl.exp(gc)
    # S_end = e^{G_last} S0 + (e^{G_last - G} K)^T D: dg_u's own terms (factors e^{G_t},
    # t >= u) and tail terms (e^{G_last - G_s}, s < u); W = T (beta e^G K).
    dq = eg[:, None] * dQe
    own = scale * rq * tl.sum(q_in.to(tl.float32) * dq, axis=1)
    dk = tl.where(mt, tl.exp(_tail_sums(gc_buf + buf_rows + HV, rows, end)), 0.0)[:, None] * dKd
    tail = rk * tl.sum(k_in.to(tl.float32) * dk, axis=1)
    k_dkb = rk * tl.sum(k_in.to(tl.float32) * dkb, axis=1)
    dbeta = tl.load(dbeta_buf + buf_rows, mask=mt, other=0.0) + eg * k_dkb
    own += bc * eg * k_dkb
    dk += (bc * eg)[:, None] * dkb
    dQK, dKK2 = _unpack_pairs(pair_buf, buf_rows, mt, r, BT)
    dq += mm(dQK * rk[None, :], k_in, DOT)
    dk += scale * mm(tl.trans(dQK * rq[:, None]), q_in, DOT)
    dk += mm(dKK2 * rk[None, :], k_in, DOT)  # KK = K K^T: both factors
    dg = tl.load(dg_buf + buf_rows, mask=mt, other=0.0)
    # (own terms of t >= u and tail terms of t < u: every t gives one term, one sum)
    dg += tl.sum(tl.where(r[:, None] >= r[None, :], own[:, None], tail[:, None]), axis=0)
    dg += x0 * tl.exp(g_last)  # e^{G_last} S0: every u
    dq = dq * scale
    if L2NORM:  # (linear in dq, dk: a group's value heads may still be summed after)
        dq = _l2norm_grad(q_in, rq, dq)
        dk = _l2norm_grad(k_in, rk, dk)
    out_k = buf_rows[:, None] * K + ck[None, :]
    tl.store(dq_buf + out_k, dq.to(dq_buf.dtype.element_ty), mask=mtk)
    tl.store(dk_buf + out_k, dk.to(dk_buf.dtype.element_ty), mask=mtk)
    tl.store(dbeta_buf + buf_rows, dbeta, mask=mt)
    tl.store(dg_buf + buf_rows, dg, mask=mt)
