"""Fused gated activations, SwiGLU and GeGLU, forward and backward.

    out = act(gate) * up
    grad_gate = grad_out * up * act'(gate),   grad_up = grad_out * act(gate)
with act = silu (SwiGLU), erf gelu or tanh gelu (GeGLU). Nothing is saved but gate and up: the
backward recomputes act(gate) from them in the same pass, and can also hand back the recomputed
output (what LoRA's down projection needs for its weight gradient) and write everything over its
inputs' buffers (in place: no new memory).

Every kernel streams elementwise over [rows, cols] tiles (rows may be strided; columns must be
contiguous), loads in any dtype, computes in fp32 and rounds once on store.

Functional entries for other ops (e.g. fused LoRA MLPs): :func:`glu_forward` and
:func:`glu_backward` (no autograd), and :func:`swiglu_backward` / :func:`geglu_backward`.

Layout: kernels, host launchers, custom ops, the autograd Function, the public functions.
"""

from __future__ import annotations

import torch

from fusetune import _utils
from fusetune._triton import tanh, tl, triton
from fusetune.reference import activation as reference

SILU, GELU, GELU_TANH = 0, 1, 2
ACTIVATIONS = {"silu": SILU, "gelu": GELU, "gelu_tanh": GELU_TANH}

# ============================================================================ kernels

_SQRT_HALF = tl.constexpr(0.7071067811865476)  # 1 / sqrt(2)
_INV_SQRT_2PI = tl.constexpr(0.3989422804014327)  # 1 / sqrt(2 pi)
_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
_GELU_CUBIC = tl.constexpr(0.044715)


@triton.jit
def _activation(gate, ACTIVATION: tl.constexpr):
    """(act(gate), act'(gate)) in fp32."""
    if ACTIVATION == 0:
        sigmoid = 1.0 / (1.0 + tl.exp(-gate))
        value = gate * sigmoid
        derivative = sigmoid * (1.0 + gate * (1.0 - sigmoid))
    elif ACTIVATION == 1:
        cdf = 0.5 * (1.0 + tl.erf(gate * _SQRT_HALF))
        value = gate * cdf
        derivative = cdf + gate * _INV_SQRT_2PI * tl.exp(-0.5 * gate * gate)
    else:
        inner = _SQRT_2_OVER_PI * (gate + _GELU_CUBIC * gate * gate * gate)
        t = tanh(inner)
        value = 0.5 * gate * (1.0 + t)
        derivative = 0.5 * (1.0 + t) + 0.5 * gate * (1.0 - t * t) * _SQRT_2_OVER_PI * (
            1.0 + 3.0 * _GELU_CUBIC * gate * gate
        )
    return value, derivative


@triton.jit
def _tile(tiles_per_row, n_cols, BLOCK: tl.constexpr):
    """(row, columns, column mask) of this program's tile: tiles walk each row in BLOCK
    columns, rows one after another (one flat grid axis, so no grid dim limit on rows)."""
    program = tl.program_id(0)
    row = (program // tiles_per_row).to(tl.int64)
    cols = (program % tiles_per_row) * BLOCK + tl.arange(0, BLOCK)
    return row, cols, cols < n_cols


@triton.jit
def _glu_forward_kernel(
    gate_ptr, up_ptr, out_ptr, n_cols, tiles_per_row, gate_stride, up_stride, out_stride,
    ACTIVATION: tl.constexpr, BLOCK: tl.constexpr,
):
    row, cols, mask = _tile(tiles_per_row, n_cols, BLOCK)
    gate = tl.load(gate_ptr + row * gate_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + row * up_stride + cols, mask=mask, other=0.0).to(tl.float32)
    value, _ = _activation(gate, ACTIVATION)
    out = value * up
    tl.store(out_ptr + row * out_stride + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _glu_backward_kernel(
    grad_out_ptr, gate_ptr, up_ptr, out_ptr, grad_gate_ptr, grad_up_ptr, n_cols, tiles_per_row,
    grad_out_stride, gate_stride, up_stride, out_stride, grad_gate_stride, grad_up_stride,
    ACTIVATION: tl.constexpr, STORE_OUTPUT: tl.constexpr, BLOCK: tl.constexpr,
):
    """grad_gate, grad_up (and the recomputed output when STORE_OUTPUT). Every element is read
    before the same program writes it, so outputs may alias inputs (the in-place variant)."""
    row, cols, mask = _tile(tiles_per_row, n_cols, BLOCK)
    grad_out = tl.load(grad_out_ptr + row * grad_out_stride + cols, mask=mask, other=0.0)
    grad_out = grad_out.to(tl.float32)
    gate = tl.load(gate_ptr + row * gate_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + row * up_stride + cols, mask=mask, other=0.0).to(tl.float32)
    value, derivative = _activation(gate, ACTIVATION)
    if STORE_OUTPUT:
        out = value * up
        tl.store(out_ptr + row * out_stride + cols, out.to(out_ptr.dtype.element_ty), mask=mask)
    grad_gate = grad_out * up * derivative
    grad_up = grad_out * value
    grad_gate_ptrs = grad_gate_ptr + row * grad_gate_stride + cols
    tl.store(grad_gate_ptrs, grad_gate.to(grad_gate_ptr.dtype.element_ty), mask=mask)
    grad_up_ptrs = grad_up_ptr + row * grad_up_stride + cols
    tl.store(grad_up_ptrs, grad_up.to(grad_up_ptr.dtype.element_ty), mask=mask)


# ============================================================================ host launchers

# Columns per program and warps: a tile of BLOCK elements per tensor, 8 elements per thread.
BLOCK = 2048
NUM_WARPS = 8


def _grid(rows2: torch.Tensor) -> tuple[tuple[int], int, int]:
    n_rows, n_cols = rows2.shape
    block = min(BLOCK, _utils.next_power_of_2(n_cols))
    tiles_per_row = _utils.cdiv(n_cols, block)
    return (n_rows * tiles_per_row,), tiles_per_row, block


def _warps(block: int) -> int:
    return max(1, min(NUM_WARPS, block // 256))


def _forward(gate, up, activation):
    out = _utils.empty(gate.shape, torch.promote_types(gate.dtype, up.dtype), gate.device)
    if gate.numel():
        gate2, up2, out2 = _utils.as_rows(gate), _utils.as_rows(up), out.view(-1, gate.shape[-1])
        grid, tiles_per_row, block = _grid(gate2)
        _glu_forward_kernel[grid](
            gate2, up2, out2, gate2.shape[1], tiles_per_row, gate2.stride(0), up2.stride(0),
            out2.stride(0), ACTIVATION=ACTIVATIONS[activation], BLOCK=block,
            num_warps=_warps(block),
        )
    return out


def _backward(grad_out, gate, up, out, grad_gate, grad_up, activation, store_output):
    """Fill grad_gate, grad_up (and out when store_output); any of them may alias an input."""
    if not gate.numel():
        return
    grad_out2, gate2, up2 = _utils.as_rows(grad_out), _utils.as_rows(gate), _utils.as_rows(up)
    out2 = out.view(-1, gate.shape[-1]) if store_output else gate2
    grad_gate2, grad_up2 = grad_gate.view(-1, gate.shape[-1]), grad_up.view(-1, gate.shape[-1])
    grid, tiles_per_row, block = _grid(gate2)
    _glu_backward_kernel[grid](
        grad_out2, gate2, up2, out2, grad_gate2, grad_up2, gate2.shape[1], tiles_per_row,
        grad_out2.stride(0), gate2.stride(0), up2.stride(0), out2.stride(0), grad_gate2.stride(0),
        grad_up2.stride(0), ACTIVATION=ACTIVATIONS[activation], STORE_OUTPUT=store_output,
        BLOCK=block, num_warps=_warps(block),
    )


# ============================================================================ custom ops


@_utils.register_op(
    "glu_forward(Tensor gate, Tensor up, str activation) -> Tensor",
    fake=lambda gate, up, activation: gate.new_empty(
        gate.shape, dtype=torch.promote_types(gate.dtype, up.dtype)
    ),
)
def _forward_op(gate, up, activation):
    return _forward(gate, up, activation)


def _fake_backward(grad_out, gate, up, activation, store_output):
    out_dtype = torch.promote_types(gate.dtype, up.dtype)
    return (
        gate.new_empty(gate.shape if store_output else (0,), dtype=out_dtype),
        gate.new_empty(gate.shape),
        up.new_empty(up.shape),
    )


@_utils.register_op(
    "glu_backward(Tensor grad_out, Tensor gate, Tensor up, str activation, bool store_output) "
    "-> (Tensor, Tensor, Tensor)",
    fake=_fake_backward,
)
def _backward_op(grad_out, gate, up, activation, store_output):
    """(recomputed output or an empty tensor, grad_gate, grad_up), new buffers."""
    return _backward_new(grad_out, gate, up, activation, store_output)


def _backward_new(grad_out, gate, up, activation, store_output):
    out_dtype = torch.promote_types(gate.dtype, up.dtype)
    out = _utils.empty(gate.shape if store_output else (0,), out_dtype, gate.device)
    grad_gate = _utils.empty(gate.shape, gate.dtype, gate.device)
    grad_up = _utils.empty(up.shape, up.dtype, up.device)
    _backward(grad_out, gate, up, out, grad_gate, grad_up, activation, store_output)
    return out, grad_gate, grad_up


@_utils.register_op(
    "glu_backward_(Tensor(a!) grad_out, Tensor(b!) gate, Tensor(c!) up, str activation, "
    "bool store_output) -> ()",
    fake=lambda *args: None,
)
def _backward_inplace_op(grad_out, gate, up, activation, store_output):
    """In place: grad_gate over gate, grad_up over up, the output (if stored) over grad_out."""
    _backward(grad_out, gate, up, grad_out, gate, up, activation, store_output)


# ============================================================================ autograd


class _GLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, activation):
        ctx.save_for_backward(gate, up)
        ctx.activation = activation
        forward = _forward if _utils.plain_eager(gate, up) else _forward_op
        return forward(gate, up, activation)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        gate, up = ctx.saved_tensors
        backward = _backward_new if _utils.plain_eager(grad_out, gate) else _backward_op
        _, grad_gate, grad_up = backward(grad_out, gate, up, ctx.activation, False)
        return grad_gate, grad_up, None


# ============================================================================ public functions


def _activation_name(approximate: str) -> str:
    return "gelu" if approximate == "none" else "gelu_tanh"


def _check_functional_args(gate, up, activation, grad_out=None):
    reference.check_glu_args(gate, up)
    _utils.check_choice("activation", activation, tuple(ACTIVATIONS))
    if grad_out is not None:
        _utils.check_floating("grad_out", grad_out)
        if tuple(grad_out.shape) != tuple(gate.shape):
            raise ValueError(
                f"grad_out must have gate's shape {tuple(gate.shape)}, got {tuple(grad_out.shape)}"
            )
    if _utils.backend(gate) == "reference":
        raise ValueError(
            "the functional glu entries run the Triton kernels only: pass CUDA tensors (or CPU "
            "tensors with FUSETUNE_INTERPRET=1), or use fusetune.swiglu / fusetune.geglu"
        )


def glu_forward(gate: torch.Tensor, up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """``act(gate) * up`` without autograd (``activation``: "silu", "gelu" or "gelu_tanh").

    For ops that do their own backward (see :func:`glu_backward`). Shapes and dtypes as
    :func:`swiglu`. Kernel devices only (CUDA, or CPU under FUSETUNE_INTERPRET=1)."""
    _check_functional_args(gate, up, activation)
    return _forward_op(gate, up, activation)


def glu_backward(
    grad_out: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, activation: str = "silu", *,
    return_output: bool = False, inplace: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Backward of ``out = act(gate) * up`` from (grad_out, gate, up) alone, one fused pass.

    Returns (grad_gate, grad_up), or (out, grad_gate, grad_up) with ``return_output``: ``out``
    is act(gate) * up recomputed in the same pass (for a down projection's weight gradient
    without keeping the activation from the forward). grad_gate has gate's dtype, grad_up
    up's, out their promoted dtype.

    inplace: write grad_gate over ``gate``, grad_up over ``up`` and out over ``grad_out`` (each
    rounded to that buffer's dtype); no new memory, and the returned tensors are those buffers.
    Each buffer needs a unit last stride and leading dims that collapse to one row stride (a
    contiguous tensor, or a slice of rows), else ValueError. Autograd does not see the writes:
    call it inside a backward or under no_grad, on buffers nothing else reads afterwards.
    """
    _check_functional_args(gate, up, activation, grad_out)
    if not inplace:
        out, grad_gate, grad_up = _backward_op(grad_out, gate, up, activation, return_output)
        return (out, grad_gate, grad_up) if return_output else (grad_gate, grad_up)
    for name, t in (("grad_out", grad_out), ("gate", gate), ("up", up)):
        if t.stride(-1) != 1 or not _collapses(t):
            raise ValueError(f"inplace needs {name} with a unit last stride and collapsible rows")
    _backward_inplace_op(grad_out, gate, up, activation, return_output)
    return (grad_out, gate, up) if return_output else (gate, up)


def _collapses(t: torch.Tensor) -> bool:
    try:
        t.view(-1, t.shape[-1])
    except RuntimeError:
        return False
    return True


def swiglu_backward(
    grad_out: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, *, return_output: bool = False,
    inplace: bool = False,
) -> tuple[torch.Tensor, ...]:
    """:func:`glu_backward` for SwiGLU: (grad_gate, grad_up) [or (out, grad_gate, grad_up)]."""
    return glu_backward(grad_out, gate, up, "silu", return_output=return_output, inplace=inplace)


def geglu_backward(
    grad_out: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, approximate: str = "none", *,
    return_output: bool = False, inplace: bool = False,
) -> tuple[torch.Tensor, ...]:
    """:func:`glu_backward` for GeGLU (``approximate`` "none" or "tanh")."""
    _utils.check_choice("approximate", approximate, reference.APPROXIMATIONS)
    return glu_backward(
        grad_out, gate, up, _activation_name(approximate), return_output=return_output,
        inplace=inplace,
    )


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU: ``silu(gate) * up``, fused forward and backward (only gate and up are saved).

    Args:
        gate, up: same shape [..., I] (e.g. the gate and up projections of an MLP), float32 /
            float16 / bfloat16, rows may be strided (a unit last stride avoids a copy).

    Returns:
        [..., I] in the promoted dtype of gate and up, computed in fp32 and rounded once.
        Autocast does not change this op (its inputs are usually autocast matmul outputs).
        Gradients come back in gate's and up's dtypes.

    Raises:
        TypeError: gate or up not floating point.
        ValueError: gate and up shapes differ; 0-dim inputs; different devices.
    """
    reference.check_glu_args(gate, up)
    if _utils.backend(gate) == "reference":
        return reference.swiglu(gate, up)
    return _GLUFunction.apply(gate, up, "silu")


def geglu(gate: torch.Tensor, up: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """GeGLU: ``gelu(gate) * up`` with gelu exact (erf, ``approximate="none"``) or its tanh
    approximation (``"tanh"``, Gemma's gelu_pytorch_tanh). Shapes, dtypes and errors as
    :func:`swiglu`; also ValueError for an unknown ``approximate``."""
    reference.check_glu_args(gate, up, approximate)
    if _utils.backend(gate) == "reference":
        return reference.geglu(gate, up, approximate)
    return _GLUFunction.apply(gate, up, _activation_name(approximate))
