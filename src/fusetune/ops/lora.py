"""LoRA projections with a hand-written backward: lora_linear, lora_qkv and the LoRA MLP.

    y = x W^T + s (x A^T) B^T        W [out, in] frozen, A [r, in], B [out, r] trained

Matmuls are cuBLAS (torch.mm / addmm); the base weight never gets a gradient. Per projection:
  forward   xa = x A^T (saved),  y = x W^T,  y += xa (s B)^T (in place, rank r)
  backward  g = dy (s B),  dB = s dy^T xa,  dA = g^T x,  dx = dy W + g A
so one big matmul each way (the floor: x W^T and dy W) and four thin ones; g serves dA and dx,
and work for an input that does not require grad is skipped. lora_qkv does q, k and v with one
x A^T for the three adapters (A's stacked) and one summed dx.

The MLP  y = down(act(gate(x)) * up(x))  adds a Triton kernel on each side:
  forward   gate0 = x Wg^T, up0 = x Wu^T (saved, without their LoRA terms); the kernel adds
            s xa_g Bg^T and s xa_u Bu^T tile by tile, applies the activation and writes h; then
            xa_d = h Ad^T and y = h Wd^T + s xa_d Bd^T. h is not saved.
  backward  dh0 = dy Wd, g_d = dy Bd; the kernel recomputes gate, up, dh (each with its LoRA
            term) and h, writes dgate and dup over gate0 and up0 (in place: no new memory), and
            reduces dAd = s g_d^T h, dBg = s dgate^T xa_g, dBu = s dup^T xa_u over its rows in
            fp32, so h, dh and the LoRA-added gate and up never exist in memory. Then
            g = [dgate Bg, dup Bu], dA = s g^T x, dx = dgate Wg + dup Wu + s g A.
Saved for backward: x, gate0, up0 and the three thin xa; PEFT also keeps h, act(gate), the
LoRA-added gate and up and the dropout inputs.

Precision: every matmul in one compute dtype (the autocast dtype under torch.autocast, else by
the rule of :mod:`fusetune.reference.lora`), fp32 accumulation; the kernels work in fp32 and
round once on store. Gradients come back in each input's dtype.

A base weight may be a bitsandbytes 4-bit weight (QLoRA): it is dequantised by a Triton kernel
(:mod:`fusetune.ops.quant4`) into a fresh buffer where the dense weight would be read (x W^T in
the forward, dy W in the backward) and never kept; it stands for its dense twin exactly.

Layout: kernels, host launchers, registered ops (for torch.compile), autograd Functions, public
functions.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from fusetune import _utils
from fusetune._triton import INTERPRET, OutOfResources, dot, tl, triton
from fusetune.ops import activation as glu_ops
from fusetune.ops import quant4
from fusetune.ops.activation import ACTIVATIONS as GLU_ACTIVATIONS
from fusetune.ops.activation import _activation
from fusetune.reference import lora as reference
from fusetune.reference.lora import Projection

# lora_mlp's activation names -> the activation kernels' names and codes.
_GLU_NAMES = {"swiglu": "silu", "geglu": "gelu", "geglu_tanh": "gelu_tanh"}
ACTIVATION_CODES = {name: GLU_ACTIVATIONS[glu] for name, glu in _GLU_NAMES.items()}

# ============================================================================ kernels


@triton.jit
def _mm(a, b, acc, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """``acc + a @ b`` in fp32. fp32 compute dtype: IEEE fp32 products (as torch's default
    matmul). 16-bit: operands that share the 16-bit dtype go to tensor cores as they are (as
    cuBLAS would); a computed fp32 operand makes it a tf32 product (finer than rounding it)."""
    if IEEE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    elif a.dtype == b.dtype:
        return dot(a, b, acc, UPCAST)
    else:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="tf32")


@triton.jit
def _thin(ptr, stride, rows, row_mask, rank, R: tl.constexpr, TRANSPOSED: tl.constexpr):
    """Rows ``rows`` of a thin [n, rank] matrix (unit column stride), zero-padded to R columns:
    a [BM, R] tile, or its [R, BM] transpose."""
    ks = tl.arange(0, R)
    if TRANSPOSED:
        offsets = rows.to(tl.int64)[None, :] * stride + ks[:, None]
        mask = (ks < rank)[:, None] & row_mask[None, :]
    else:
        offsets = rows.to(tl.int64)[:, None] * stride + ks[None, :]
        mask = row_mask[:, None] & (ks < rank)[None, :]
    return tl.load(ptr + offsets, mask=mask, other=0.0)


@triton.jit
def _wide(ptr, stride, cols, col_mask, rank, R: tl.constexpr, TRANSPOSED: tl.constexpr):
    """Columns ``cols`` of an [rank, n] matrix as an [R, BN] tile, zero-padded; with TRANSPOSED
    the matrix is stored as its [n, rank] transpose (LoRA B) and ``stride`` is its row stride."""
    ks = tl.arange(0, R)
    if TRANSPOSED:
        offsets = cols.to(tl.int64)[None, :] * stride + ks[:, None]
    else:
        offsets = ks[:, None].to(tl.int64) * stride + cols[None, :]
    mask = (ks < rank)[:, None] & col_mask[None, :]
    return tl.load(ptr + offsets, mask=mask, other=0.0)


@triton.jit
def _tile(ptr, stride, rows, cols, mask):
    offsets = rows.to(tl.int64)[:, None] * stride + cols[None, :]
    return tl.load(ptr + offsets, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _lora_glu_forward_kernel(
    gate_ptr, up_ptr, xa_gate_ptr, xa_up_ptr, b_gate_ptr, b_up_ptr, out_ptr, s_gate, s_up,
    n_rows, n_cols, rank_gate, rank_up, gate_stride, up_stride, xa_gate_stride, xa_up_stride,
    b_gate_stride, b_up_stride, out_stride,
    ACTIVATION: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr, R: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr,
):
    """out = act(gate + s_gate xa_gate B_gate^T) * (up + s_up xa_up B_up^T), one [BM, BN] tile
    per program."""
    col_tiles = tl.cdiv(n_cols, BN)
    pid = tl.program_id(0)
    rows = (pid // col_tiles) * BM + tl.arange(0, BM)
    cols = (pid % col_tiles) * BN + tl.arange(0, BN)
    row_mask, col_mask = rows < n_rows, cols < n_cols
    mask = row_mask[:, None] & col_mask[None, :]
    zero = tl.zeros((BM, BN), dtype=tl.float32)

    xa_gate = _thin(xa_gate_ptr, xa_gate_stride, rows, row_mask, rank_gate, R, False)
    b_gate = _wide(b_gate_ptr, b_gate_stride, cols, col_mask, rank_gate, R, True)
    gate = _tile(gate_ptr, gate_stride, rows, cols, mask)
    gate += s_gate * _mm(xa_gate, b_gate, zero, IEEE, UPCAST)
    xa_up = _thin(xa_up_ptr, xa_up_stride, rows, row_mask, rank_up, R, False)
    b_up = _wide(b_up_ptr, b_up_stride, cols, col_mask, rank_up, R, True)
    up = _tile(up_ptr, up_stride, rows, cols, mask)
    up += s_up * _mm(xa_up, b_up, zero, IEEE, UPCAST)

    value, _ = _activation(gate, ACTIVATION)
    out_offsets = rows.to(tl.int64)[:, None] * out_stride + cols[None, :]
    tl.store(out_ptr + out_offsets, (value * up).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _lora_glu_backward_kernel(
    grad_h_ptr, g_down_ptr, a_down_ptr, s_down,
    gate_ptr, up_ptr, xa_gate_ptr, xa_up_ptr, b_gate_ptr, b_up_ptr, s_gate, s_up,
    grad_gate_ptr, grad_up_ptr, part_a_down_ptr, part_b_gate_ptr, part_b_up_ptr,
    n_rows, n_cols, rows_per_split, rank_down, rank_gate, rank_up,
    grad_h_stride, g_down_stride, a_down_stride, gate_stride, up_stride, xa_gate_stride,
    xa_up_stride, b_gate_stride, b_up_stride, grad_gate_stride, grad_up_stride,
    ACTIVATION: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr, R: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr,
):
    """One program: BN columns x one split of the rows, walked BM rows at a time.

    Recomputes gate, up (with their LoRA terms), dh = grad_h + s_down g_down A_down and
    h = act(gate) * up; stores dgate, dup (which may alias gate and up: each element is read
    before this program writes it); and sums over its rows, in fp32,
    g_down^T h, xa_gate^T dgate and xa_up^T dup, stored scaled as [split, rank, column]."""
    cols = tl.program_id(0) * BN + tl.arange(0, BN)
    split = tl.program_id(1)
    col_mask = cols < n_cols
    row_start = split * rows_per_split
    row_stop = tl.minimum(row_start + rows_per_split, n_rows)
    zero = tl.zeros((BM, BN), dtype=tl.float32)

    b_gate = _wide(b_gate_ptr, b_gate_stride, cols, col_mask, rank_gate, R, True)
    b_up = _wide(b_up_ptr, b_up_stride, cols, col_mask, rank_up, R, True)
    a_down = _wide(a_down_ptr, a_down_stride, cols, col_mask, rank_down, R, False)
    acc_a_down = tl.zeros((R, BN), dtype=tl.float32)
    acc_b_gate = tl.zeros((R, BN), dtype=tl.float32)
    acc_b_up = tl.zeros((R, BN), dtype=tl.float32)
    for row0 in range(row_start, row_stop, BM):
        rows = row0 + tl.arange(0, BM)
        row_mask = rows < row_stop
        mask = row_mask[:, None] & col_mask[None, :]

        xa_gate = _thin(xa_gate_ptr, xa_gate_stride, rows, row_mask, rank_gate, R, False)
        gate = _tile(gate_ptr, gate_stride, rows, cols, mask)
        gate += s_gate * _mm(xa_gate, b_gate, zero, IEEE, UPCAST)
        xa_up = _thin(xa_up_ptr, xa_up_stride, rows, row_mask, rank_up, R, False)
        up = _tile(up_ptr, up_stride, rows, cols, mask)
        up += s_up * _mm(xa_up, b_up, zero, IEEE, UPCAST)
        g_down = _thin(g_down_ptr, g_down_stride, rows, row_mask, rank_down, R, False)
        grad_h = _tile(grad_h_ptr, grad_h_stride, rows, cols, mask)
        grad_h += s_down * _mm(g_down, a_down, zero, IEEE, UPCAST)

        value, derivative = _activation(gate, ACTIVATION)
        grad_gate = grad_h * up * derivative
        grad_up = grad_h * value
        offsets = rows.to(tl.int64)[:, None] * grad_gate_stride + cols[None, :]
        tl.store(grad_gate_ptr + offsets, grad_gate.to(grad_gate_ptr.dtype.element_ty), mask=mask)
        offsets = rows.to(tl.int64)[:, None] * grad_up_stride + cols[None, :]
        tl.store(grad_up_ptr + offsets, grad_up.to(grad_up_ptr.dtype.element_ty), mask=mask)

        g_down_t = _thin(g_down_ptr, g_down_stride, rows, row_mask, rank_down, R, True)
        acc_a_down = _mm(g_down_t, value * up, acc_a_down, IEEE, UPCAST)
        xa_gate_t = _thin(xa_gate_ptr, xa_gate_stride, rows, row_mask, rank_gate, R, True)
        acc_b_gate = _mm(xa_gate_t, grad_gate, acc_b_gate, IEEE, UPCAST)
        xa_up_t = _thin(xa_up_ptr, xa_up_stride, rows, row_mask, rank_up, R, True)
        acc_b_up = _mm(xa_up_t, grad_up, acc_b_up, IEEE, UPCAST)

    _store_partial(part_a_down_ptr, split, rank_down, n_cols, cols, col_mask,
                   s_down * acc_a_down, R)
    _store_partial(part_b_gate_ptr, split, rank_gate, n_cols, cols, col_mask,
                   s_gate * acc_b_gate, R)
    _store_partial(part_b_up_ptr, split, rank_up, n_cols, cols, col_mask, s_up * acc_b_up, R)


@triton.jit
def _store_partial(ptr, split, rank, n_cols, cols, col_mask, values, R: tl.constexpr):
    """values [R, BN] into the fp32 [splits, rank, n_cols] buffer at ``split``."""
    ks = tl.arange(0, R)
    offsets = (split * rank + ks[:, None]).to(tl.int64) * n_cols + cols[None, :]
    tl.store(ptr + offsets, values, mask=(ks < rank)[:, None] & col_mask[None, :])


# ============================================================================ host launchers

# Tiles (measured on an H100, NOTES.md). Forward: one [BM, BN] tile per program. Backward: BN
# columns per program, rows in BM steps, the rows split so that about BACKWARD_PROGRAMS_PER_SM
# programs per SM run (the column sums of each split are added on the host, deterministically).
FORWARD_BM, FORWARD_BN, FORWARD_WARPS = 32, 128, 4
BACKWARD_BM, BACKWARD_BN, BACKWARD_WARPS = 32, 64, 4
BACKWARD_PROGRAMS_PER_SM = 4


def _padded_rank(*ranks: int) -> int:
    return max(16, _utils.next_power_of_2(max(ranks)))


# (kernel, padded rank, dtype, device) launches that did not fit: not tried again
_OVERSIZED: set[tuple[str, int, torch.dtype, torch.device]] = set()


def _launch_glu(kernel, grid, ranks: tuple[int, ...], *args, **kwargs) -> bool:
    """``kernel[grid](*args, **kwargs)``: True when it ran, False (with one warning per kernel,
    rank and dtype) when it needs more shared memory than the GPU has. The GLU kernels hold
    rank-wide tiles: the backward needs 122880 bytes at ranks up to 64, 196608 up to 128 and
    344064 up to 256 (Triton 3.6, sm_90), so ranks up to 128 fit an H100 (232448) and up to 64
    an A100; above that the caller runs the adapter products as separate matmuls
    (_unfused_*)."""
    key = (getattr(kernel, "__name__", repr(kernel)), kwargs["R"], args[0].dtype, args[0].device)
    if key in _OVERSIZED:
        return False
    try:
        kernel[grid](*args, **kwargs)
        return True
    except OutOfResources as error:
        _OVERSIZED.add(key)
        warnings.warn(
            f"lora_mlp: LoRA ranks {ranks} need {error.required} bytes of {error.name} in the "
            f"fused GLU kernel and this GPU has {error.limit}; their adapter products run as "
            "separate matmuls, slower, with gate and up rounded once more (up to rank 128 on "
            "an H100, 64 on an A100 stay fused)",
            stacklevel=2,
        )
        return False


def _with_adapters(gate, up, xa_gate, xa_up, b_gate, b_up, s_gate, s_up):
    """gate + s_gate xa_gate b_gate^T and up + s_up xa_up b_up^T, new tensors in gate's dtype."""
    dtype = gate.dtype
    return (torch.addmm(gate, _cast(xa_gate, dtype), _cast(b_gate, dtype).t(), alpha=s_gate),
            torch.addmm(up, _cast(xa_up, dtype), _cast(b_up, dtype).t(), alpha=s_up))  # fmt: skip


def _unfused_glu_forward(gate, up, xa_gate, xa_up, b_gate, b_up, s_gate, s_up, activation):
    """_glu_forward's result for ranks the fused kernel cannot hold."""
    gate, up = _with_adapters(gate, up, xa_gate, xa_up, b_gate, b_up, s_gate, s_up)
    return glu_ops._forward(gate, up, _GLU_NAMES[activation])


def _unfused_glu_backward(grad_h, g_down, a_down, s_down, gate, up, xa_gate, xa_up, b_gate,
                          b_up, s_gate, s_up, activation, grad_gate, grad_up):
    """_glu_backward's results for ranks the fused kernels cannot hold: the activation's
    backward kernel on the LoRA-added gate / up and dh, the adapter sums as fp32 matmuls."""
    gate_l, up_l = _with_adapters(gate, up, xa_gate, xa_up, b_gate, b_up, s_gate, s_up)
    dh = torch.addmm(grad_h, _cast(g_down, grad_h.dtype), _cast(a_down, grad_h.dtype),
                     alpha=s_down)  # fmt: skip
    h = torch.empty_like(gate_l)
    glu_ops._backward(dh, gate_l, up_l, h, grad_gate, grad_up, _GLU_NAMES[activation], True)
    del gate_l, up_l, dh

    def column_sums(thin, wide, scaling):  # scaling * thin^T wide, fp32 [rank, I]
        return torch.mm(thin.t().float(), wide.float()).mul_(scaling)

    return (column_sums(g_down, h, s_down), column_sums(xa_gate, grad_gate, s_gate),
            column_sums(xa_up, grad_up, s_up))  # fmt: skip


def _unit_columns(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _glu_forward(gate, up, xa_gate, xa_up, b_gate, b_up, s_gate, s_up, activation):
    """h = act(gate + s_gate xa_gate b_gate^T) * (up + s_up xa_up b_up^T), gate/up [N, I]."""
    n_rows, n_cols = gate.shape
    out = _utils.empty((n_rows, n_cols), gate.dtype, gate.device)
    if out.numel() == 0:
        return out
    gate, up, xa_gate, xa_up, b_gate, b_up = map(
        _unit_columns, (gate, up, xa_gate, xa_up, b_gate, b_up)
    )
    bm, bn = FORWARD_BM, FORWARD_BN
    grid = (_utils.cdiv(n_rows, bm) * _utils.cdiv(n_cols, bn),)
    launched = _launch_glu(
        _lora_glu_forward_kernel, grid, (xa_gate.shape[1], xa_up.shape[1]),
        gate, up, xa_gate, xa_up, b_gate, b_up, out, s_gate, s_up, n_rows, n_cols,
        xa_gate.shape[1], xa_up.shape[1], gate.stride(0), up.stride(0), xa_gate.stride(0),
        xa_up.stride(0), b_gate.stride(0), b_up.stride(0), out.stride(0),
        ACTIVATION=ACTIVATION_CODES[activation], IEEE=gate.dtype == torch.float32,
        UPCAST=INTERPRET, R=_padded_rank(xa_gate.shape[1], xa_up.shape[1]), BM=bm, BN=bn,
        num_warps=FORWARD_WARPS,
    )
    if not launched:
        return _unfused_glu_forward(gate, up, xa_gate, xa_up, b_gate, b_up, s_gate, s_up,
                                    activation)  # fmt: skip
    return out


def _row_split(n_rows: int, n_cols: int, device: torch.device) -> int:
    """Rows per backward program (a multiple of BACKWARD_BM)."""
    col_tiles = _utils.cdiv(n_cols, BACKWARD_BN)
    target = BACKWARD_PROGRAMS_PER_SM * _utils.num_programs_in_flight(device)
    splits = max(1, min(_utils.cdiv(n_rows, BACKWARD_BM), round(target / col_tiles)))
    return _utils.cdiv(_utils.cdiv(n_rows, splits), BACKWARD_BM) * BACKWARD_BM


def _glu_backward(grad_h, g_down, a_down, s_down, gate, up, xa_gate, xa_up, b_gate, b_up,
                  s_gate, s_up, activation, grad_gate, grad_up):
    """Fill grad_gate, grad_up [N, I] (either may be gate / up themselves: in place) and return
    fp32 (s_down g_down^T h [r_d, I], s_gate xa_gate^T dgate [r_g, I], s_up xa_up^T dup)."""
    n_rows, n_cols = gate.shape
    ranks = (g_down.shape[1], xa_gate.shape[1], xa_up.shape[1])
    device = gate.device
    rows_per_split = _row_split(n_rows, n_cols, device) if n_rows else 1
    splits = max(1, _utils.cdiv(n_rows, rows_per_split))
    if not (n_rows and n_cols):  # no launch: the sums over no rows are zeros
        return tuple(torch.zeros((r, n_cols), dtype=torch.float32, device=device) for r in ranks)
    # Not zero-filled (a fill launch less each): the kernel stores every element, each program
    # its split's sums for all ranks and its columns. (Tests poison them with NaN.)
    parts = [_utils.empty((splits, r, n_cols), torch.float32, device) for r in ranks]
    grad_h, g_down, a_down, xa_gate, xa_up, b_gate, b_up = map(
        _unit_columns, (grad_h, g_down, a_down, xa_gate, xa_up, b_gate, b_up)
    )
    grid = (_utils.cdiv(n_cols, BACKWARD_BN), splits)
    launched = _launch_glu(
        _lora_glu_backward_kernel, grid, ranks,
        grad_h, g_down, a_down, s_down, gate, up, xa_gate, xa_up, b_gate, b_up, s_gate, s_up,
        grad_gate, grad_up, *parts, n_rows, n_cols, rows_per_split, *ranks,
        grad_h.stride(0), g_down.stride(0), a_down.stride(0), gate.stride(0), up.stride(0),
        xa_gate.stride(0), xa_up.stride(0), b_gate.stride(0), b_up.stride(0),
        grad_gate.stride(0), grad_up.stride(0),
        ACTIVATION=ACTIVATION_CODES[activation], IEEE=gate.dtype == torch.float32,
        UPCAST=INTERPRET, R=_padded_rank(*ranks), BM=BACKWARD_BM, BN=BACKWARD_BN,
        num_warps=BACKWARD_WARPS,
    )
    if not launched:
        return _unfused_glu_backward(grad_h, g_down, a_down, s_down, gate, up, xa_gate, xa_up,
                                     b_gate, b_up, s_gate, s_up, activation, grad_gate, grad_up)
    return tuple(part.sum(0) if splits > 1 else part[0] for part in parts)


# ============================================================================ custom ops

_FORWARD_ARGS = (
    "Tensor gate, Tensor up, Tensor xa_gate, Tensor xa_up, Tensor b_gate, Tensor b_up, "
    "float s_gate, float s_up, str activation"
)


@_utils.register_op(
    f"lora_glu_forward({_FORWARD_ARGS}) -> Tensor",
    fake=lambda gate, *rest: gate.new_empty(gate.shape),
)
def _glu_forward_op(gate, up, xa_gate, xa_up, b_gate, b_up, s_gate, s_up, activation):
    return _glu_forward(gate, up, xa_gate, xa_up, b_gate, b_up, s_gate, s_up, activation)


def _fake_glu_backward(grad_h, g_down, a_down, s_down, gate, up, xa_gate, xa_up, *rest):
    n_cols = gate.shape[1]
    return (
        gate.new_empty(gate.shape),
        up.new_empty(up.shape),
        *(gate.new_empty((t.shape[1], n_cols), dtype=torch.float32)
          for t in (g_down, xa_gate, xa_up)),
    )


@_utils.register_op(
    "lora_glu_backward(Tensor grad_h, Tensor g_down, Tensor a_down, float s_down, "
    f"{_FORWARD_ARGS}) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
    fake=_fake_glu_backward,
)
def _glu_backward_op(grad_h, g_down, a_down, s_down, gate, up, xa_gate, xa_up, b_gate, b_up,
                     s_gate, s_up, activation):
    """The functional twin of the eager in-place backward: (dgate, dup, and the three column
    sums) in new buffers. Traced code (torch.compile) uses it; Inductor frees gate and up after
    their last use."""
    grad_gate = _utils.empty(gate.shape, gate.dtype, gate.device)
    grad_up = _utils.empty(up.shape, up.dtype, up.device)
    sums = _glu_backward(grad_h, g_down, a_down, s_down, gate, up, xa_gate, xa_up, b_gate, b_up,
                         s_gate, s_up, activation, grad_gate, grad_up)
    return (grad_gate, grad_up, *sums)


# ============================================================================ autograd


# Host time: a step is host-bound on the GPU (Llama-3.2-1B LoRA under FSDP2: issuing it takes as
# long as running it), so these helpers skip calls that do nothing: a cast to the dtype a tensor
# has (_utils.cast; quant4.dense of a weight already dense in that dtype), the default alpha of
# addmm, the slice or split of a single projection's columns (all of them).


_cast = _utils.cast
_dense = quant4.dense


def _add_mm(acc, a, b, alpha, eager: bool):
    """acc += alpha * a @ b in place, acc returned (acc: a fresh buffer of ours, with no other
    use). Eager: addmm_ itself (alpha 1 is its default and not passed: a keyword costs a parse
    per call). Traced: the mutable op fusetune::lora_add_mm_, which Inductor runs in place on
    acc's buffer. A functional addmm there became Inductor's addmm into a new buffer, and ATen's
    addmm with an output other than its input first copies the input into it: a device-to-device
    copy of every LoRA projection's output and of dx's partial sums."""
    if not eager:
        _add_mm_op(acc, a, b, alpha)
        return acc
    return acc.addmm_(a, b) if alpha == 1 else acc.addmm_(a, b, alpha=alpha)


@_utils.register_op("lora_add_mm_(Tensor(a!) acc, Tensor a, Tensor b, float alpha) -> ()",
                    fake=lambda acc, a, b, alpha: None)
def _add_mm_op(acc, a, b, alpha):
    acc.addmm_(a, b, alpha=alpha)


def _grad_to(grad: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor | None:
    return None if grad is None else _cast(grad, like.dtype)


def _transposed_grad(sum_t: torch.Tensor, like: torch.Tensor, wanted: bool):
    """B's gradient [out, r] from the kernel's fp32 [r, out] column sums: for a 16-bit B one
    copy that transposes and casts (the values of a transposing copy, then a cast)."""
    if not wanted:
        return None
    if sum_t.dtype == like.dtype:
        return sum_t.t().contiguous()
    return sum_t.t().to(like.dtype, memory_format=torch.contiguous_format)


def _scaled(t: torch.Tensor, scaling: float, like: torch.Tensor) -> torch.Tensor:
    """scaling * t in ``like``'s dtype, scaled in fp32 (t is a thin matmul result in the compute
    dtype: one rounding there, and only the final cast after it)."""
    return _cast(t.float() * scaling, like.dtype)


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dtype):
    return F.linear(x, _dense(weight, dtype), None if bias is None else _cast(bias, dtype))


def _scaled_b(lora_b: torch.Tensor, scaling: float, dtype: torch.dtype) -> torch.Tensor:
    """s B in the compute dtype (scaled at B's precision, rounded once): folding s into B
    leaves g = dy (s B) already scaled for dA and dx, so neither needs a scaled copy of A."""
    return _cast(lora_b * scaling, dtype)


def _thin_grads(xc, dys, xas, scaled_bs, scalings, lora_as, lora_bs, needs_a, needs_b, need_dx):
    """Adapter gradients of projections sharing one input x [N, in] (compute dtype xc), and
    the stacked g = dy (s B) [N, sum r] that dx needs (dx += g @ stacked A; None when dx is not
    wanted).

    One g per projection serves both dA = g^T x and dx; the dA of all projections is one
    matmul (g's stacked)."""
    grads_b = [
        _scaled(torch.mm(dy.t(), xa), s, b) if need_b else None
        for dy, xa, b, s, need_b in zip(dys, xas, lora_bs, scalings, needs_b, strict=True)
    ]
    if not (any(needs_a) or need_dx):
        return [None] * len(lora_as), grads_b, None
    gs = [torch.mm(dy, b) for dy, b in zip(dys, scaled_bs, strict=True)]
    g = torch.cat(gs, dim=1) if len(gs) > 1 else gs[0]
    grads_a = [None] * len(lora_as)
    if any(needs_a):
        dtypes = {a.dtype for a in lora_as}  # one cast for the usual single adapter dtype
        stacked = _cast(torch.mm(g.t(), xc), dtypes.pop() if len(dtypes) == 1 else torch.float32)
        rows = _split_rows(stacked, lora_as)
        grads_a = [
            _cast(row, a.dtype) if need_a else None
            for row, a, need_a in zip(rows, lora_as, needs_a, strict=True)
        ]
    return grads_a, grads_b, g if need_dx else None


def _groups(tensors: tuple):
    """(weight, bias, lora_a, lora_b) per projection, from the Functions' flat tensor args."""
    return [tensors[i : i + 4] for i in range(0, len(tensors), 4)]


def _without_bias(groups):
    """(weight, lora_a, lora_b) per projection, flat, for save_for_backward: the backward needs
    no bias, and saving only tensors (no None) keeps every Dynamo version's unpacking simple."""
    return [t for weight, _, lora_a, lora_b in groups for t in (weight, lora_a, lora_b)]


def _with_bias(saved):
    """The groups back from :func:`_without_bias`'s tensors (bias None)."""
    return [(saved[i], None, saved[i + 1], saved[i + 2]) for i in range(0, len(saved), 3)]


def _stacked_a(groups, dtype):
    """The projections' A's stacked [sum r, in] in the compute dtype (one x A^T for all, and
    one g @ A for dx). fp32 A's (PEFT's) are stacked, then cast once: the same values as casting
    each (a cast is elementwise), one cast instead of one per A. (Not for 16-bit A's of another
    dtype: autocast's rule for cat takes no float16 on the CPU.)"""
    lora_as = [group[2] for group in groups]
    if len(lora_as) == 1:
        return _cast(lora_as[0], dtype)
    first = lora_as[0].dtype
    if first in (torch.float32, dtype) and all(a.dtype == first for a in lora_as):
        return _cast(torch.cat(lora_as), dtype)
    return torch.cat([_cast(a, dtype) for a in lora_as])


def _thin_columns(xa_all, groups):
    """Each projection's [N, r] columns of the stacked x A^T (one projection's: all of it)."""
    if len(groups) == 1:
        return (xa_all,)
    return xa_all.split_with_sizes([group[2].shape[0] for group in groups], 1)


def _split_rows(stacked, lora_as):
    """Each projection's [r, in] rows of the stacked dA (one projection's: all of it)."""
    if len(lora_as) == 1:
        return (stacked,)
    return stacked.split_with_sizes([a.shape[0] for a in lora_as])


def _needs(ctx, groups, first):
    """(needs lora_a, needs lora_b) per projection; its tensors start at input ``first``."""
    flags = ctx.flags[first:]
    return ([flags[4 * i + 2] for i in range(len(groups))],
            [flags[4 * i + 3] for i in range(len(groups))])


class _LoraProjectionsFunction(torch.autograd.Function):
    """lora_linear (one projection) and lora_qkv (three) of one x [N, in]: a tuple of outputs.

    Inputs: x, the compute dtype, the scalings, then (weight, bias, lora_a, lora_b) per
    projection."""

    @staticmethod
    def forward(ctx, x, dtype, scalings, *tensors):
        groups = _groups(tensors)
        eager = _utils.plain_eager(x, *tensors)
        xc = _cast(x, dtype)
        stacked_a = _stacked_a(groups, dtype)
        xa_all = torch.mm(xc, stacked_a.t())
        scaled_bs = [
            _scaled_b(group[3], s, dtype) for group, s in zip(groups, scalings, strict=True)
        ]
        outputs = []
        for (weight, bias, _, _), xa, scaled_b in zip(
            groups, _thin_columns(xa_all, groups), scaled_bs, strict=True
        ):
            y = _linear(xc, weight, bias, dtype)
            outputs.append(_add_mm(y, xa, scaled_b.t(), 1, eager))
        ctx.save_for_backward(x, xa_all, stacked_a, *scaled_bs, *_without_bias(groups))
        ctx.dtype, ctx.scalings = dtype, scalings
        # Read in forward: torch 2.11's Dynamo traces a backward that reads needs_input_grad
        # as if nothing needed a gradient (all-zero gradients under Inductor).
        ctx.flags = tuple(ctx.needs_input_grad)
        return tuple(outputs)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        count = len(ctx.scalings)
        x, xa_all, stacked_a, *tensors = ctx.saved_tensors
        scaled_bs, groups, dtype = tensors[:count], _with_bias(tensors[count:]), ctx.dtype
        need_x = ctx.flags[0]
        needs_a, needs_b = _needs(ctx, groups, 3)
        grad_x = None
        eager = _utils.plain_eager(x, *grads)
        dys = [_cast(grad, dtype) for grad in grads]
        xc = _cast(x, dtype)
        grads_a, grads_b, g = _thin_grads(
            xc, dys, _thin_columns(xa_all, groups), scaled_bs, ctx.scalings,
            [grp[2] for grp in groups], [grp[3] for grp in groups], needs_a, needs_b, need_x,
        )
        if need_x:
            grad_x = torch.mm(dys[0], _dense(groups[0][0], dtype, backward=True))
            for dy, (weight, *_) in zip(dys[1:], groups[1:], strict=True):
                grad_x = _add_mm(grad_x, dy, _dense(weight, dtype, backward=True), 1, eager)
            grad_x = _add_mm(grad_x, g, stacked_a, 1, eager)
            grad_x = _cast(grad_x, x.dtype)
        per_projection = [
            grad for ga, gb in zip(grads_a, grads_b, strict=True) for grad in (None, None, ga, gb)
        ]
        return (grad_x, None, None, *per_projection)


class _LoraMLPFunction(torch.autograd.Function):
    """down(act(gate(x)) * up(x)). Inputs: x [N, hidden], the compute dtype, the activation,
    the three scalings, then (weight, bias, lora_a, lora_b) of gate, up and down."""

    @staticmethod
    def forward(ctx, x, dtype, activation, scalings, *tensors):
        groups = _groups(tensors)
        (w_gate, bias_gate, _, b_gate), (w_up, bias_up, _, b_up), down = groups
        w_down, bias_down, a_down, b_down = down
        s_gate, s_up, s_down = scalings
        eager = _utils.plain_eager(x, *tensors)
        glu = _glu_forward if eager else _glu_forward_op
        xc = _cast(x, dtype)
        # the adapters in the compute dtype, kept for the backward (a few KB each): casting
        # them again there was 7 more launches a call with fp32 adapters
        adapters = (_stacked_a(groups[:2], dtype), *(_cast(t, dtype) for t in
                    (b_gate, b_up, a_down, b_down)))  # fmt: skip
        a_gate_up, b_gate_c, b_up_c, a_down_c, b_down_c = adapters
        xa_gate_up = torch.mm(xc, a_gate_up.t())
        xa_gate, xa_up = _thin_columns(xa_gate_up, groups[:2])
        gate = _linear(xc, w_gate, bias_gate, dtype)
        up = _linear(xc, w_up, bias_up, dtype)
        h = glu(gate, up, xa_gate, xa_up, b_gate_c, b_up_c, s_gate, s_up, activation)
        xa_down = torch.mm(h, a_down_c.t())
        y = _linear(h, w_down, bias_down, dtype)
        y = _add_mm(y, xa_down, b_down_c.t(), s_down, eager)
        ctx.save_for_backward(x, gate, up, xa_gate_up, xa_down, *adapters,
                              *_without_bias(groups))  # fmt: skip
        ctx.dtype, ctx.activation, ctx.scalings = dtype, activation, scalings
        ctx.flags = tuple(ctx.needs_input_grad)  # (see _LoraProjectionsFunction.forward)
        ctx.overwritten = False
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_y):
        x, gate, up, xa_gate_up, xa_down, *tensors = ctx.saved_tensors
        adapters, groups, dtype = tensors[:5], _with_bias(tensors[5:]), ctx.dtype
        s_gate, s_up, s_down = ctx.scalings
        (needs_a_gate, needs_a_up, need_a_down), (need_b_gate, need_b_up, need_b_down) = (
            _needs(ctx, groups, 4)
        )
        need_x = ctx.flags[0]
        grad_x = grad_a_gate = grad_b_gate = grad_a_up = grad_b_up = grad_a_down = None
        dy = _cast(grad_y, dtype)
        eager = _utils.plain_eager(x, grad_y)
        _, _, a_down, b_down = groups[2]
        grad_b_down = None
        if need_b_down:
            grad_b_down = _scaled(torch.mm(dy.t(), xa_down), s_down, b_down)
        upstream = (need_x, needs_a_gate, needs_a_up, need_a_down, need_b_gate, need_b_up)
        if any(upstream):
            xas = _thin_columns(xa_gate_up, groups[:2])
            grad_gate, grad_up, sums = _mlp_activation_backward(ctx, groups[2][0], adapters, dy,
                                                                gate, up, xas)  # fmt: skip
            del gate, up  # (eager: grad_gate and grad_up are these buffers, overwritten)
            sum_a_down, sum_b_gate, sum_b_up = sums
            grad_a_down = _grad_to(sum_a_down, a_down) if need_a_down else None
            grad_b_gate = _transposed_grad(sum_b_gate, groups[0][3], need_b_gate)
            grad_b_up = _transposed_grad(sum_b_up, groups[1][3], need_b_up)
            gate_group, up_group = groups[:2]
            scaled_bs = [_scaled_b(gate_group[3], s_gate, dtype),
                         _scaled_b(up_group[3], s_up, dtype)]
            (grad_a_gate, grad_a_up), _, g = _thin_grads(
                _cast(x, dtype), (grad_gate, grad_up), xas, scaled_bs, (s_gate, s_up),
                (gate_group[2], up_group[2]), (gate_group[3], up_group[3]),
                (needs_a_gate, needs_a_up), (False, False), need_x,
            )
            if need_x:
                # (one dense 4-bit weight alive at a time: each freed after its matmul)
                grad_x = torch.mm(grad_gate, _dense(gate_group[0], dtype, backward=True))
                grad_x = _add_mm(grad_x, grad_up, _dense(up_group[0], dtype, backward=True), 1,
                                 eager)  # fmt: skip
                grad_x = _add_mm(grad_x, g, adapters[0], 1, eager)
                grad_x = _cast(grad_x, x.dtype)
        return (grad_x, None, None, None, None, None, grad_a_gate, grad_b_gate, None, None,
                grad_a_up, grad_b_up, None, None, grad_a_down, grad_b_down)


def _mlp_activation_backward(ctx, w_down, adapters, dy, gate, up, xas):
    """(dgate, dup, (s_d g_d^T h, s_g xa_g^T dgate, s_u xa_u^T dup)) through the backward
    kernel (``adapters``: the forward's, in the compute dtype; ``xas``: the saved xa_gate and
    xa_up). In eager mode dgate and dup overwrite the saved gate and up."""
    _, b_gate, b_up, a_down, b_down = adapters
    s_gate, s_up, s_down = ctx.scalings
    xa_gate, xa_up = xas
    g_down = torch.mm(dy, b_down)
    # without its LoRA term: the kernel adds it
    grad_h = torch.mm(dy, _dense(w_down, ctx.dtype, backward=True))
    args = (grad_h, g_down, a_down, s_down, gate, up, xa_gate, xa_up, b_gate, b_up, s_gate,
            s_up, ctx.activation)
    if not _utils.plain_eager(dy, gate, up):
        grad_gate, grad_up, *sums = _glu_backward_op(*args)
        return grad_gate, grad_up, sums
    if ctx.overwritten:
        raise RuntimeError(
            "fusetune.lora_mlp: backward ran twice through one graph (retain_graph=True); its "
            "first backward overwrote the saved activations with their gradients. Run the "
            "forward again for each backward."
        )
    ctx.overwritten = True
    return gate, up, _glu_backward(*args, gate, up)


# ============================================================================ public functions


def _use_reference(x: torch.Tensor, dtype: torch.dtype) -> bool:
    return _utils.backend(x) == "reference" or dtype not in _utils.KERNEL_DTYPES


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


def _flat_tensors(projections):
    return [t for p in projections for t in (p.weight, p.bias, p.lora_a, p.lora_b)]


def lora_linear(
    x: torch.Tensor, weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
    scaling: float, *, bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """LoRA linear layer: ``x W^T + scaling * (x A^T) B^T (+ bias)`` with a hand-written backward.

    Args:
        x: [..., in], float32 / float16 / bfloat16 (any strides).
        weight: [out, in], the frozen base weight (must not require grad); bias: optional [out].
        lora_a: [r, in] (PEFT's ``lora_A.weight``), lora_b: [out, r] (``lora_B.weight``), both
            float32 or the base weight's dtype (PEFT keeps them in float32).
        scaling: the LoRA scale (PEFT: lora_alpha / r).

    Precision: the matmuls run in the autocast dtype under torch.autocast (as F.linear); outside
    it in x's and weight's dtype, or the 16-bit one when float32 meets a 16-bit dtype; always
    accumulating in fp32. Returns [..., out] in that compute dtype. The gradients of x, lora_a
    and lora_b come back in their own dtypes; the base weight gets none (and costs none).
    Backward: one big matmul (dx) and four thin ones, none for an input that needs no gradient.

    Raises:
        TypeError: a non-floating tensor; lora_a and lora_b of different dtypes or of a dtype
            other than float32 or the base weight's; float16 mixed with bfloat16 outside
            autocast; a non-number scaling.
        ValueError: x's last dim not the weight's in-features; lora_a not [r, in]; lora_b not
            [out, r] with lora_a's rank; bias not [out]; tensors on different devices; a base
            weight or bias that requires grad.
    """
    projection = Projection(weight, lora_a, lora_b, scaling, bias)
    return _lora_linear(x, projection, reference.check_lora_linear_args(x, projection))


def lora_qkv(
    x: torch.Tensor, q: tuple, k: tuple, v: tuple
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Three LoRA projections of one input (attention's q, k and v), one summed dx.

    Args:
        x: [..., in].
        q, k, v: each ``(weight, lora_a, lora_b, scaling)`` or ``(weight, lora_a, lora_b,
            scaling, bias)`` as in :func:`lora_linear`; out-features (and ranks) may differ
            (GQA), the base weights share one dtype.

    Returns (q, k, v), each [..., out_i], with the precision rule and gradients of
    :func:`lora_linear`. x A^T is one matmul for the three adapters (A's stacked), and so are
    their dA; dx is one buffer accumulating the three projections.

    Raises: as :func:`lora_linear`, the argument named with its projection (``k.lora_b``); a
    TypeError for a projection that is not such a tuple or base weights of different dtypes.
    """
    projections, dtype = reference.check_lora_qkv_args(x, q, k, v)
    return _lora_qkv(x, projections, dtype)


def lora_mlp(
    x: torch.Tensor, gate: tuple, up: tuple, down: tuple, activation: str = "swiglu"
) -> torch.Tensor:
    """Gated MLP with LoRA on each projection: ``down(act(gate(x)) * up(x))``.

    Args:
        x: [..., hidden].
        gate, up: ``(weight, lora_a, lora_b, scaling[, bias])`` with weight [intermediate,
            hidden]; down: the same with weight [hidden_out, intermediate] (see
            :func:`lora_linear`); the base weights share one dtype.
        activation: "swiglu" (silu, Llama / Mistral / Qwen), "geglu" (erf gelu) or
            "geglu_tanh" (tanh gelu, Gemma's gelu_pytorch_tanh).

    The activation is a Triton kernel that also applies the gate and up adapters; its backward
    recomputes act(gate) * up instead of storing it and writes dgate and dup over the saved gate
    and up outputs (eager mode; compiled graphs use fresh buffers). Saved for backward: x, the
    gate and up outputs, three [N, r] tensors and the adapters in the compute dtype. Backward
    through one graph works once (retain_graph=True and a second backward raise a
    RuntimeError).

    Returns [..., hidden_out] in the compute dtype (see :func:`lora_linear`); gradients of x and
    the six adapters in their own dtypes.

    Raises: as :func:`lora_linear` (names like ``up.lora_a``); ValueError for an unknown
    activation or up / down weights that do not fit gate's intermediate size.
    """
    projections, dtype = reference.check_lora_mlp_args(x, gate, up, down, activation)
    return _lora_mlp(x, projections, activation, dtype)


# ============================================================================ checked entries
# The ops after their argument checks. The *_validated entries are for fusetune's PEFT
# integration, which checks a layer's projections once (reference.check_projection and the
# group checks) and again only when the layer's state changes; they check x per call.


def lora_linear_validated(x: torch.Tensor, projection: Projection) -> torch.Tensor:
    """:func:`lora_linear` of a projection that passed ``reference.check_projection``."""
    return _lora_linear(x, projection, reference.check_x(x, projection.weight))


def lora_qkv_validated(
    x: torch.Tensor, projections: list[Projection]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`lora_qkv` of projections that passed ``reference.check_qkv_projections``."""
    return _lora_qkv(x, projections, reference.check_x(x, projections[0].weight, "q.weight"))


def lora_mlp_validated(
    x: torch.Tensor, projections: list[Projection], activation: str
) -> torch.Tensor:
    """:func:`lora_mlp` of projections that passed ``reference.check_mlp_projections``."""
    dtype = reference.check_x(x, projections[0].weight, "gate.weight")
    return _lora_mlp(x, projections, activation, dtype)


def _lora_linear(x, projection, dtype):
    if _use_reference(x, dtype):
        return reference.linear_checked(x, projection, dtype)
    (y,) = _LoraProjectionsFunction.apply(
        _flat(x), dtype, (projection.scaling,), *_flat_tensors([projection])
    )
    return y.view(*x.shape[:-1], y.shape[-1])


def _lora_qkv(x, projections, dtype):
    if _use_reference(x, dtype):
        return reference.qkv_checked(x, projections, dtype)
    outputs = _LoraProjectionsFunction.apply(
        _flat(x), dtype, tuple([p.scaling for p in projections]), *_flat_tensors(projections)
    )
    lead = x.shape[:-1]
    return tuple([y.view(*lead, y.shape[-1]) for y in outputs])


def _lora_mlp(x, projections, activation, dtype):
    if _use_reference(x, dtype):
        return reference.mlp_checked(x, projections, activation, dtype)
    y = _LoraMLPFunction.apply(
        _flat(x), dtype, activation, tuple([p.scaling for p in projections]),
        *_flat_tensors(projections),
    )
    return y.view(*x.shape[:-1], y.shape[-1])
