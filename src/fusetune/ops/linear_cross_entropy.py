"""Fused linear cross-entropy: the lm_head matmul and the loss without the [N, V] logits.

Rows are taken a chunk at a time. For each chunk the logits are computed into one reused
buffer (cuBLAS), the cross-entropy kernels of :mod:`fusetune.ops.cross_entropy` turn them into
their gradient in place, and two more matmuls give that chunk's hidden gradient and its share
of the weight gradient. With a scalar upstream gradient (reduction "mean" or "sum") all of this
happens in the forward: three matmuls in all, and backward only rescales when the upstream
gradient is not 1. With reduction "none" the forward keeps each row's logsumexp and backward
recomputes the logits chunk by chunk (four matmuls).

Class weights go to the cross-entropy kernels as they are (their HAS_WEIGHT path). Token
weights t scale each row's loss: the fused forward then needs a per-row gradient scale, which
only the cross-entropy gradient kernel takes, so each chunk runs the statistics kernel and then
that one (one more read of the chunk's logits, only when token weights are given).

The extra memory is one chunk of logits, sized from the weight and the free memory (never from
N x V), plus per-row fp32 statistics.
"""

from __future__ import annotations

import torch

from fusetune import _utils
from fusetune.ops import cross_entropy as ce
from fusetune.reference.cross_entropy import check_labels_in_range
from fusetune.reference.linear_cross_entropy import (
    check_linear_cross_entropy_args,
    matmul_dtype,
    shift_labels,
)
from fusetune.reference.linear_cross_entropy import (
    linear_cross_entropy as reference_linear_cross_entropy,
)

# A chunk's logits take 1 / LOGITS_WEIGHT_FRACTION of the weight's bytes (the weight gradient,
# which any training step allocates, is as large), but at least MIN_CHUNK_ROWS rows and
# MIN_LOGITS_BYTES, and at most a quarter of the free memory. Below about 1024 rows (or 256 MiB
# of logits at a small vocabulary) the three matmuls run thin and every chunk re-reads the
# weight gradient: on an H100 (tools/tune_head.py, NOTES.md) linear CE at H=896 V=151936 takes
# 26.7 ms at 192 rows and 13.9 at 1024; at H=4096 V=128256 45.5 at 512 and 41.0 at 1024.
# Rows per chunk are a multiple of ROW_ALIGN, which keeps the matmuls in full tiles.
LOGITS_WEIGHT_FRACTION = 8
MIN_CHUNK_ROWS = 1024
MIN_LOGITS_BYTES = 256 * 2**20
ROW_ALIGN = 64


def _free_bytes(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def chunk_rows(
    n_rows: int, weight: torch.Tensor, override: int = 0,
    weight_fraction: int = LOGITS_WEIGHT_FRACTION,
) -> int:
    """Rows per chunk: ``override`` when > 0, else chosen from the weight and the free memory
    (a chunk's logits take 1 / ``weight_fraction`` of the weight's bytes, at least
    MIN_CHUNK_ROWS rows and MIN_LOGITS_BYTES, at most a quarter of the free memory)."""
    if override > 0:
        return max(1, min(override, n_rows))
    vocab, element = weight.shape[0], weight.element_size()
    row_bytes = vocab * element
    budget = max(weight.numel() * element // weight_fraction, MIN_LOGITS_BYTES,
                 MIN_CHUNK_ROWS * row_bytes)  # fmt: skip
    free = _free_bytes(weight.device)
    if free is not None:
        budget = min(budget, free // 4)
    rows = max(ROW_ALIGN, budget // row_bytes // ROW_ALIGN * ROW_ALIGN)
    return max(1, min(rows, n_rows))


# ============================================================================ chunk loop


# ``torch.mm(..., out_dtype=torch.float32)`` from 16-bit operands (cuBLAS, fp32 output)
_MM_OUT_DTYPE = tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 8)


def _mm_fp32(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, accumulate: bool) -> None:
    """``out (+)= a @ b`` where ``out`` may be fp32 and a, b 16-bit: the product is never
    rounded to the 16-bit dtype (on CUDA one cuBLAS call; elsewhere the operands are upcast)."""
    if a.dtype == out.dtype:
        if accumulate:
            out.addmm_(a, b)
        else:
            torch.mm(a, b, out=out)
    elif out.is_cuda and _MM_OUT_DTYPE:
        if accumulate:
            torch.addmm(out, a, b, out_dtype=torch.float32, out=out)
        else:
            torch.mm(a, b, out_dtype=torch.float32, out=out)
    elif accumulate:
        out.addmm_(a.float(), b.float())
    else:
        torch.mm(a.float(), b.float(), out=out)


class _Grads:
    """The gradients being accumulated over chunks, in the matmul dtype, or in fp32 for those
    whose ``fp32`` flag is set (an fp32 input under a 16-bit matmul: its gradient is then
    summed over the chunks without rounding to 16 bits, as an fp32 master weight needs); bias's
    in fp32; an empty tensor for each one not asked for."""

    def __init__(self, hidden, weight, bias, grad_hidden, grad_weight, grad_bias,
                 fp32=(False, False)):  # fmt: skip
        device = hidden.device
        hidden_dtype = torch.float32 if fp32[0] else hidden.dtype
        weight_dtype = torch.float32 if fp32[1] else weight.dtype
        self.hidden = _utils.empty(hidden.shape if grad_hidden else (0,), hidden_dtype, device)
        self.weight = _utils.empty(weight.shape if grad_weight else (0,), weight_dtype, device)
        bias_shape = (weight.shape[0],) if grad_bias else (0,)
        self.bias = torch.zeros(bias_shape, dtype=torch.float32, device=device)
        self.started = False
        if hidden.shape[0] == 0:  # no chunk will write them
            self.hidden.zero_()
            self.weight.zero_()

    def add_chunk(self, grad_logits, hidden, weight, rows: slice) -> None:
        """Accumulate one chunk's contribution, given its logits gradient [rows, V]."""
        if self.hidden.numel():
            _mm_fp32(grad_logits, weight, self.hidden[rows], accumulate=False)
        if self.weight.numel():
            _mm_fp32(grad_logits.t(), hidden[rows], self.weight, accumulate=self.started)
        if self.bias.numel():
            self.bias += grad_logits.sum(dim=0, dtype=torch.float32)
        self.started = True

    def outputs(self):
        return self.hidden, self.weight, self.bias


def _logit_chunks(hidden, weight, bias, chunk_override: int,
                  weight_fraction: int = LOGITS_WEIGHT_FRACTION):
    """(rows, logits [1, rows, V], cross-entropy launch plan) for each chunk of rows. The logits
    share one buffer: a chunk's are overwritten when the next chunk is asked for."""
    n_rows, vocab = hidden.shape[0], weight.shape[0]
    rows = chunk_rows(n_rows, weight, chunk_override, weight_fraction)
    buffer = _utils.empty((min(rows, n_rows), vocab), hidden.dtype, hidden.device)
    plan = ce._launch_plan(rows, vocab, hidden.device)
    for start in range(0, n_rows, rows):
        chunk = slice(start, min(start + rows, n_rows))
        logits = buffer[: chunk.stop - start]
        if bias is None:
            torch.mm(hidden[chunk], weight.t(), out=logits)
        else:
            torch.addmm(bias, hidden[chunk], weight.t(), out=logits)
        yield chunk, logits.unsqueeze(0), plan


# ============================================================================ custom ops


_GRAD_FLAGS = "bool grad_hidden, bool grad_weight, bool grad_bias"
# _Grads' fp32 flags: the hidden / weight gradient accumulates in fp32 (an fp32 input)
_FP32_FLAGS = "bool fp32_grad_hidden, bool fp32_grad_weight"


def _fake_grads(hidden, weight, grad_hidden, grad_weight, grad_bias, fp32_hidden=False,
                fp32_weight=False):  # fmt: skip
    return (
        hidden.new_empty(hidden.shape if grad_hidden else (0,),
                         dtype=torch.float32 if fp32_hidden else hidden.dtype),
        weight.new_empty(weight.shape if grad_weight else (0,),
                         dtype=torch.float32 if fp32_weight else weight.dtype),
        weight.new_empty((weight.shape[0],) if grad_bias else (0,), dtype=torch.float32),
    )  # fmt: skip


def fp32_grad_flags(dtype: torch.dtype, *inputs: torch.Tensor) -> tuple[bool, ...]:
    """For each input, whether its gradient accumulates in fp32: an fp32 input whose matmuls
    run in a 16-bit ``dtype`` (autocast, or mixed with a 16-bit tensor)."""
    return tuple(t.dtype == torch.float32 and dtype != torch.float32 for t in inputs)


def _fake_forward(hidden, weight, bias, labels, grad_scale, *rest):
    *_, grad_hidden, grad_weight, grad_bias, fp32_hidden, fp32_weight, class_weight = rest
    per_row = hidden.new_empty((hidden.shape[0],), dtype=torch.float32)
    grads = _fake_grads(hidden, weight, grad_hidden, grad_weight, grad_bias, fp32_hidden,
                        fp32_weight)  # fmt: skip
    return (per_row, per_row.new_empty(per_row.shape), *grads)


@_utils.register_op(
    "linear_cross_entropy_forward(Tensor hidden, Tensor weight, Tensor? bias, Tensor labels, "
    f"Tensor grad_scale, {ce._OPTION_SCHEMA}, int chunk_override, {_GRAD_FLAGS}, "
    f"{_FP32_FLAGS}, Tensor? class_weight) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
    fake=_fake_forward,
)
def _forward_op(hidden, weight, bias, labels, grad_scale, ignore_index, label_smoothing, z_loss,
                logit_scale, logit_softcap, chunk_override, grad_hidden, grad_weight, grad_bias,
                fp32_grad_hidden, fp32_grad_weight, class_weight):
    """hidden [N, H], weight [V, H], bias [V] in the matmul dtype; labels [N]; class_weight
    fp32 [V] or None.

    Returns per-row loss and logsumexp (fp32 [N]) and, for each grad flag set, the gradient of
    ``sum(grad_scale * loss)`` (grad_scale fp32, 0-dim or one per row [N]): hidden's and
    weight's in their dtype (fp32 where its fp32 flag is set), bias's in fp32; an empty tensor
    for each flag not set."""
    options = ce._with_class_weight(
        (ignore_index, label_smoothing, z_loss, logit_scale, logit_softcap), class_weight
    )
    per_row_scale = grad_scale.dim() == 1
    n_rows, device = labels.numel(), hidden.device
    loss = _utils.empty((n_rows,), torch.float32, device)
    lse = _utils.empty((n_rows,), torch.float32, device)
    grads = _Grads(hidden, weight, bias, grad_hidden, grad_weight, grad_bias,
                   (fp32_grad_hidden, fp32_grad_weight))  # fmt: skip
    compute_grad = grad_hidden or grad_weight or grad_bias
    with torch.autocast(device.type, enabled=False):
        for chunk, logits3, plan in _logit_chunks(hidden, weight, bias, chunk_override):
            # the gradient overwrites the logits
            grad3 = logits3 if compute_grad and not per_row_scale else None
            ce._forward_stats(
                logits3, labels[chunk], options, plan, loss[chunk], lse[chunk], grad3, grad_scale
            )
            if compute_grad and per_row_scale:
                ce._write_grad(
                    logits3, labels[chunk], lse[chunk], grad_scale[chunk], logits3, options, plan
                )
            if compute_grad:
                grads.add_chunk(logits3[0], hidden, weight, chunk)
    return (loss, lse, *grads.outputs())


@_utils.register_op(
    "linear_cross_entropy_backward(Tensor grad_loss, Tensor hidden, Tensor weight, "
    f"Tensor? bias, Tensor labels, Tensor lse, {ce._OPTION_SCHEMA}, int chunk_override, "
    f"{_GRAD_FLAGS}, {_FP32_FLAGS}, Tensor? class_weight) -> (Tensor, Tensor, Tensor)",
    fake=lambda grad_loss, hidden, weight, bias, labels, lse, *rest: _fake_grads(
        hidden, weight, *rest[-6:-1]
    ),
)
def _backward_op(grad_loss, hidden, weight, bias, labels, lse, ignore_index, label_smoothing,
                 z_loss, logit_scale, logit_softcap, chunk_override, grad_hidden, grad_weight,
                 grad_bias, fp32_grad_hidden, fp32_grad_weight, class_weight):
    """Gradients from per-row upstream gradients ``grad_loss`` (fp32 [N]), recomputing the
    logits chunk by chunk from the saved logsumexp."""
    options = ce._with_class_weight(
        (ignore_index, label_smoothing, z_loss, logit_scale, logit_softcap), class_weight
    )
    device = hidden.device
    grads = _Grads(hidden, weight, bias, grad_hidden, grad_weight, grad_bias,
                   (fp32_grad_hidden, fp32_grad_weight))  # fmt: skip
    grad_loss = grad_loss.to(torch.float32).contiguous()
    with torch.autocast(device.type, enabled=False):
        for chunk, logits3, plan in _logit_chunks(hidden, weight, bias, chunk_override):
            ce._write_grad(
                logits3, labels[chunk], lse[chunk], grad_loss[chunk], logits3, options, plan
            )
            grads.add_chunk(logits3[0], hidden, weight, chunk)
    return grads.outputs()


# ============================================================================ autograd


def _cast(tensor: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if tensor is None else tensor.to(dtype)


class _LinearCrossEntropyFunction(torch.autograd.Function):
    """Returns (loss, lse) for hidden [N, H]; loss reduced with ``inv_denominator`` unless
    reduction is "none". class_weight: fp32 [V] or None; token_weight: fp32 [N] or None, each
    row's loss multiplied by it."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, class_weight, token_weight, inv_denominator,
                op_args, reduction, chunk_override, dtype):  # fmt: skip
        flags = tuple(ctx.needs_input_grad[:3])
        # With a scalar upstream gradient the gradients are known now: compute them in the
        # same pass over each chunk of logits; backward then only rescales.
        fused = any(flags) and reduction != "none"
        grad_scale = inv_denominator if token_weight is None else inv_denominator * token_weight
        fp32 = fp32_grad_flags(dtype, hidden, weight)
        loss, lse, *grads = _forward_op(
            hidden.to(dtype), weight.to(dtype), _cast(bias, dtype), labels, grad_scale,
            *op_args, chunk_override, *(flags if fused else (False,) * 3), *fp32, class_weight,
        )
        if token_weight is not None:
            loss = loss * token_weight
        if reduction != "none":
            loss = loss.sum() * inv_denominator
        ctx.fused, ctx.flags, ctx.dtype = fused, flags, dtype
        ctx.op_args, ctx.chunk_override = op_args, chunk_override
        if fused:
            ctx.save_for_backward(*own_dtypes(grads, flags, hidden, weight, bias))
        elif any(flags):
            ctx.save_for_backward(hidden, weight, bias, labels, lse, class_weight, token_weight)
        ctx.mark_non_differentiable(lse)
        return loss, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss, grad_lse):
        if ctx.fused:
            grads = scale_fused_grads(ctx.saved_tensors, grad_loss)
        else:
            hidden, weight, bias, labels, lse, class_weight, token_weight = ctx.saved_tensors
            if token_weight is not None:
                grad_loss = grad_loss * token_weight
            raw = _backward_op(
                grad_loss, hidden.to(ctx.dtype), weight.to(ctx.dtype), _cast(bias, ctx.dtype),
                labels, lse, *ctx.op_args, ctx.chunk_override, *ctx.flags,
                *fp32_grad_flags(ctx.dtype, hidden, weight), class_weight,
            )
            grads = own_dtypes(raw, ctx.flags, hidden, weight, bias)
        return (*grads, *(None,) * 8)


def scale_fused_grads(grads, grad_loss: torch.Tensor) -> tuple:
    """(grad_hidden, grad_weight, grad_bias) computed in the forward for an upstream gradient
    of 1, times the real upstream gradient (0-dim); None entries stay None."""
    grad_hidden, grad_weight, grad_bias = grads
    for grad in (grad_hidden, grad_weight):
        if grad is not None:
            ce._scale_op(grad, grad_loss)  # in place; skipped on the device if 1
    if grad_bias is not None:  # [V]: small, and not mutated through a view (Inductor)
        grad_bias = grad_bias * grad_loss.to(grad_bias.dtype)
    return grad_hidden, grad_weight, grad_bias


def own_dtypes(grads, flags, *inputs):
    """Each asked-for gradient in its input's dtype; None for the others."""
    return tuple(
        grad.to(tensor.dtype) if wanted else None
        for grad, wanted, tensor in zip(grads, flags, inputs, strict=True)
    )


# ============================================================================ public function


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    shift: bool = False,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    logit_softcap: float | None = None,
    logit_scale: float | None = None,
    z_loss: float = 0.0,
    num_items: float | torch.Tensor | None = None,
    return_z_loss: bool = False,
    chunk_size: int | None = None,
    class_weight: torch.Tensor | None = None,
    token_weight: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``cross_entropy(hidden @ weight.T + bias, labels)`` without materialising the logits.

    Args:
        hidden: [N, H] or [B, T, H], float32 / float16 / bfloat16 (rows may be strided).
        weight: [V, H], the lm_head weight; float32 / float16 / bfloat16.
        labels: [N] or [B, T] (hidden's leading dims), int64 or int32.
        bias: optional [V].
        shift: causal-LM next-token loss: position t is scored against labels[..., t + 1] and
            the last position of each sequence is dropped. hidden is not copied.
        ignore_index, reduction, label_smoothing, logit_softcap, logit_scale, z_loss,
        num_items, return_z_loss: as in :func:`fusetune.cross_entropy`, applied to the logits.
        chunk_size: rows per chunk (default: chosen so that a chunk's logits take about 1/8 of
            the weight's bytes and at most a quarter of the free GPU memory).
        class_weight: optional class weights [V] (floating, not differentiated): what
            ``weight=`` is to :func:`fusetune.cross_entropy` and torch's cross-entropy (named
            apart from the lm_head ``weight``). Costs nothing when not given.
        token_weight: optional per-token loss weights, labels' shape (floating, not
            differentiated; with ``shift``, a weight goes with its label token, as the labels
            move). Each token's loss (its z-loss term included) is multiplied by its weight;
            "mean" divides by the sum over non-ignored tokens of the token weight (times the
            label's class weight with ``class_weight``; 1, not NaN, when that sum is 0). When
            given, the fused forward reads each chunk of logits once more.

    Precision: the matmuls run in the autocast dtype under torch.autocast, as F.linear does;
    outside autocast in the inputs' dtype, or, when float32 is mixed with a 16-bit dtype, in
    the 16-bit one (float16 mixed with bfloat16 is an error). They accumulate in fp32; the
    logits are held in the matmul dtype, the loss is computed in fp32. The weight gradient is
    summed over the row chunks in the matmul dtype (one rounding per chunk), or, for an fp32
    weight (an fp32 master weight under autocast), in fp32 without rounding to 16 bits; the
    same for hidden's gradient.

    Returns:
        the loss (fp32; 0-dim, or [N] / [B, T] (T - 1 with shift) for reduction "none"); with
        ``return_z_loss`` a (loss, z_loss) pair. Gradients of hidden, weight and bias come back
        in each one's own dtype; a tensor that does not require grad costs no gradient work
        (a frozen lm_head skips a third of the matmuls).

    Raises:
        TypeError: a non-floating hidden, weight or bias; integer-less labels; float16 mixed
            with bfloat16 outside autocast; a non-number option.
        ValueError: hidden's last dim not weight's in-features (with a hint when it equals the
            vocabulary size: logits passed for hidden states); labels not hidden's leading dims;
            bias not [V]; class_weight not [V]; token_weight not labels' shape; tensors on
            different devices; any option error of
            :func:`fusetune.cross_entropy`; on the CPU, a label outside [0, V).
    """
    options = dict(
        reduction=reduction, label_smoothing=label_smoothing, logit_softcap=logit_softcap,
        logit_scale=logit_scale, z_loss=z_loss, num_items=num_items,
    )
    loss_weights = dict(class_weight=class_weight, token_weight=token_weight)
    check_linear_cross_entropy_args(
        hidden, weight, labels, bias, chunk_size=chunk_size, **loss_weights, **options
    )
    if _utils.backend(hidden) == "reference":
        return reference_linear_cross_entropy(
            hidden, weight, labels, bias, shift=shift, ignore_index=ignore_index,
            return_z_loss=return_z_loss, chunk_size=chunk_size, **loss_weights, **options,
        )
    dtype = matmul_dtype(hidden, weight)
    if hidden.device.type == "cpu" and not torch.compiler.is_compiling():
        check_labels_in_range(labels, weight.shape[0], ignore_index)
    shaped_labels = shift_labels(labels, ignore_index) if shift else labels
    flat_labels = shaped_labels.reshape(-1).contiguous()  # the kernels index it densely
    valid = flat_labels != ignore_index
    class_weight, token_class_weights = ce._class_weights(class_weight, flat_labels)
    token_weight = _flat_token_weight(token_weight, shift)
    inv_denominator = ce.loss_scale(
        valid, reduction, num_items, _denominator_weights(token_weight, token_class_weights)
    )
    op_args = ce.op_options(ignore_index, label_smoothing, z_loss, logit_scale, logit_softcap)
    loss, lse = _LinearCrossEntropyFunction.apply(
        hidden.reshape(-1, hidden.shape[-1]), weight, bias, flat_labels, class_weight,
        token_weight, inv_denominator, op_args, reduction, int(chunk_size or 0), dtype,
    )
    if reduction == "none":
        loss = _unshift(loss.view(labels.shape), shift)
    if not return_z_loss:
        return loss
    z_value = _z_loss_value(valid, lse, z_loss, reduction, inv_denominator, token_weight)
    return loss, _unshift(z_value.view(labels.shape), shift) if reduction == "none" else z_value


def _z_loss_value(valid, lse, z_loss, reduction, inv_denominator, token_weight):
    """The z-loss part of the loss alone, detached, reduced like the loss (for logging);
    scaled by the token weights when given."""
    if token_weight is None:
        return ce.z_loss_term(valid, lse, z_loss, reduction, inv_denominator)
    z_term = torch.where(valid, z_loss * lse.square() * token_weight, 0.0)
    value = z_term if reduction == "none" else z_term.sum() * inv_denominator
    return value.detach()


def _flat_token_weight(token_weight: torch.Tensor | None, shift: bool) -> torch.Tensor | None:
    """Token weights as fp32 [N], moved with the labels under ``shift`` (the last position,
    whose label is ignored, gets 0)."""
    if token_weight is None:
        return None
    token_weight = token_weight.detach().to(torch.float32)
    if shift:
        tail = token_weight.new_zeros((*token_weight.shape[:-1], 1))
        token_weight = torch.cat([token_weight[..., 1:], tail], dim=-1)
    return token_weight.reshape(-1).contiguous()


def _denominator_weights(token_weight, token_class_weights):
    """What "mean" sums over the non-ignored tokens: token weight times label weight, either
    one alone, or None (a count)."""
    if token_weight is None or token_class_weights is None:
        return token_weight if token_class_weights is None else token_class_weights
    return token_weight * token_class_weights


def _unshift(per_token: torch.Tensor, shift: bool) -> torch.Tensor:
    return per_token[..., :-1] if shift else per_token
