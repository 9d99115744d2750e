"""Fused causal depthwise convolution (+ SiLU), forward and backward.

    pre[b, c, t] = bias[c] + sum_j w[c, j] x[b, c, t - (W - 1) + j],   out = act(pre)
    dpre = dout * act'(pre)
    dx[b, c, t] = sum_k w[c, W - 1 - k] dpre[b, c, t + k]
    dw[c, j] = sum_{b, t} dpre[b, c, t] x[b, c, t - (W - 1) + j],   dbias[c] = sum dpre

The short convolution in front of Gated DeltaNet layers. transformers' fallback (no
``causal-conv1d`` package) copies its transposed input to [B, C, T], runs cuDNN's depthwise
convolution and a separate SiLU, and transposes back. Here one program per (time tile,
channel tile, batch row) reads x in whatever strides it has (the [B, T, C] projection output
seen as [B, C, T] included), accumulates in fp32 and writes the output in x's own memory
order, so that transformers' transpose back is free. The backward recomputes pre for the W
positions each dx needs (nothing saved but x); weight and bias gradients are fp32 partial sums
per program, reduced by one deterministic sum (no atomics).

Layout: kernels, host launchers, custom ops, the autograd Function, the public function.
"""

from __future__ import annotations

import torch

from fusetune import _utils
from fusetune._triton import tl, triton
from fusetune.reference.causal_conv1d import causal_conv1d as reference_causal_conv1d
from fusetune.reference.causal_conv1d import check_causal_conv1d_args

BLOCK_T, BLOCK_C, WARPS = 32, 64, 4
MAX_WIDTH = 16  # the taps are unrolled; models use 4

# ============================================================================ kernels


@triton.jit
def _pre(x_ptr, w_ptr, b_ptr, t, c, t_mask, c_mask, sxc, sxt, swc, swj,
         W: tl.constexpr, HAS_BIAS: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):  # fmt: skip
    """pre at times t [BT] and channels c [BC] (x_ptr at this batch row), fp32."""
    acc = tl.zeros([BT, BC], dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(b_ptr + c, mask=c_mask, other=0.0).to(tl.float32)[None, :]
    for j in tl.static_range(W):
        src = t - (W - 1) + j
        mask = ((src >= 0) & t_mask)[:, None] & c_mask[None, :]
        offsets = src.to(tl.int64)[:, None] * sxt + c.to(tl.int64)[None, :] * sxc
        x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + c * swc + j * swj, mask=c_mask, other=0.0).to(tl.float32)
        acc += x * w[None, :]
    return acc


@triton.jit
def _forward_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, T, C, sxb, sxc, sxt, sob, soc, sot, swc, swj,
    W: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, BT: tl.constexpr,
    BC: tl.constexpr,
):
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    batch = tl.program_id(2).to(tl.int64)
    t_mask, c_mask = t < T, c < C
    pre = _pre(x_ptr + batch * sxb, w_ptr, b_ptr, t, c, t_mask, c_mask, sxc, sxt, swc, swj,
               W, HAS_BIAS, BT, BC)  # fmt: skip
    if SILU:
        pre = pre * tl.sigmoid(pre)
    offsets = batch * sob + t.to(tl.int64)[:, None] * sot + c.to(tl.int64)[None, :] * soc
    mask = t_mask[:, None] & c_mask[None, :]
    tl.store(out_ptr + offsets, pre.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _backward_kernel(
    x_ptr, w_ptr, b_ptr, dout_ptr, dx_ptr, dw_part_ptr, db_part_ptr, T, C, sxb, sxc, sxt,
    sdb, sdc, sdt, sgb, sgc, sgt, swc, swj,
    W: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, BT: tl.constexpr,
    BC: tl.constexpr,
):
    """dx for this tile; this tile's fp32 sums of dw [W, C] and dbias [C] to its own row of
    the partial buffers (row = batch * time tiles + time tile)."""
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    batch = tl.program_id(2).to(tl.int64)
    part = batch * tl.num_programs(0) + tl.program_id(0)
    c_mask = c < C
    x_row = x_ptr + batch * sxb
    c64 = c.to(tl.int64)[None, :]
    dx = tl.zeros([BT, BC], dtype=tl.float32)
    for k in tl.static_range(W):  # output time t + k reads x[t] through tap W - 1 - k
        tk = t + k
        tk_mask = tk < T
        pre = _pre(x_row, w_ptr, b_ptr, tk, c, tk_mask, c_mask, sxc, sxt, swc, swj,
                   W, HAS_BIAS, BT, BC)  # fmt: skip
        mask = tk_mask[:, None] & c_mask[None, :]
        offsets = batch * sdb + tk.to(tl.int64)[:, None] * sdt + c64 * sdc
        dpre = tl.load(dout_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        if SILU:
            sig = tl.sigmoid(pre)
            dpre = dpre * sig * (1.0 + pre * (1.0 - sig))
        w = tl.load(w_ptr + c * swc + (W - 1 - k) * swj, mask=c_mask, other=0.0)
        dx += dpre * w.to(tl.float32)[None, :]
        if k == 0:  # dpre at this tile's own times: the weight and bias sums
            if HAS_BIAS:
                tl.store(db_part_ptr + part * C + c, tl.sum(dpre, axis=0), mask=c_mask)
            for j in tl.static_range(W):
                src = t - (W - 1) + j
                src_mask = ((src >= 0) & (t < T))[:, None] & c_mask[None, :]
                x_offsets = src.to(tl.int64)[:, None] * sxt + c64 * sxc
                x = tl.load(x_row + x_offsets, mask=src_mask, other=0.0).to(tl.float32)
                tl.store(dw_part_ptr + (part * W + j) * C + c, tl.sum(dpre * x, axis=0),
                         mask=c_mask)  # fmt: skip
    mask = (t < T)[:, None] & c_mask[None, :]
    offsets = batch * sgb + t.to(tl.int64)[:, None] * sgt + c64 * sgc
    tl.store(dx_ptr + offsets, dx.to(dx_ptr.dtype.element_ty), mask=mask)


# ============================================================================ host launchers


def _grid(x: torch.Tensor) -> tuple[int, int, int]:
    batch, channels, time = x.shape
    return (_utils.cdiv(time, BLOCK_T), _utils.cdiv(channels, BLOCK_C), batch)


def _like(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A new [B, C, T] tensor in x's memory order (a transposed [B, T, C] view stays one)."""
    if x.stride(1) == 1 and x.stride(2) == x.shape[1]:  # [B, T, C] in memory
        return _utils.empty((x.shape[0], x.shape[2], x.shape[1]), dtype, x.device).transpose(1, 2)
    return _utils.empty(x.shape, dtype, x.device)


def _bias_or(bias, other):
    """The bias with a unit stride (the kernels read it so), or ``other`` as a dummy pointer."""
    return other if bias is None else bias.contiguous()


def _forward(x, weight, bias, silu: bool):
    out = _like(x, x.dtype)
    if x.numel():
        _forward_kernel[_grid(x)](
            x, weight, _bias_or(bias, weight), out, x.shape[2], x.shape[1],
            *x.stride(), *out.stride(), *weight.stride(), W=weight.shape[1],
            HAS_BIAS=bias is not None, SILU=silu, BT=BLOCK_T, BC=BLOCK_C, num_warps=WARPS,
        )  # fmt: skip
    return out


def _backward(grad_out, x, weight, bias, silu: bool):
    """(dx in x's dtype, dweight in weight's dtype, dbias in its dtype or an empty tensor)."""
    grad_x = _like(x, x.dtype)
    if not x.numel():  # sums over no element
        grad_b = bias.new_zeros(bias.shape) if bias is not None else weight.new_empty(0)
        return grad_x, weight.new_zeros(weight.shape), grad_b
    grid = _grid(x)
    parts = grid[0] * grid[2]
    width, channels = weight.shape[1], x.shape[1]
    dw_part = _utils.empty((parts, width, channels), torch.float32, x.device)
    db_part = _utils.empty((parts, channels) if bias is not None else (0,), torch.float32,
                           x.device)  # fmt: skip
    _backward_kernel[grid](
        x, weight, _bias_or(bias, weight), grad_out, grad_x, dw_part, db_part,
        x.shape[2], channels, *x.stride(), *grad_out.stride(), *grad_x.stride(),
        *weight.stride(), W=width, HAS_BIAS=bias is not None, SILU=silu, BT=BLOCK_T,
        BC=BLOCK_C, num_warps=WARPS,
    )  # fmt: skip
    grad_w = dw_part.sum(0).t().to(weight.dtype).contiguous()  # the fake's layout
    grad_b = db_part.sum(0).to(bias.dtype) if bias is not None else grad_w.new_empty(0)
    return grad_x, grad_w, grad_b


# ============================================================================ custom ops


def _fake_forward(x, weight, bias, silu):
    return _like(x, x.dtype)


@_utils.register_op(
    "causal_conv1d_forward(Tensor x, Tensor weight, Tensor? bias, bool silu) -> Tensor",
    fake=_fake_forward,
)
def _forward_op(x, weight, bias, silu):
    return _forward(x, weight, bias, silu)


def _fake_backward(grad_out, x, weight, bias, silu):
    grad_b = weight.new_empty(0) if bias is None else bias.new_empty(bias.shape)
    return _like(x, x.dtype), weight.new_empty(weight.shape), grad_b


@_utils.register_op(
    "causal_conv1d_backward(Tensor grad_out, Tensor x, Tensor weight, Tensor? bias, bool silu) "
    "-> (Tensor, Tensor, Tensor)",
    fake=_fake_backward,
)
def _backward_op(grad_out, x, weight, bias, silu):
    return _backward(grad_out, x, weight, bias, silu)


# ============================================================================ autograd


class _CausalConv1dFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, silu):
        forward = _forward if _utils.plain_eager(x, weight, bias) else _forward_op
        ctx.save_for_backward(x, weight, bias)
        ctx.silu = silu
        return forward(x, weight, bias, silu)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        x, weight, bias = ctx.saved_tensors
        backward = _backward if _utils.plain_eager(grad_out, x) else _backward_op
        grad_x, grad_w, grad_b = backward(grad_out, x, weight, bias, ctx.silu)
        needs = ctx.needs_input_grad
        return (grad_x if needs[0] else None, grad_w if needs[1] else None,
                grad_b if bias is not None and needs[2] else None, None)  # fmt: skip


# ============================================================================ public function


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
) -> torch.Tensor:
    """Causal depthwise convolution over time, then ``activation`` ("silu" / "swish" or None).

    Args:
        x: [B, C, T], float32 / float16 / bfloat16, any strides (the transpose of a [B, T, C]
            projection output, as transformers passes it, is read in place).
        weight: [C, W], W up to 16 (the models' 4); any floating dtype.
        bias: [C] or None.
        activation: None, "silu" or "swish" (the same).

    Returns:
        [B, C, T] in x's dtype and x's memory order: ``out[b, c, t] = act(bias[c] +
        sum_j weight[c, j] x[b, c, t - W + 1 + j])``, zeros before t = 0; accumulated and
        activated in fp32, rounded once. Gradients: dx in x's dtype, dweight and dbias in their
        own dtypes, reduced in fp32 without atomics.

    Raises:
        TypeError: a tensor not floating point. ValueError: x not 3-D, weight not [C, W],
            bias not [C], an unknown activation, tensors on different devices, W > 16 on the
            kernels.
    """
    check_causal_conv1d_args(x, weight, bias, activation)
    if _utils.backend(x) == "reference":
        return reference_causal_conv1d(x, weight, bias, activation)
    if weight.shape[1] > MAX_WIDTH:
        raise ValueError(f"weight's width must be at most {MAX_WIDTH} on the kernels, got "
                         f"{weight.shape[1]}")  # fmt: skip
    return _CausalConv1dFunction.apply(x, weight, bias, activation is not None)
