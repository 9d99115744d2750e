"""A gated activation and the linear layer after it, ``y = (act(gate) * up) W^T + b``, without
keeping the activation's output for the backward.

A gated MLP's down projection, ``down_proj(act(gate) * up)``, through torch's linear saves its
input h = act(gate) * up for the weight gradient whenever the weight trains (full fine-tuning),
while the GLU has saved gate and up already: one more [tokens, intermediate] tensor per layer
alive from the forward to the backward (Llama-3.2-1B, 4 x 2048 tokens: 128 MiB a layer, 2 GiB
over 16 layers at the step's memory peak). Here:

  forward   h = act(gate) * up (fusetune's GLU kernel), y = h W^T + b; saved: gate, up and W
  backward  dh = dy W; one GLU backward kernel pass gives (h recomputed, dgate, dup), h
            written over dh in eager mode; dW = dy^T h (2-D views), db = sum of dy; h lives
            only inside the backward

Matmuls are torch's (cuBLAS); the activation is :mod:`fusetune.ops.activation`'s kernels (no new
kernel: the GLU backward already recomputes h with ``store_output``). Precision: the matmuls in
one compute dtype (:func:`fusetune.reference.glu_linear.compute_dtype`: the autocast dtype under
torch.autocast, as F.linear), fp32 accumulation; the GLU in fp32, rounded once. Under autocast
the weight is cast in the forward and again in the backward, not saved cast.

Layout: no kernels of its own; host side (the autograd Function over the GLU's launchers and
registered ops, which carry the fakes for torch.compile), then the public function.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fusetune import _utils
from fusetune.ops import activation as glu_ops
from fusetune.reference.glu_linear import check_glu_linear_args
from fusetune.reference.glu_linear import glu_linear as reference_glu_linear

# ============================================================================ autograd


class _GLULinearFunction(torch.autograd.Function):
    """(gate, up, weight, bias or None, activation, compute dtype) -> y."""

    @staticmethod
    def forward(ctx, gate, up, weight, bias, activation, dtype):
        eager = _utils.plain_eager(gate, up, weight, bias)
        h = (glu_ops._forward if eager else glu_ops._forward_op)(gate, up, activation)
        y = F.linear(
            _utils.cast(h, dtype),
            _utils.cast(weight, dtype),
            None if bias is None else _utils.cast(bias, dtype),
        )
        ctx.save_for_backward(gate, up, weight)
        ctx.activation, ctx.dtype = activation, dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        # Read in forward: torch 2.11's Dynamo traces a backward that reads needs_input_grad
        # as if nothing needed a gradient (see ops/lora.py).
        ctx.flags = tuple(ctx.needs_input_grad[:4])
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_y):
        gate, up, weight = ctx.saved_tensors
        need_gate, need_up, need_weight, need_bias = ctx.flags
        dtype, activation = ctx.dtype, ctx.activation
        eager = _utils.plain_eager(grad_y, gate, up, weight)
        dy = _utils.cast(grad_y, dtype)
        grad_gate = grad_up = grad_weight = grad_bias = None
        h = None
        if need_gate or need_up:
            dh = torch.matmul(dy, _utils.cast(weight, dtype))
            # one pass: h (recomputed, when the weight needs it), dgate, dup
            h, grad_gate, grad_up = _glu_backward(dh, gate, up, activation, need_weight, eager)
            del dh
        elif need_weight:
            h = (glu_ops._forward if eager else glu_ops._forward_op)(gate, up, activation)
        if need_weight or need_bias:
            dy2 = dy.reshape(-1, dy.shape[-1])
            if need_weight:
                h2 = _utils.cast(h, dtype).reshape(-1, h.shape[-1])
                grad_weight = _utils.cast(torch.mm(dy2.t(), h2), weight.dtype)
                del h, h2
            if need_bias:
                grad_bias = _utils.cast(dy2.sum(0), ctx.bias_dtype)
        return (
            grad_gate if need_gate else None,
            grad_up if need_up else None,
            grad_weight,
            grad_bias,
            None,
            None,
        )


def _glu_backward(dh, gate, up, activation, store_output, eager):
    """(h or an empty tensor, dgate, dup) from the GLU backward kernel. In eager mode, where h
    has dh's dtype, the kernel writes h over dh (it reads each element before writing it): the
    backward then holds one [.., I] buffer fewer (dh is not needed after this pass). Traced
    graphs call the registered op (new buffers)."""
    if not eager:
        return glu_ops._backward_op(dh, gate, up, activation, store_output)
    if not store_output or torch.promote_types(gate.dtype, up.dtype) != dh.dtype:
        return glu_ops._backward_new(dh, gate, up, activation, store_output)
    grad_gate = _utils.empty(gate.shape, gate.dtype, gate.device)
    grad_up = _utils.empty(up.shape, up.dtype, up.device)
    glu_ops._backward(dh, gate, up, dh, grad_gate, grad_up, activation, True)
    return dh, grad_gate, grad_up


# ============================================================================ public function


def glu_linear(
    gate: torch.Tensor,
    up: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    activation: str = "silu",
) -> torch.Tensor:
    """``F.linear(act(gate) * up, weight, bias)`` (a gated MLP's down projection) whose backward
    recomputes ``act(gate) * up`` instead of keeping it: saved for backward are gate, up and the
    weight alone (``down_proj(fusetune.swiglu(gate, up))`` also keeps the product, one more
    tensor of gate's size, whenever the weight requires grad).

    Args:
        gate, up: same shape [..., I], float32 / float16 / bfloat16 (rows may be strided; a
            unit last stride avoids a copy), e.g. the gate and up projections of an MLP.
        weight: [O, I], the down projection's weight; bias: optional [O].
        activation: "silu" (SwiGLU), "gelu" (erf GeGLU) or "gelu_tanh" (tanh GeGLU, Gemma's
            gelu_pytorch_tanh).

    Precision: act(gate) * up as :func:`fusetune.swiglu` / :func:`fusetune.geglu` (fp32, rounded
    once to the promoted dtype of gate and up). The matmuls run in one compute dtype, as
    ``down_proj(swiglu(gate, up))`` would: under torch.autocast the autocast dtype (an fp32
    weight and bias are cast, as F.linear casts them); outside it the dtype of act(gate) * up and
    the weight when they agree, the 16-bit one when float32 meets a 16-bit dtype (where F.linear
    would raise). The bias is cast to the compute dtype.

    Returns:
        [..., O] in the compute dtype. Gradients of gate, up, weight and bias come back in their
        own dtypes (an fp32 weight under bf16 autocast: an fp32 gradient of the bf16 product,
        as torch's). Work for an input that needs no gradient is skipped (a frozen weight: no
        recompute of the product at all).

    Raises:
        TypeError: a non-floating gate, up, weight or bias; dtypes with no single matmul dtype
            outside autocast (float16 with bfloat16, float64 with another dtype).
        ValueError: gate and up shapes differ; 0-dim gate; weight not 2-D or its in-features
            (shape[1]) not gate's last dim; bias not [O]; tensors on different devices; an
            unknown activation.
    """
    dtype = check_glu_linear_args(gate, up, weight, bias, activation)
    if _utils.backend(gate) == "reference" or dtype not in _utils.KERNEL_DTYPES:
        return reference_glu_linear(gate, up, weight, bias, activation=activation)
    return _GLULinearFunction.apply(gate, up, weight, bias, activation, dtype)
