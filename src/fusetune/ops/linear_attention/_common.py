"""What the linear-attention kernels share (gated slot attention's and the gated delta rule's):
sequence bounds of (packed) sequences, GSA's matmul precision modes, gate loads and state
load/store helpers, the host view of [B, T, H, ...] strides, and the error for head sizes a GPU
cannot hold."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from fusetune._triton import INTERPRET, OutOfResources, dot, tl, triton
from fusetune._utils import next_power_of_2

# ----------------------------------------------------------------------------- device helpers


@triton.jit
def sequence_bounds(cu_ptr, i_n, T, VARLEN: tl.constexpr):
    """(batch index, first token, end token) of sequence ``i_n``; packed offsets are clamped
    into [0, T] so that a bad cu_seqlens on the GPU (not value-checked there: that needs a host
    sync) never reads out of bounds."""
    i_b = i_n
    bos = i_n * 0
    eos = bos + T
    if VARLEN:
        i_b = i_n * 0
        bos = tl.minimum(tl.maximum(tl.load(cu_ptr + i_n).to(tl.int64), 0), eos)
        eos = tl.minimum(tl.maximum(tl.load(cu_ptr + i_n + 1).to(tl.int64), bos), eos)
    return i_b, bos, eos


@triton.jit
def chunk_slot(i_n, bos, c, S: tl.constexpr, per_row, VARLEN: tl.constexpr):
    """Index of chunk ``c`` (of S tokens) of sequence ``i_n`` in the per-chunk buffers (states,
    checkpoints). Packed sequences never overlap: sequence n owns slots [bos // S + n, ...) and
    needs at most cdiv(length, S) of them (``slot_count``); else batch row n owns ``per_row``
    = cdiv(T, S) slots."""
    if VARLEN:
        return bos // S + i_n + c
    else:
        return i_n * per_row + c


# GSA's matmul precision, from the inputs' dtype; accumulation is fp32 always. Products of two
# input tiles (q k^T, do v^T) take the inputs as they are: bf16/fp16 tensor cores with fp32
# accumulation lose nothing there. Products with a computed fp32 operand (states, decayed slot
# weights, probabilities, da, the scores' blocks) keep both operands in fp32 (fp32's range, so a
# state past 65504 never overflows) and run at:
# - fp32 inputs: IEEE (tf32 would miss the 1e-5 contract);
# - fp16 inputs: ``COMPUTED_DOT``, 3xTF32 by default (three tf32 tensor-core products of each
#   operand split into a tf32 head and its remainder: about fp32's accuracy, still on tensor
#   cores). It was tf32, whose 10-bit mantissa is fp16's own: rounding everything that feeds the
#   chunk states, ds and the reverse cumsum behind dg (which cancels heavily) cost, on the H100,
#   1.3-1.5e-2 on dg and 1.5-1.8e-3 on o, dq, dk, dv against ~2e-4 for recurrent mode (issue 20,
#   item 4). FUSETUNE_GSA_DOT=ieee|tf32 (read at import) picks another, for measuring
#   (tools/gsa_precision.py issue) or as a way out should 3xTF32 fault on some Triton;
# - bf16 inputs: tf32. Its rounding (2^-11) is 4x finer than bf16's own (2^-8), so it stays below
#   what bf16 outputs and gradients round to, and bf16 (the training dtype) keeps its speed.
DOT_BF16, DOT_FP16, DOT_FP32 = 0, 1, 2
COMPUTED_DOTS = ("tf32x3", "ieee", "tf32")


def _computed_dot() -> str:
    mode = os.environ.get("FUSETUNE_GSA_DOT", "tf32x3")
    if mode not in COMPUTED_DOTS:
        raise ValueError(f"FUSETUNE_GSA_DOT must be one of {COMPUTED_DOTS}, got {mode!r}")
    return mode


COMPUTED_DOT = tl.constexpr(_computed_dot())
# Gates below this act as this: exp(-88) ~ 6e-39 is 0 to fp32, and clamping keeps the chunk
# cumsums finite (an exact -inf gate would give inf - inf inside a chunk).
GATE_FLOOR = -88.0
# The GSA kernels hold [K, M] and [M, V] states in registers.
MAX_DIM = 256
UPCAST = INTERPRET


def dot_mode(dtype: torch.dtype) -> int:
    return {torch.bfloat16: DOT_BF16, torch.float16: DOT_FP16}.get(dtype, DOT_FP32)


@triton.jit
def mm_inputs(a, b, DOT: tl.constexpr, UPCAST: tl.constexpr):
    """``a @ b`` (fp32) of two tiles holding input values: exact in the input dtype."""
    if DOT == 0:
        return dot(a.to(tl.bfloat16), b.to(tl.bfloat16), None, UPCAST)
    elif DOT == 1:
        return tl.dot(a.to(tl.float16), b.to(tl.float16))
    else:
        return tl.dot(a, b, input_precision="ieee")


@triton.jit
def mm(a, b, DOT: tl.constexpr, UPCAST: tl.constexpr):
    """``a @ b`` (fp32) with a computed fp32 operand (an input tile is widened): IEEE for fp32
    inputs, COMPUTED_DOT (3xTF32) for fp16, tf32 for bf16 (see the comment above DOT_BF16)."""
    if DOT == 2:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif DOT == 1:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=COMPUTED_DOT)
    else:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="tf32")


@triton.jit
def load_gate(ptr, mask):
    """Log gates as fp32, floored at GATE_FLOOR (-88), 0 outside the mask."""
    return tl.maximum(tl.load(ptr, mask=mask, other=0.0).to(tl.float32), -88.0)


@triton.jit
def gate_sums(gate):
    """The chunk-local cumsum of a chunk's log gates (tokens along axis 0) and their total (the
    decay across the whole chunk): fp32, every kernel of a chunk sees the same values."""
    return tl.cumsum(gate, axis=0), tl.sum(gate, axis=0)


@triton.jit
def load_hk(buf, state, ck, cm, mk, mm_, K, M):
    """Key state ``state`` of a [N, K, M] buffer (rows ck, columns cm) as fp32, 0 outside."""
    return tl.load(buf + state * K * M + ck[:, None] * M + cm[None, :],
                   mask=mk[:, None] & mm_[None, :], other=0.0).to(tl.float32)


@triton.jit
def load_hv(buf, state, cv, cm, mv, mm_, V, M):
    """Value state ``state`` of a [N, M, V] buffer (rows cm, columns cv) as fp32, 0 outside."""
    return tl.load(buf + state * M * V + cm[:, None] * V + cv[None, :],
                   mask=mm_[:, None] & mv[None, :], other=0.0).to(tl.float32)


@triton.jit
def store_states(hk_buf, hv_buf, state, hk, hv, ck, cv, cm, mk, mv, mm_, K, V, M):
    """Both states (or state gradients) into [N, K, M] and [N, M, V] buffers."""
    tl.store(hk_buf + state * K * M + ck[:, None] * M + cm[None, :], hk,
             mask=mk[:, None] & mm_[None, :])
    tl.store(hv_buf + state * M * V + cm[:, None] * V + cv[None, :], hv,
             mask=mm_[:, None] & mv[None, :])


# ----------------------------------------------------------------------------- host helpers


@dataclass(frozen=True)
class Geometry:
    """GSA's sizes and launch constants of one call. Kernels index every [B, T, H, D]-like
    tensor as ``b * stride_b + t * stride_t + h * stride_h + d`` (unit last stride), which
    covers both layouts and strided views."""

    n_seq: int
    seq_len: int
    q_heads: int
    group: int
    key_dim: int
    value_dim: int
    slots: int
    scale: float
    dot: int
    varlen: bool

    @property
    def blocks(self) -> dict[str, int]:
        return dict(
            BK=max(16, next_power_of_2(self.key_dim)),
            BV=max(16, next_power_of_2(self.value_dim)),
            BM=max(16, next_power_of_2(self.slots)),
        )

    def sizes(self) -> tuple:
        return (self.seq_len, self.q_heads, self.group, self.key_dim, self.value_dim, self.slots)


def slot_count(per_row: int, n_seq: int, varlen: bool) -> int:
    """Slots of a per-chunk buffer (see ``chunk_slot``): T // S + N + 1 for packed sequences
    (``per_row`` = cdiv(T, S)), else N * per_row."""
    return per_row + n_seq + 1 if varlen else n_seq * per_row


def bth_strides(tensor: torch.Tensor) -> tuple[int, int, int]:
    """(stride_b, stride_t, stride_h) of a [B, T, H, ...] tensor."""
    return tensor.stride(0), tensor.stride(1), tensor.stride(2)


def bthd_strides(tensor: torch.Tensor, layout: str) -> tuple[int, int, int]:
    """(stride_b, stride_t, stride_h) of a 4-D tensor in ``layout`` ("BTHD" or "BHTD")."""
    sb, s1, s2, _ = tensor.stride()
    return (sb, s1, s2) if layout == "BTHD" else (sb, s2, s1)


def unit_last_stride(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.stride(-1) == 1 else tensor.contiguous()


# ----------------------------------------------------------------------------- resource errors

_ADVICE = {
    "chunk": "mode='recurrent' holds less on chip, or split the heads into smaller ones",
    "recurrent": "split the heads into smaller ones",
}


def explain_out_of_resources(
    impl: Callable, op: str, heads: Callable[[tuple], str], chunked_at: int = -1
) -> Callable:
    """``impl`` (an op's forward or backward; its argument at ``chunked_at`` is the flag
    ``chunked``) with Triton's OutOfResources, raised when a kernel needs more shared memory
    than the GPU has, turned into a ValueError that names the op, the mode and the head sizes
    (``heads(args)``): the block sizes follow K, V (and M), so the sizes a GPU holds differ by
    GPU (H100: 227 KB a block, A100: 163 KB, consumer parts ~100 KB)."""

    @functools.wraps(impl)
    def run(*args):
        try:
            return impl(*args)
        except OutOfResources as error:
            mode = "chunk" if args[chunked_at] else "recurrent"
            raise ValueError(
                f"{op}(mode={mode!r}) at {heads(args)}: a kernel needs {error.required} of "
                f"{error.name} and this GPU has {error.limit}; {_ADVICE[mode]}"
            ) from error

    return run
