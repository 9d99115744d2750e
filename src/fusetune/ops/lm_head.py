"""The LM head's per-token outputs from hidden states, without the [N, V] logits: log-probs,
entropy (both differentiable) and whether the token is the argmax ("top-1", for token accuracy).
What RL and SFT trainers log and train on (TRL's fused head asks for exactly these).

With z = softcap(scale x) / temperature (folded into one scale and softcap, as
:mod:`fusetune.ops.grpo` does), p = softmax(z), L = logsumexp(z), y the token:
    log_prob = z_y - L,        entropy = L - sum_j p_j z_j
    dlog_prob/dz_j = [j == y] - p_j,        dentropy/dz_j = -p_j (z_j - L + entropy)
    is_top1 = z_y is the first maximum of z (a tie with an earlier token does not count)

Forward per chunk of rows (linear cross-entropy's chunk loop): one matmul for the chunk's
logits, the cross-entropy row kernel for L and the log-prob, and one more pass over the chunk
(``_head_stats_kernel``) for sum p z and the top-1 test when asked for. Backward recomputes each
chunk's logits, ``_head_grad_kernel`` overwrites them with the gradient of
g_logp * log_prob + g_entropy * entropy, and two matmuls give the hidden and weight gradients.
"""

from __future__ import annotations

import torch

from fusetune import _utils
from fusetune._triton import tl, triton
from fusetune.ops import cross_entropy as ce
from fusetune.ops.linear_cross_entropy import (
    _FP32_FLAGS,
    _GRAD_FLAGS,
    _fake_grads,
    _Grads,
    _logit_chunks,
    fp32_grad_flags,
    own_dtypes,
)
from fusetune.reference.grpo import HeadOutput

__all__ = ["HeadOutput", "head"]

BLOCK = 4096
INTERPRETER_BLOCK = 256


# ============================================================================ kernels


@triton.jit
def _head_stats_kernel(
    logits_ptr, labels_ptr, lse_ptr, entropy_ptr, top1_ptr, stride_row, vocab, ignore_index,
    logit_scale, logit_softcap, HAS_SCALE: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    ENTROPY: tl.constexpr, TOP1: tl.constexpr, BLOCK: tl.constexpr,
):
    """One program per row: entropy = L - sum p z, and the first-argmax test of the label."""
    row = tl.program_id(0)
    label = tl.load(labels_ptr + row).to(tl.int64)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    lse = tl.load(lse_ptr + row)
    sum_pz = 0.0
    best = float("-inf")
    before = float("-inf")  # the largest z at columns before the label
    target = float("-inf")
    if label != ignore_index:
        for start in range(0, vocab, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < vocab
            z = ce._load_transformed(
                row_ptr, cols, mask, logit_scale, logit_softcap, HAS_SCALE, HAS_SOFTCAP
            )
            if ENTROPY:
                p = tl.exp(z - lse)
                sum_pz += tl.sum(tl.where(p > 0.0, p * z, 0.0), axis=0)
            if TOP1:
                best = tl.maximum(best, tl.max(z, axis=0))
                before = tl.maximum(before, tl.max(tl.where(cols < label, z, float("-inf")), 0))
                target = tl.maximum(target, tl.max(tl.where(cols == label, z, float("-inf")), 0))
    ignored = label == ignore_index
    if ENTROPY:
        tl.store(entropy_ptr + row, tl.where(ignored, 0.0, lse - sum_pz))
    if TOP1:
        hit = (target >= best) & (target > before) & (target > float("-inf"))
        tl.store(top1_ptr + row, (hit & (label != ignore_index)).to(tl.int8))


@triton.jit
def _head_grad_kernel(
    logits_ptr, grad_ptr, labels_ptr, lse_ptr, entropy_ptr, grad_logp_ptr, grad_entropy_ptr,
    stride_row, grad_stride_row, vocab, ignore_index, logit_scale, logit_softcap,
    HAS_SCALE: tl.constexpr, HAS_SOFTCAP: tl.constexpr, LOGP_GRAD: tl.constexpr,
    ENTROPY_GRAD: tl.constexpr, BLOCK: tl.constexpr,
):
    """Grid (rows, column blocks): d(g_logp log_prob + g_entropy entropy)/dx over one block,
    written over ``grad_ptr`` (which may be the logits themselves)."""
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < vocab
    label = tl.load(labels_ptr + row).to(tl.int64)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    grad_row_ptr = grad_ptr + row.to(tl.int64) * grad_stride_row
    z = ce._load_transformed(row_ptr, cols, mask, logit_scale, logit_softcap, HAS_SCALE,
                             HAS_SOFTCAP)  # fmt: skip
    lse = tl.load(lse_ptr + row)
    p = tl.exp(z - lse)
    grad = tl.zeros([BLOCK], dtype=tl.float32)
    if LOGP_GRAD:
        g_logp = tl.load(grad_logp_ptr + row)
        grad += tl.where(cols == label, g_logp, 0.0) - p * g_logp
    if ENTROPY_GRAD:
        g_entropy = tl.load(grad_entropy_ptr + row)
        entropy = tl.load(entropy_ptr + row)
        grad -= g_entropy * tl.where(p > 0.0, p * (z - lse + entropy), 0.0)
    if HAS_SOFTCAP:
        capped = tl.where(mask, z * (1.0 / logit_softcap), 0.0)
        grad *= 1.0 - capped * capped
    if HAS_SCALE:
        grad *= logit_scale
    grad = tl.where(label == ignore_index, 0.0, grad)
    tl.store(grad_row_ptr + cols, grad.to(grad_ptr.dtype.element_ty), mask=mask)


def _block(vocab: int, device: torch.device) -> int:
    limit = INTERPRETER_BLOCK if device.type == "cpu" else BLOCK
    return min(_utils.next_power_of_2(vocab), limit)


def _stats(logits, labels, lse, entropy, top1, options: ce._Options, ignore_index: int) -> None:
    n_rows, vocab = logits.shape
    _head_stats_kernel[(n_rows,)](
        logits, labels, lse, entropy if entropy.numel() else lse, top1 if top1.numel() else lse,
        logits.stride(0), vocab, ignore_index, ENTROPY=entropy.numel() > 0,
        TOP1=top1.numel() > 0, BLOCK=_block(vocab, logits.device), num_warps=8,
        **options.kernel_args(),
    )


def _grad(logits, labels, lse, entropy, grad_logp, grad_entropy, options, ignore_index) -> None:
    """Overwrite ``logits`` [rows, V] with the gradient; a None upstream gradient is skipped."""
    n_rows, vocab = logits.shape
    block = _block(vocab, logits.device)
    _head_grad_kernel[(n_rows, _utils.cdiv(vocab, block))](
        logits, logits, labels, lse, entropy, lse if grad_logp is None else grad_logp,
        lse if grad_entropy is None else grad_entropy, logits.stride(0), logits.stride(0), vocab,
        ignore_index, LOGP_GRAD=grad_logp is not None, ENTROPY_GRAD=grad_entropy is not None,
        BLOCK=block, num_warps=8, **options.kernel_args(),
    )


# ============================================================================ custom ops

_HEAD_SCHEMA = "int ignore_index, float? logit_scale, float? logit_softcap, int chunk_override"


def _fake_forward(hidden, weight, bias, labels, ignore_index, logit_scale, logit_softcap,
                  chunk_override, want_entropy, want_top1):
    n_rows = labels.numel()
    per_row = hidden.new_empty((n_rows,), dtype=torch.float32)
    return (
        per_row, per_row.new_empty((n_rows,)),
        per_row.new_empty((n_rows if want_entropy else 0,)),
        labels.new_empty((n_rows if want_top1 else 0,), dtype=torch.bool),
    )


@_utils.register_op(
    "lm_head_forward(Tensor hidden, Tensor weight, Tensor? bias, Tensor labels, "
    f"{_HEAD_SCHEMA}, bool want_entropy, bool want_top1) -> (Tensor, Tensor, Tensor, Tensor)",
    fake=_fake_forward,
)
def _forward_op(hidden, weight, bias, labels, ignore_index, logit_scale, logit_softcap,
                chunk_override, want_entropy, want_top1):
    """(log_probs, lse, entropy or empty, is_top1 or empty) for hidden [N, H] in the matmul
    dtype, labels [N]."""
    options = ce._Options(ignore_index, 0.0, 0.0, logit_scale, logit_softcap)
    n_rows, device = labels.numel(), hidden.device
    loss = _utils.empty((n_rows,), torch.float32, device)
    lse = _utils.empty((n_rows,), torch.float32, device)
    entropy = _utils.empty((n_rows if want_entropy else 0,), torch.float32, device)
    top1 = _utils.empty((n_rows if want_top1 else 0,), torch.int8, device)
    with torch.autocast(device.type, enabled=False):
        for chunk, logits3, plan in _logit_chunks(hidden, weight, bias, chunk_override):
            ce._forward_stats(logits3, labels[chunk], options, plan, loss[chunk], lse[chunk])
            if want_entropy or want_top1:
                _stats(logits3[0], labels[chunk], lse[chunk],
                       entropy[chunk] if want_entropy else entropy,
                       top1[chunk] if want_top1 else top1, options, ignore_index)  # fmt: skip
    return loss.neg_(), lse, entropy, top1.bool()


def _fake_backward(grad_logp, grad_entropy, hidden, weight, bias, *rest):
    return _fake_grads(hidden, weight, *rest[-5:])


@_utils.register_op(
    "lm_head_backward(Tensor? grad_logp, Tensor? grad_entropy, Tensor hidden, Tensor weight, "
    f"Tensor? bias, Tensor labels, Tensor lse, Tensor entropy, {_HEAD_SCHEMA}, {_GRAD_FLAGS}, "
    f"{_FP32_FLAGS}) -> (Tensor, Tensor, Tensor)",
    fake=_fake_backward,
)
def _backward_op(grad_logp, grad_entropy, hidden, weight, bias, labels, lse, entropy,
                 ignore_index, logit_scale, logit_softcap, chunk_override, grad_hidden,
                 grad_weight, grad_bias, fp32_grad_hidden, fp32_grad_weight):
    """Gradients of hidden, weight and bias (as linear cross-entropy's: fp32 for the inputs
    whose fp32 flag is set) from per-row upstream gradients, recomputing each chunk's logits."""
    options = ce._Options(ignore_index, 0.0, 0.0, logit_scale, logit_softcap)
    grads = _Grads(hidden, weight, bias, grad_hidden, grad_weight, grad_bias,
                   (fp32_grad_hidden, fp32_grad_weight))  # fmt: skip
    grad_logp = None if grad_logp is None else grad_logp.float().contiguous()
    grad_entropy = None if grad_entropy is None else grad_entropy.float().contiguous()
    with torch.autocast(hidden.device.type, enabled=False):
        for chunk, logits3, _ in _logit_chunks(hidden, weight, bias, chunk_override):
            _grad(logits3[0], labels[chunk], lse[chunk],
                  entropy[chunk] if entropy.numel() else lse[chunk],
                  None if grad_logp is None else grad_logp[chunk],
                  None if grad_entropy is None else grad_entropy[chunk],
                  options, ignore_index)  # fmt: skip
            grads.add_chunk(logits3[0], hidden, weight, chunk)
    return grads.outputs()


# ============================================================================ autograd


class _HeadFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, head_args, want_entropy, want_top1, dtype):
        ctx.set_materialize_grads(False)
        logp, lse, entropy, top1 = _forward_op(
            hidden.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype),
            labels, *head_args, want_entropy, want_top1,
        )
        ctx.save_for_backward(hidden, weight, bias, labels, lse, entropy)
        ctx.head_args, ctx.dtype = head_args, dtype
        ctx.mark_non_differentiable(top1)
        return logp, entropy, top1

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_logp, grad_entropy, _):
        hidden, weight, bias, labels, lse, entropy = ctx.saved_tensors
        flags = tuple(ctx.needs_input_grad[:3])
        if (grad_logp is None and grad_entropy is None) or not any(flags):
            return None, None, None, None, None, None, None, None
        dtype = ctx.dtype
        raw = _backward_op(
            grad_logp, grad_entropy if entropy.numel() else None, hidden.to(dtype),
            weight.to(dtype), None if bias is None else bias.to(dtype), labels, lse, entropy,
            *ctx.head_args, *flags, *fp32_grad_flags(dtype, hidden, weight),
        )
        return (*own_dtypes(raw, flags, hidden, weight, bias), None, None, None, None, None)


def head(hidden, weight, token_ids, bias, ignore_index, logit_scale, logit_softcap,
         chunk_override, want_entropy, want_top1, dtype) -> HeadOutput:
    """The checked entry of :func:`fusetune.selective_log_softmax`'s extras (arguments already
    validated, the temperature folded into scale and softcap); hidden of any leading shape."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    labels = token_ids.reshape(-1).contiguous()  # the kernels index it densely
    head_args = (ignore_index, logit_scale, logit_softcap, chunk_override)
    logp, entropy, top1 = _HeadFunction.apply(flat, weight, bias, labels, head_args,
                                              want_entropy, want_top1, dtype)  # fmt: skip
    shape = token_ids.shape
    return HeadOutput(
        logp.view(shape),
        entropy.view(shape) if want_entropy else None,
        top1.view(shape) if want_top1 else None,
    )
