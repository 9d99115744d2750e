"""Fused RMSNorm, residual-add + RMSNorm, and gated RMSNorm, forward and backward.

    h = x * rstd,  rstd = 1 / sqrt(mean(x^2) + eps),  y = h * (offset + w)
    dx = rstd * (dh - h * mean(dh * h)),  dh = dy * (offset + w)
    dw = sum over rows of dy * h          (h as rounded by the casting mode)
    gated: y = p * silu(z), p = h * (offset + w); dz = dy * p * silu'(z), and dy * silu(z)
    stands for dy above (Qwen3.5's and Qwen3-Next's Gated DeltaNet output norm)

Forward: one program per tile of rows (a whole row held in registers), which reads x (and the
residual) once and writes y (and the new residual) and the per-row rstd (fp32).
Backward: a fixed number of programs, each looping over row tiles; each writes dx for its rows
and keeps its share of dw in fp32 registers, then stores it to its row of a [programs, H] fp32
buffer; one column sum (torch, deterministic) reduces those partials. No atomics: results are
bit-for-bit reproducible for a given device.

Layout: kernels, host launchers, custom ops, the autograd Function, the public functions.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from fusetune import _utils
from fusetune._triton import tl, triton
from fusetune.reference.rms_norm import add_rms_norm as reference_add_rms_norm
from fusetune.reference.rms_norm import check_gate, check_rms_norm_args, resolve_offset
from fusetune.reference.rms_norm import rms_norm as reference_rms_norm
from fusetune.reference.rms_norm import rms_norm_gated as reference_rms_norm_gated

LLAMA, GEMMA, NONE = 0, 1, 2
_CASTING_CODES = {"llama": LLAMA, "gemma": GEMMA, "none": NONE}
# A whole row lives in registers: beyond this the kernels would spill heavily.
MAX_HIDDEN = 65536

# ============================================================================ kernels


@triton.jit
def _round_to(value, dtype: tl.constexpr):
    """fp32 ``value`` rounded to ``dtype`` and back (a no-op for fp32)."""
    return value.to(dtype).to(tl.float32)


@triton.jit
def _scale(
    weight_ptr, weight_stride, cols, col_mask, offset, x_dtype: tl.constexpr,
    CASTING: tl.constexpr,
):
    """offset + w in fp32 (rounded to x's dtype in "none" mode)."""
    weight = tl.load(weight_ptr + cols * weight_stride, mask=col_mask, other=0.0)
    scale = offset + weight.to(tl.float32)
    if CASTING == 2:
        scale = _round_to(scale, x_dtype)
    return scale


@triton.jit
def _rms_norm_forward_kernel(
    x_ptr, residual_ptr, gate_ptr, weight_ptr, out_ptr, new_residual_ptr, rstd_ptr, n_rows,
    n_cols, x_stride, residual_stride, gate_stride, out_stride, new_residual_stride,
    weight_stride, eps, offset,
    CASTING: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_GATE: tl.constexpr,
    BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr,
):
    """One tile of BLOCK_ROWS whole rows. With HAS_RESIDUAL the normalised input is
    x + residual, rounded to new_residual's dtype and stored first; with HAS_GATE the output
    is multiplied by silu(gate) before its one rounding."""
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_COLS)
    row_mask, col_mask = rows < n_rows, cols < n_cols
    mask = row_mask[:, None] & col_mask[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    x = tl.load(x_ptr + rows64 * x_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        residual_offsets = rows64 * residual_stride + cols[None, :]
        x += tl.load(residual_ptr + residual_offsets, mask=mask, other=0.0).to(tl.float32)
        x = x.to(new_residual_ptr.dtype.element_ty)
        tl.store(new_residual_ptr + rows64 * new_residual_stride + cols[None, :], x, mask=mask)
        x = x.to(tl.float32)
    out_dtype = out_ptr.dtype.element_ty
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / n_cols + eps)
    tl.store(rstd_ptr + rows, rstd, mask=row_mask)
    if CASTING == 2:
        rstd = _round_to(rstd, out_dtype)
    h = x * rstd[:, None]
    if CASTING != 1:  # llama and none round the normalised value before the weight multiply
        h = _round_to(h, out_dtype)
    scale = _scale(weight_ptr, weight_stride, cols, col_mask, offset, out_dtype, CASTING)
    y = h * scale[None, :]
    if HAS_GATE:
        gate = tl.load(gate_ptr + rows64 * gate_stride + cols[None, :], mask=mask, other=0.0)
        gate = gate.to(tl.float32)
        y = y * gate * tl.sigmoid(gate)
    tl.store(out_ptr + rows64 * out_stride + cols[None, :], y.to(out_dtype), mask=mask)


@triton.jit
def _rms_norm_backward_kernel(
    grad_out_ptr, grad_residual_ptr, x_ptr, gate_ptr, weight_ptr, rstd_ptr, grad_x_ptr,
    grad_gate_ptr, partial_ptr, n_rows, n_cols, grad_out_stride, grad_residual_stride, x_stride,
    gate_stride, grad_x_stride, grad_gate_stride, weight_stride, offset,
    CASTING: tl.constexpr, HAS_GRAD_RESIDUAL: tl.constexpr, HAS_GATE: tl.constexpr,
    WEIGHT_GRAD: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr,
):
    """Programs loop over row tiles (tile, tile + programs, ...): dx for each, and this
    program's partial dw (fp32) stored to ``partial_ptr[program]`` at the end. With
    HAS_GRAD_RESIDUAL the gradient arriving at the new residual is added to dx; with HAS_GATE
    the gate's gradient is stored and dy * silu(gate) goes on as the norm's output gradient."""
    program = tl.program_id(0)
    programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_COLS)
    col_mask = cols < n_cols
    x_dtype = x_ptr.dtype.element_ty
    scale = _scale(weight_ptr, weight_stride, cols, col_mask, offset, x_dtype, CASTING)
    grad_weight = tl.zeros([BLOCK_COLS], dtype=tl.float32)
    for tile in range(program, tl.cdiv(n_rows, BLOCK_ROWS), programs):
        rows = tile * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        row_mask = rows < n_rows
        mask = row_mask[:, None] & col_mask[None, :]
        rows64 = tl.cast(rows, tl.int64)[:, None]
        x = tl.load(x_ptr + rows64 * x_stride + cols[None, :], mask=mask, other=0.0)
        x = x.to(tl.float32)
        dy = tl.load(grad_out_ptr + rows64 * grad_out_stride + cols[None, :], mask=mask, other=0.0)
        dy = dy.to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
        h = x * rstd[:, None]
        h_used = h  # as the forward rounded it
        if CASTING == 2:
            h_used = x * _round_to(rstd, x_dtype)[:, None]
        if CASTING != 1:
            h_used = _round_to(h_used, x_dtype)
        if HAS_GATE:
            gate_offsets = rows64 * gate_stride + cols[None, :]
            gate = tl.load(gate_ptr + gate_offsets, mask=mask, other=0.0).to(tl.float32)
            sig = tl.sigmoid(gate)
            dgate = dy * h_used * scale[None, :] * sig * (1.0 + gate * (1.0 - sig))
            grad_gate_offsets = rows64 * grad_gate_stride + cols[None, :]
            tl.store(grad_gate_ptr + grad_gate_offsets,
                     dgate.to(grad_gate_ptr.dtype.element_ty), mask=mask)
            dy = dy * gate * sig
        if WEIGHT_GRAD:
            grad_weight += tl.sum(dy * h_used, axis=0)
        dh = dy * scale[None, :]
        dx = rstd[:, None] * (dh - h * (tl.sum(dh * h, axis=1) / n_cols)[:, None])
        if HAS_GRAD_RESIDUAL:
            dres_offsets = rows64 * grad_residual_stride + cols[None, :]
            dx += tl.load(grad_residual_ptr + dres_offsets, mask=mask, other=0.0).to(tl.float32)
        dx_offsets = rows64 * grad_x_stride + cols[None, :]
        tl.store(grad_x_ptr + dx_offsets, dx.to(grad_x_ptr.dtype.element_ty), mask=mask)
    if WEIGHT_GRAD:
        tl.store(partial_ptr + program * n_cols + cols, grad_weight, mask=col_mask)


# ============================================================================ host launchers


@dataclass(frozen=True)
class _LaunchPlan:
    block_rows: int
    block_cols: int
    num_warps: int


# Elements a tile should hold (rows x padded hidden): enough work per program for short rows.
TILE_ELEMENTS = 4096
# Backward programs per SM (each keeps a [H] fp32 partial of dw in registers).
BACKWARD_PROGRAMS_PER_SM = 4


@functools.lru_cache(maxsize=256)  # host time counts: these kernels take ~0.1 ms
def _launch_plan(n_cols: int) -> _LaunchPlan:
    block_cols = _utils.next_power_of_2(n_cols)
    block_rows = max(1, min(64, TILE_ELEMENTS // block_cols))
    # About 16 fp32 elements per thread per tensor, 1 to 32 warps.
    warps = max(1, min(32, block_rows * block_cols // 512))
    return _LaunchPlan(block_rows, block_cols, _utils.next_power_of_2(warps))


def _forward(x, residual, weight, eps, offset, casting, gate=None):
    """(out, new_residual or an empty tensor, rstd) for x [..., H] (gate: x's shape)."""
    dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    x2 = _utils.as_rows(x)
    n_rows, n_cols = x2.shape
    out = _utils.empty(x.shape, dtype, x.device)
    new_residual = _utils.empty(x.shape if residual is not None else (0,), dtype, x.device)
    rstd = _utils.empty((n_rows,), torch.float32, x.device)
    if n_rows == 0:
        return out, new_residual, rstd
    res2 = _utils.as_rows(residual) if residual is not None else x2
    new_res2 = new_residual.view(-1, n_cols) if residual is not None else x2
    out2 = out.view(-1, n_cols)
    gate2 = _utils.as_rows(gate) if gate is not None else x2
    plan = _launch_plan(n_cols)
    _rms_norm_forward_kernel[(_utils.cdiv(n_rows, plan.block_rows),)](
        x2, res2, gate2, weight, out2, new_res2, rstd, n_rows, n_cols, x2.stride(0),
        res2.stride(0), gate2.stride(0), out2.stride(0), new_res2.stride(0), weight.stride(0),
        eps, offset, CASTING=_CASTING_CODES[casting], HAS_RESIDUAL=residual is not None,
        HAS_GATE=gate is not None, BLOCK_ROWS=plan.block_rows, BLOCK_COLS=plan.block_cols,
        num_warps=plan.num_warps,
    )
    return out, new_residual, rstd


def _backward(grad_out, grad_residual, x, weight, rstd, offset, casting, weight_grad, gate=None):
    """(grad_x in x's dtype, grad_weight in weight's dtype or an empty tensor, grad_gate in
    gate's dtype or an empty tensor)."""
    x2, dy2 = _utils.as_rows(x), _utils.as_rows(grad_out)
    n_rows, n_cols = x2.shape
    grad_x = _utils.empty(x.shape, x.dtype, x.device)
    gate2 = _utils.as_rows(gate) if gate is not None else x2
    grad_gate = _utils.empty(gate.shape if gate is not None else (0,), gate2.dtype, x.device)
    plan = _launch_plan(n_cols)
    tiles = _utils.cdiv(n_rows, plan.block_rows)
    in_flight = BACKWARD_PROGRAMS_PER_SM * _utils.num_programs_in_flight(x.device)
    programs = max(1, min(tiles, in_flight))
    partial = _utils.empty((programs, n_cols) if weight_grad else (0,), torch.float32, x.device)
    if n_rows:
        dres2 = _utils.as_rows(grad_residual) if grad_residual is not None else dy2
        dx2 = grad_x.view(-1, n_cols)
        dgate2 = grad_gate.view(-1, n_cols) if gate is not None else dx2
        _rms_norm_backward_kernel[(programs,)](
            dy2, dres2, x2, gate2, weight, rstd, dx2, dgate2, partial, n_rows, n_cols,
            dy2.stride(0), dres2.stride(0), x2.stride(0), gate2.stride(0), dx2.stride(0),
            dgate2.stride(0), weight.stride(0), offset, CASTING=_CASTING_CODES[casting],
            HAS_GRAD_RESIDUAL=grad_residual is not None, HAS_GATE=gate is not None,
            WEIGHT_GRAD=weight_grad, BLOCK_ROWS=plan.block_rows, BLOCK_COLS=plan.block_cols,
            num_warps=plan.num_warps,
        )
    if not weight_grad:
        return grad_x, weight.new_empty((0,)), grad_gate
    if n_rows == 0:
        return grad_x, torch.zeros_like(weight), grad_gate
    return grad_x, partial.sum(0).to(weight.dtype), grad_gate


# ============================================================================ custom ops


def _fake_forward(x, residual, weight, eps, offset, casting, gate):
    dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    n_rows = x.numel() // x.shape[-1]
    return (
        x.new_empty(x.shape, dtype=dtype),
        x.new_empty(x.shape if residual is not None else (0,), dtype=dtype),
        x.new_empty((n_rows,), dtype=torch.float32),
    )


@_utils.register_op(
    "rms_norm_forward(Tensor x, Tensor? residual, Tensor weight, float eps, float offset, "
    "str casting, Tensor? gate) -> (Tensor, Tensor, Tensor)",
    fake=_fake_forward,
)
def _forward_op(x, residual, weight, eps, offset, casting, gate):
    """(out, new_residual, rstd [rows] fp32); new_residual is empty without a residual."""
    return _forward(x, residual, weight, eps, offset, casting, gate)


def _fake_backward(grad_out, grad_residual, x, weight, rstd, offset, casting, weight_grad, gate):
    return (
        x.new_empty(x.shape),
        weight.new_empty(weight.shape if weight_grad else (0,)),
        x.new_empty((0,)) if gate is None else gate.new_empty(gate.shape),
    )


@_utils.register_op(
    "rms_norm_backward(Tensor grad_out, Tensor? grad_residual, Tensor x, Tensor weight, "
    "Tensor rstd, float offset, str casting, bool weight_grad, Tensor? gate) "
    "-> (Tensor, Tensor, Tensor)",
    fake=_fake_backward,
)
def _backward_op(grad_out, grad_residual, x, weight, rstd, offset, casting, weight_grad, gate):
    """(grad of the normalised input, plus grad_residual when given; grad_weight or empty;
    grad_gate or empty)."""
    return _backward(grad_out, grad_residual, x, weight, rstd, offset, casting, weight_grad, gate)


# ============================================================================ autograd


class _RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, offset, casting):
        forward = _forward if _utils.plain_eager(x, weight) else _forward_op
        out, _, rstd = forward(x, None, weight, eps, offset, casting, None)
        ctx.save_for_backward(x, weight, rstd)
        ctx.options = (offset, casting)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        x, weight, rstd = ctx.saved_tensors
        backward = _backward if _utils.plain_eager(grad_out, x) else _backward_op
        grad_x, grad_weight, _ = backward(
            grad_out, None, x, weight, rstd, *ctx.options, ctx.needs_input_grad[1], None
        )
        return grad_x, grad_weight if ctx.needs_input_grad[1] else None, None, None, None


class _AddRMSNormFunction(torch.autograd.Function):
    """(normed, new_residual) = (rms_norm(x + residual), x + residual)."""

    @staticmethod
    def forward(ctx, x, residual, weight, eps, offset, casting):
        forward = _forward if _utils.plain_eager(x, residual, weight) else _forward_op
        out, new_residual, rstd = forward(x, residual, weight, eps, offset, casting, None)
        ctx.save_for_backward(new_residual, weight, rstd)
        ctx.options = (offset, casting)
        ctx.dtypes = (x.dtype, residual.dtype)
        return out, new_residual

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out, grad_new_residual):
        new_residual, weight, rstd = ctx.saved_tensors
        backward = _backward if _utils.plain_eager(grad_out, grad_new_residual) else _backward_op
        grad_sum, grad_weight, _ = backward(
            grad_out, grad_new_residual, new_residual, weight, rstd, *ctx.options,
            ctx.needs_input_grad[2], None,
        )
        x_dtype, residual_dtype = ctx.dtypes
        return (
            grad_sum.to(x_dtype), grad_sum.to(residual_dtype),
            grad_weight if ctx.needs_input_grad[2] else None, None, None, None,
        )


class _RMSNormGatedFunction(torch.autograd.Function):
    """rms_norm(x) * silu(gate)."""

    @staticmethod
    def forward(ctx, x, gate, weight, eps, offset, casting):
        forward = _forward if _utils.plain_eager(x, gate, weight) else _forward_op
        out, _, rstd = forward(x, None, weight, eps, offset, casting, gate)
        ctx.save_for_backward(x, gate, weight, rstd)
        ctx.options = (offset, casting)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        x, gate, weight, rstd = ctx.saved_tensors
        backward = _backward if _utils.plain_eager(grad_out, x) else _backward_op
        grad_x, grad_weight, grad_gate = backward(
            grad_out, None, x, weight, rstd, *ctx.options, ctx.needs_input_grad[2], gate
        )
        return (
            grad_x, grad_gate if ctx.needs_input_grad[1] else None,
            grad_weight if ctx.needs_input_grad[2] else None, None, None, None,
        )


# ============================================================================ public functions


def _check_kernel_limits(x: torch.Tensor) -> None:
    if x.shape[-1] > MAX_HIDDEN and _utils.backend(x) != "reference":
        raise ValueError(
            f"x's last dim must be at most {MAX_HIDDEN} for the fused kernels (a row is held in "
            f"registers), got {x.shape[-1]}"
        )


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *, offset: float | None = None,
    casting: str = "llama",
) -> torch.Tensor:
    """RMSNorm over the last dim: ``x / sqrt(mean(x^2) + eps) * (offset + weight)``.

    Args:
        x: [..., H], float32 / float16 / bfloat16, any leading dims; rows may be strided (a
            unit stride along H avoids a copy). H up to 65536 on the kernels.
        weight: [H], any floating dtype (kept in its dtype: an fp32 weight beside bf16 x is
            read as fp32 and gets an fp32 gradient).
        eps: added to the mean of squares, >= 0.
        offset: added to the weight; default 1.0 for casting "gemma" (Gemma's ``1 + w``), else 0.
        casting: where rounding to x's dtype happens (the sum of squares is always fp32):
            "llama": normalise in fp32, round to x's dtype, multiply by (offset + w) in fp32,
            round (transformers' LlamaRMSNorm); "gemma": all fp32, one rounding at the end
            (Gemma2RMSNorm); "none": the normalised value and (offset + w) are each rounded to
            x's dtype before the multiply, as a computation kept in x's dtype does.

    Returns:
        y shaped and typed like x (also under autocast, which this op ignores: it is not a
        matmul). Gradients: dx in x's dtype, dweight in weight's dtype, reduced over rows in
        fp32 without atomics (deterministic).

    Raises:
        TypeError: x or weight not floating point; eps or offset not a number.
        ValueError: weight not [H] with H = x's last dim; x 0-dim or with an empty last dim;
            eps < 0; unknown casting; tensors on different devices; H > 65536 on the kernels.
    """
    check_rms_norm_args(x, weight, eps, offset, casting)
    if _utils.backend(x) == "reference":
        return reference_rms_norm(x, weight, eps, offset=offset, casting=casting)
    _check_kernel_limits(x)
    return _RMSNormFunction.apply(
        x, weight, float(eps), resolve_offset(offset, casting), casting
    )


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *,
    offset: float | None = None, casting: str = "llama",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add fused with RMSNorm: ``s = x + residual``; returns ``(rms_norm(s), s)``.

    One pass reads x and residual and writes s and the normed output; the backward adds the
    gradient arriving at ``s`` (from the next residual add) to the norm's input gradient in the
    same pass. ``s`` has the promoted dtype of x and residual (a bf16 sublayer output added to
    an fp32 residual stream stays fp32, as in torch), and is rounded to it before normalising;
    the normed output has that dtype too. x and residual get gradients in their own dtypes.
    Other arguments, dtype rules and errors as :func:`rms_norm`; residual must have x's shape.
    """
    check_rms_norm_args(x, weight, eps, offset, casting, residual)
    if _utils.backend(x) == "reference":
        return reference_add_rms_norm(x, residual, weight, eps, offset=offset, casting=casting)
    _check_kernel_limits(x)
    return _AddRMSNormFunction.apply(
        x, residual, weight, float(eps), resolve_offset(offset, casting), casting
    )


def rms_norm_gated(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *,
    offset: float | None = None, casting: str = "llama",
) -> torch.Tensor:
    """Gated RMSNorm: ``rms_norm(x, weight) * silu(gate)`` in one pass (the output norm of
    Qwen3.5's and Qwen3-Next's Gated DeltaNet layers, FLA's FusedRMSNormGated).

    The norm is computed as :func:`rms_norm`'s ``casting`` says but not rounded, multiplied by
    silu(gate) with gate in fp32, and rounded once to x's dtype. The backward's gradients: dx
    in x's dtype, dgate in gate's dtype, dweight in weight's dtype (reduced in fp32 without
    atomics). gate: x's shape, any floating dtype. Other arguments, dtype rules and errors as
    :func:`rms_norm`; ValueError also when gate's shape is not x's, or it is on another device.
    """
    check_rms_norm_args(x, weight, eps, offset, casting)
    check_gate(x, gate)
    if _utils.backend(x) == "reference":
        return reference_rms_norm_gated(x, gate, weight, eps, offset=offset, casting=casting)
    _check_kernel_limits(x)
    return _RMSNormGatedFunction.apply(
        x, gate, weight, float(eps), resolve_offset(offset, casting), casting
    )
