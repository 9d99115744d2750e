"""Fused cross-entropy over [N, V] or [B, T, V] logits.

Per token, with z = softcap(scale * x) and L = logsumexp(z):
    loss = L - (1 - eps) z_y - eps mean(z) + z_loss L^2
    dloss/dz_j = softmax_j (1 + 2 z_loss L) - (1 - eps) [j == y] - eps / V
    dz/dx = scale (1 - (z / softcap)^2)          (scale alone without a softcap)
With class weights w (``weight=``, as torch's): the cross-entropy terms are weighted as torch
weights them, with a = (1 - eps) w_y + eps sum(w) / V:
    loss = a L - (1 - eps) w_y z_y - eps sum_j w_j z_j / V + z_loss L^2
    dloss/dz_j = softmax_j (a + 2 z_loss L) - (1 - eps) w_y [j == y] - eps w_j / V

Two launch shapes, picked from the row count:
* many rows: one program per row reads the row once for the logsumexp and, when a gradient is
  wanted with reduction mean/sum, walks it again in reverse, so the blocks it read last are
  re-read from L2, and writes the gradient: the logits leave HBM about once.
* few rows: each row is split over several programs that write partial logsumexps, a small
  kernel merges them, and a gradient kernel then walks the chunks (the data is small enough to
  stay in L2).
With reduction "none" the gradient depends on a per-token upstream gradient, so the forward only
keeps each row's logsumexp and the backward writes the gradient.

Layout: kernels, host launchers, custom ops, the autograd Function, the public function.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fusetune import _utils
from fusetune._triton import tanh, tl, triton
from fusetune.reference.cross_entropy import check_cross_entropy_args, check_labels_in_range
from fusetune.reference.cross_entropy import cross_entropy as reference_cross_entropy

# ============================================================================ kernels


@triton.jit
def _load_transformed(
    row_ptr, cols, mask, logit_scale, logit_softcap, HAS_SCALE: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
):
    """Logits at ``cols`` as fp32 after scale and softcap; lanes outside ``mask`` are -inf."""
    z = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_SCALE:
        z = z * logit_scale
    if HAS_SOFTCAP:
        z = logit_softcap * tanh(z * (1.0 / logit_softcap))  # a multiply, not a divide, per lane
    return tl.where(mask, z, float("-inf"))


@triton.jit
def _smoothing_sum(z, cols, mask, weight_ptr, HAS_WEIGHT: tl.constexpr):
    """sum_j z_j over the block's lanes, or sum_j w_j z_j with class weights."""
    z = tl.where(mask, z, 0.0)  # first: z is -inf off the row, and -inf * 0 is NaN
    if HAS_WEIGHT:
        z = z * tl.load(weight_ptr + cols, mask=mask, other=0.0)
    return tl.sum(z, axis=0)


@triton.jit
def _block_logsumexp(z, cols, mask, weight_ptr, HAS_SMOOTHING: tl.constexpr,
                     HAS_WEIGHT: tl.constexpr):
    """logsumexp and (weighted) sum of one block of transformed logits (-inf lanes allowed)."""
    block_max = tl.max(z, axis=0)
    # A row may hold -inf logits (a masked vocabulary): shift by 0 then, never by -inf.
    shift = tl.where(block_max == float("-inf"), 0.0, block_max)
    logsumexp = shift + tl.log(tl.sum(tl.exp(z - shift), axis=0))
    sum_z = 0.0
    if HAS_SMOOTHING:
        sum_z = _smoothing_sum(z, cols, mask, weight_ptr, HAS_WEIGHT)
    return logsumexp, sum_z


@triton.jit
def _chunk_logsumexp(
    row_ptr, col_start, col_end, logit_scale, logit_softcap, weight_ptr, HAS_SCALE: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_SMOOTHING: tl.constexpr, HAS_WEIGHT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Online logsumexp of z over [col_start, col_end), and the (class-weighted) sum of z, for
    smoothing."""
    running_max = float("-inf")
    sum_exp = 0.0
    sum_z = 0.0
    for start in range(col_start, col_end, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < col_end
        z = _load_transformed(
            row_ptr, cols, mask, logit_scale, logit_softcap, HAS_SCALE, HAS_SOFTCAP
        )
        new_max = tl.maximum(running_max, tl.max(z, axis=0))
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)  # see _block_logsumexp
        sum_exp = sum_exp * tl.exp(running_max - shift) + tl.sum(tl.exp(z - shift), axis=0)
        running_max = new_max
        if HAS_SMOOTHING:
            sum_z += _smoothing_sum(z, cols, mask, weight_ptr, HAS_WEIGHT)
    shift = tl.where(running_max == float("-inf"), 0.0, running_max)
    return shift + tl.log(sum_exp), sum_z


@triton.jit
def _class_coefs(weight_ptr, weight_sum_ptr, label, vocab, label_smoothing,
                 HAS_SMOOTHING: tl.constexpr, HAS_WEIGHT: tl.constexpr):
    """(a, t): the token's coefficients of L and of z_y, (1, 1 - eps) without class weights,
    ((1 - eps) w_y + eps sum(w) / V, (1 - eps) w_y) with them."""
    row_coef = 1.0
    target_coef = 1.0 - label_smoothing
    if HAS_WEIGHT:
        in_range = (label >= 0) & (label < vocab)
        target_coef = (1.0 - label_smoothing) * tl.load(weight_ptr + tl.where(in_range, label, 0))
        row_coef = target_coef
        if HAS_SMOOTHING:
            row_coef += label_smoothing * tl.load(weight_sum_ptr) / vocab
    return row_coef, target_coef


@triton.jit
def _token_loss(
    row_ptr, label, vocab, logsumexp, sum_z, label_smoothing, z_loss, logit_scale, logit_softcap,
    row_coef, target_coef, HAS_SCALE: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr, HAS_WEIGHT: tl.constexpr,
):
    """The per-token loss; NaN when the label is outside [0, vocab) (never read out of bounds).
    (row_coef, target_coef) from _class_coefs."""
    in_range = (label >= 0) & (label < vocab)
    safe_label = tl.where(in_range, label, 0) + tl.arange(0, 1)
    target = tl.sum(
        _load_transformed(
            row_ptr, safe_label, safe_label >= 0, logit_scale, logit_softcap, HAS_SCALE, HAS_SOFTCAP
        ),
        axis=0,
    )
    if HAS_WEIGHT:
        loss = row_coef * logsumexp - target_coef * target + z_loss * logsumexp * logsumexp
    else:
        loss = logsumexp - (1.0 - label_smoothing) * target + z_loss * logsumexp * logsumexp
    if HAS_SMOOTHING:
        loss -= label_smoothing * sum_z / vocab
    return tl.where(in_range, loss, float("nan"))


@triton.jit
def _grad_weight(grad_weight_ptr, label, vocab):
    """The token's upstream gradient, NaN when its label is out of range (loss is NaN too)."""
    in_range = (label >= 0) & (label < vocab)
    return tl.where(in_range, tl.load(grad_weight_ptr), float("nan"))


@triton.jit
def _block_grad(
    z, cols, mask, label, vocab, logsumexp, grad_weight, label_smoothing, z_loss, logit_scale,
    logit_softcap, weight_ptr, row_coef, target_coef, HAS_SCALE: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_SMOOTHING: tl.constexpr, HAS_WEIGHT: tl.constexpr,
):
    """d(grad_weight * loss)/dx for one block, from its transformed logits z."""
    if HAS_WEIGHT:
        grad = tl.exp(z - logsumexp) * (row_coef + 2.0 * z_loss * logsumexp)
        if HAS_SMOOTHING:
            grad -= label_smoothing / vocab * tl.load(weight_ptr + cols, mask=mask, other=0.0)
    else:
        grad = tl.exp(z - logsumexp) * (1.0 + 2.0 * z_loss * logsumexp) - label_smoothing / vocab
    grad -= tl.where(cols == label, target_coef, 0.0)
    if HAS_SOFTCAP:
        capped = tl.where(mask, z * (1.0 / logit_softcap), 0.0)  # z is -inf off the row
        grad *= 1.0 - capped * capped
    if HAS_SCALE:
        grad *= logit_scale
    return grad * grad_weight


@triton.jit
def _chunk_grad(
    row_ptr, grad_row_ptr, col_start, col_end, label, vocab, logsumexp, grad_weight,
    label_smoothing, z_loss, logit_scale, logit_softcap, weight_ptr, row_coef, target_coef,
    HAS_SCALE: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SMOOTHING: tl.constexpr,
    HAS_WEIGHT: tl.constexpr, REVERSE: tl.constexpr, BLOCK: tl.constexpr,
):
    """Write the gradient over [col_start, col_end), last block first when REVERSE."""
    n_blocks = tl.cdiv(col_end - col_start, BLOCK)
    for i in range(0, n_blocks):
        if REVERSE:
            block = n_blocks - 1 - i
        else:
            block = i
        cols = col_start + block * BLOCK + tl.arange(0, BLOCK)
        mask = cols < col_end
        z = _load_transformed(
            row_ptr, cols, mask, logit_scale, logit_softcap, HAS_SCALE, HAS_SOFTCAP
        )
        grad = _block_grad(
            z, cols, mask, label, vocab, logsumexp, grad_weight, label_smoothing, z_loss,
            logit_scale, logit_softcap, weight_ptr, row_coef, target_coef, HAS_SCALE,
            HAS_SOFTCAP, HAS_SMOOTHING, HAS_WEIGHT,
        )
        tl.store(grad_row_ptr + cols, grad.to(grad_row_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _chunk_zero(grad_row_ptr, col_start, col_end, BLOCK: tl.constexpr):
    for start in range(col_start, col_end, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        zeros = tl.zeros([BLOCK], dtype=grad_row_ptr.dtype.element_ty)
        tl.store(grad_row_ptr + cols, zeros, mask=cols < col_end)


@triton.jit
def _row_offset(row, rows_per_batch, stride_batch, stride_row):
    """int64 element offset of flat row ``row`` in a [B, T, V] tensor with the given strides."""
    row = row.to(tl.int64)
    batch = row // rows_per_batch
    return batch * stride_batch + (row - batch * rows_per_batch) * stride_row


@triton.jit
def _ce_row_kernel(
    logits_ptr, labels_ptr, grad_ptr, loss_ptr, lse_ptr, grad_weight_ptr, rows_per_batch,
    logits_stride_b, logits_stride_t, grad_stride_b, grad_stride_t, vocab, ignore_index,
    label_smoothing, z_loss, logit_scale, logit_softcap, weight_ptr, weight_sum_ptr,
    HAS_SCALE: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SMOOTHING: tl.constexpr,
    HAS_WEIGHT: tl.constexpr, COMPUTE_GRAD: tl.constexpr, SINGLE_BLOCK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program per row: loss and logsumexp, and the gradient when COMPUTE_GRAD.
    SINGLE_BLOCK (BLOCK >= vocab): the row stays in registers between the two passes."""
    row = tl.program_id(0)
    label = tl.load(labels_ptr + row)
    row_ptr = logits_ptr + _row_offset(row, rows_per_batch, logits_stride_b, logits_stride_t)
    grad_row_ptr = grad_ptr + _row_offset(row, rows_per_batch, grad_stride_b, grad_stride_t)
    if label == ignore_index:
        tl.store(loss_ptr + row, 0.0)
        tl.store(lse_ptr + row, 0.0)
        if COMPUTE_GRAD:
            _chunk_zero(grad_row_ptr, 0, vocab, BLOCK)
    else:
        if SINGLE_BLOCK:
            cols = tl.arange(0, BLOCK)
            mask = cols < vocab
            z = _load_transformed(
                row_ptr, cols, mask, logit_scale, logit_softcap, HAS_SCALE, HAS_SOFTCAP
            )
            logsumexp, sum_z = _block_logsumexp(
                z, cols, mask, weight_ptr, HAS_SMOOTHING, HAS_WEIGHT
            )
        else:
            logsumexp, sum_z = _chunk_logsumexp(
                row_ptr, 0, vocab, logit_scale, logit_softcap, weight_ptr, HAS_SCALE, HAS_SOFTCAP,
                HAS_SMOOTHING, HAS_WEIGHT, BLOCK,
            )
        row_coef, target_coef = _class_coefs(
            weight_ptr, weight_sum_ptr, label, vocab, label_smoothing, HAS_SMOOTHING, HAS_WEIGHT
        )
        loss = _token_loss(
            row_ptr, label, vocab, logsumexp, sum_z, label_smoothing, z_loss, logit_scale,
            logit_softcap, row_coef, target_coef, HAS_SCALE, HAS_SOFTCAP, HAS_SMOOTHING,
            HAS_WEIGHT,
        )
        tl.store(loss_ptr + row, loss)
        tl.store(lse_ptr + row, logsumexp)
        if COMPUTE_GRAD:
            grad_weight = _grad_weight(grad_weight_ptr, label, vocab)
            if SINGLE_BLOCK:
                grad = _block_grad(
                    z, cols, mask, label, vocab, logsumexp, grad_weight, label_smoothing, z_loss,
                    logit_scale, logit_softcap, weight_ptr, row_coef, target_coef, HAS_SCALE,
                    HAS_SOFTCAP, HAS_SMOOTHING, HAS_WEIGHT,
                )
                tl.store(grad_row_ptr + cols, grad.to(grad_ptr.dtype.element_ty), mask=mask)
            else:
                # Reverse order: the blocks read last by the first pass are still in L2.
                _chunk_grad(
                    row_ptr, grad_row_ptr, 0, vocab, label, vocab, logsumexp, grad_weight,
                    label_smoothing, z_loss, logit_scale, logit_softcap, weight_ptr, row_coef,
                    target_coef, HAS_SCALE, HAS_SOFTCAP, HAS_SMOOTHING, HAS_WEIGHT, True, BLOCK,
                )


@triton.jit
def _ce_partial_kernel(
    logits_ptr, labels_ptr, partial_lse_ptr, partial_sum_ptr, rows_per_batch, logits_stride_b,
    logits_stride_t, vocab, chunk, num_chunks, ignore_index, logit_scale, logit_softcap,
    weight_ptr, weight_sum_ptr, HAS_SCALE: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr, HAS_WEIGHT: tl.constexpr, BLOCK: tl.constexpr,
):
    """Grid (rows, chunks): logsumexp and sum of z over one chunk of one row."""
    row = tl.program_id(0)
    chunk_id = tl.program_id(1)
    label = tl.load(labels_ptr + row)
    if label != ignore_index:
        row_ptr = logits_ptr + _row_offset(row, rows_per_batch, logits_stride_b, logits_stride_t)
        col_start = chunk_id * chunk
        col_end = tl.minimum(col_start + chunk, vocab)
        logsumexp, sum_z = _chunk_logsumexp(
            row_ptr, col_start, col_end, logit_scale, logit_softcap, weight_ptr, HAS_SCALE,
            HAS_SOFTCAP, HAS_SMOOTHING, HAS_WEIGHT, BLOCK,
        )
        slot = row.to(tl.int64) * num_chunks + chunk_id
        tl.store(partial_lse_ptr + slot, logsumexp)
        tl.store(partial_sum_ptr + slot, sum_z)


@triton.jit
def _ce_merge_kernel(
    logits_ptr, labels_ptr, partial_lse_ptr, partial_sum_ptr, loss_ptr, lse_ptr, rows_per_batch,
    logits_stride_b, logits_stride_t, vocab, num_chunks, ignore_index, label_smoothing, z_loss,
    logit_scale, logit_softcap, weight_ptr, weight_sum_ptr, HAS_SCALE: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_SMOOTHING: tl.constexpr, HAS_WEIGHT: tl.constexpr,
    CHUNKS_BLOCK: tl.constexpr,
):
    """One program per row: merge the chunks' partial logsumexps into the row's loss."""
    row = tl.program_id(0)
    label = tl.load(labels_ptr + row)
    if label == ignore_index:
        tl.store(loss_ptr + row, 0.0)
        tl.store(lse_ptr + row, 0.0)
    else:
        slots = tl.arange(0, CHUNKS_BLOCK)
        in_row = slots < num_chunks
        base = row.to(tl.int64) * num_chunks
        partial_lse = tl.load(partial_lse_ptr + base + slots, mask=in_row, other=float("-inf"))
        logsumexp, _ = _block_logsumexp(partial_lse, slots, in_row, weight_ptr, False, False)
        sum_z = tl.sum(tl.load(partial_sum_ptr + base + slots, mask=in_row, other=0.0), axis=0)
        row_ptr = logits_ptr + _row_offset(row, rows_per_batch, logits_stride_b, logits_stride_t)
        row_coef, target_coef = _class_coefs(
            weight_ptr, weight_sum_ptr, label, vocab, label_smoothing, HAS_SMOOTHING, HAS_WEIGHT
        )
        loss = _token_loss(
            row_ptr, label, vocab, logsumexp, sum_z, label_smoothing, z_loss, logit_scale,
            logit_softcap, row_coef, target_coef, HAS_SCALE, HAS_SOFTCAP, HAS_SMOOTHING,
            HAS_WEIGHT,
        )
        tl.store(loss_ptr + row, loss)
        tl.store(lse_ptr + row, logsumexp)


@triton.jit
def _ce_grad_kernel(
    logits_ptr, labels_ptr, lse_ptr, grad_weight_ptr, grad_ptr, rows_per_batch, logits_stride_b,
    logits_stride_t, grad_stride_b, grad_stride_t, grad_weight_stride, vocab, chunk, ignore_index,
    label_smoothing, z_loss, logit_scale, logit_softcap, weight_ptr, weight_sum_ptr,
    HAS_SCALE: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SMOOTHING: tl.constexpr,
    HAS_WEIGHT: tl.constexpr, BLOCK: tl.constexpr,
):
    """Grid (rows, chunks): the gradient of one chunk of one row from the saved logsumexp.
    ``grad_weight`` is one scalar (stride 0) or one value per row (stride 1)."""
    row = tl.program_id(0)
    col_start = tl.program_id(1) * chunk
    col_end = tl.minimum(col_start + chunk, vocab)
    label = tl.load(labels_ptr + row)
    grad_row_ptr = grad_ptr + _row_offset(row, rows_per_batch, grad_stride_b, grad_stride_t)
    if label == ignore_index:
        _chunk_zero(grad_row_ptr, col_start, col_end, BLOCK)
    else:
        row_ptr = logits_ptr + _row_offset(row, rows_per_batch, logits_stride_b, logits_stride_t)
        grad_weight = _grad_weight(grad_weight_ptr + row * grad_weight_stride, label, vocab)
        logsumexp = tl.load(lse_ptr + row)
        row_coef, target_coef = _class_coefs(
            weight_ptr, weight_sum_ptr, label, vocab, label_smoothing, HAS_SMOOTHING, HAS_WEIGHT
        )
        _chunk_grad(
            row_ptr, grad_row_ptr, col_start, col_end, label, vocab, logsumexp, grad_weight,
            label_smoothing, z_loss, logit_scale, logit_softcap, weight_ptr, row_coef,
            target_coef, HAS_SCALE, HAS_SOFTCAP, HAS_SMOOTHING, HAS_WEIGHT, False, BLOCK,
        )


@triton.jit
def _scale_rows_kernel(
    grad_ptr, factor_ptr, rows_per_batch, stride_b, stride_t, vocab, chunk, BLOCK: tl.constexpr
):
    """grad *= factor (a 0-dim tensor). Returns at once when factor == 1, the usual case of
    ``loss.backward()``, so that skipping the multiply needs no host sync."""
    factor = tl.load(factor_ptr)
    if factor != 1.0:
        row = tl.program_id(0)
        col_start = tl.program_id(1) * chunk
        col_end = tl.minimum(col_start + chunk, vocab)
        row_ptr = grad_ptr + _row_offset(row, rows_per_batch, stride_b, stride_t)
        for start in range(col_start, col_end, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < col_end
            grad = tl.load(row_ptr + cols, mask=mask).to(tl.float32) * factor
            tl.store(row_ptr + cols, grad.to(grad_ptr.dtype.element_ty), mask=mask)




# ============================================================================ host launchers


@dataclass(frozen=True)
class _Options:
    ignore_index: int
    label_smoothing: float
    z_loss: float
    logit_scale: float | None
    logit_softcap: float | None
    class_weight: torch.Tensor | None = None  # fp32 [V], contiguous
    class_weight_sum: torch.Tensor | None = None  # fp32 0-dim

    def weight_args(self, placeholder: torch.Tensor) -> dict:
        """The cross-entropy kernels' class-weight arguments (``placeholder``, never read,
        stands in for the pointers without class weights)."""
        has_weight = self.class_weight is not None
        return dict(
            weight_ptr=self.class_weight if has_weight else placeholder,
            weight_sum_ptr=self.class_weight_sum if has_weight else placeholder,
            HAS_WEIGHT=has_weight,
        )

    def kernel_args(self) -> dict:
        return dict(
            logit_scale=1.0 if self.logit_scale is None else self.logit_scale,
            logit_softcap=1.0 if self.logit_softcap is None else self.logit_softcap,
            HAS_SCALE=self.logit_scale is not None, HAS_SOFTCAP=self.logit_softcap is not None,
        )


@dataclass(frozen=True)
class _LaunchPlan:
    block: int  # columns one program handles per step
    chunks: int  # programs per row
    chunk: int  # columns per program (a multiple of block)
    num_warps: int


# Launch constants, measured on an H100 (tools/tune_cross_entropy.py; numbers in NOTES.md).
BLOCK = 4096  # columns a program handles per step when a row takes several steps
WARPS = 8
SINGLE_BLOCK_MAX = 32768  # rows up to this long are held in registers in one step
SINGLE_BLOCK_WARPS = 32
INTERPRETER_BLOCK = 256  # small, so that CPU tests with small vocabularies still loop and split


def _launch_plan(n_rows: int, vocab: int, device: torch.device) -> _LaunchPlan:
    """One program per row, or, when there are too few rows to fill the GPU, each row split
    over several programs."""
    programs = _utils.num_programs_in_flight(device)
    if device.type == "cpu":
        block, warps = min(_utils.next_power_of_2(vocab), INTERPRETER_BLOCK), 4
    elif vocab <= SINGLE_BLOCK_MAX and n_rows >= 2 * programs:
        block, warps = _utils.next_power_of_2(vocab), SINGLE_BLOCK_WARPS
        warps = min(warps, max(1, block // 256))
    else:
        block, warps = min(_utils.next_power_of_2(vocab), BLOCK), WARPS
    chunks = 1
    if n_rows < 2 * programs:
        chunks = max(1, min(_utils.cdiv(4 * programs, max(n_rows, 1)), vocab // (2 * block)))
    chunk = _utils.cdiv(_utils.cdiv(vocab, chunks), block) * block
    return _LaunchPlan(block=block, chunks=_utils.cdiv(vocab, chunk), chunk=chunk, num_warps=warps)


def _as_3d(logits: torch.Tensor) -> torch.Tensor:
    """[B, T, V] view of 2-D or 3-D logits whose last dim is contiguous (copying only if not)."""
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    return logits.unsqueeze(0) if logits.dim() == 2 else logits


def _row_args(tensor3: torch.Tensor) -> tuple[int, int, int]:
    return tensor3.shape[1], tensor3.stride(0), tensor3.stride(1)


def _forward_stats(logits3, labels, options, plan, loss, lse, grad3=None, grad_weight=None):
    """Fill per-token ``loss`` and ``lse``; with ``grad3``, also the gradient times grad_weight."""
    n_rows, vocab = labels.numel(), logits3.shape[-1]
    flags = dict(HAS_SMOOTHING=options.label_smoothing > 0.0, **options.kernel_args())
    common = dict(vocab=vocab, ignore_index=options.ignore_index)
    if plan.chunks == 1:
        grad_target = grad3 if grad3 is not None else logits3
        _ce_row_kernel[(n_rows,)](
            logits3, labels, grad_target, loss, lse,
            grad_weight if grad_weight is not None else lse, *_row_args(logits3),
            grad_target.stride(0), grad_target.stride(1), label_smoothing=options.label_smoothing,
            z_loss=options.z_loss, COMPUTE_GRAD=grad3 is not None,
            SINGLE_BLOCK=plan.block >= vocab, BLOCK=plan.block, num_warps=plan.num_warps, **common,
            **flags, **options.weight_args(lse),
        )
        return
    partial_lse = _utils.empty((n_rows, plan.chunks), torch.float32, logits3.device)
    partial_sum = _utils.empty((n_rows, plan.chunks), torch.float32, logits3.device)
    _ce_partial_kernel[(n_rows, plan.chunks)](
        logits3, labels, partial_lse, partial_sum, *_row_args(logits3), chunk=plan.chunk,
        num_chunks=plan.chunks, BLOCK=plan.block, num_warps=plan.num_warps, **common, **flags,
        **options.weight_args(lse),
    )
    _ce_merge_kernel[(n_rows,)](
        logits3, labels, partial_lse, partial_sum, loss, lse, *_row_args(logits3),
        num_chunks=plan.chunks, label_smoothing=options.label_smoothing, z_loss=options.z_loss,
        CHUNKS_BLOCK=_utils.next_power_of_2(plan.chunks), num_warps=1, **common, **flags,
        **options.weight_args(lse),
    )
    if grad3 is not None:
        _write_grad(logits3, labels, lse, grad_weight, grad3, options, plan)


def _write_grad(logits3, labels, lse, grad_weight, grad3, options, plan):
    """grad3 = d(sum_i grad_weight_i * loss_i)/dlogits, grad_weight 0-dim or one per row."""
    n_rows = labels.numel()
    _ce_grad_kernel[(n_rows, plan.chunks)](
        logits3, labels, lse, grad_weight, grad3, *_row_args(logits3), grad3.stride(0),
        grad3.stride(1), grad_weight_stride=1 if grad_weight.dim() else 0, vocab=logits3.shape[-1],
        chunk=plan.chunk, ignore_index=options.ignore_index,
        label_smoothing=options.label_smoothing, z_loss=options.z_loss, BLOCK=plan.block,
        num_warps=plan.num_warps, HAS_SMOOTHING=options.label_smoothing > 0.0,
        **options.kernel_args(), **options.weight_args(lse),
    )


def _scale_grad(grad3: torch.Tensor, factor: torch.Tensor, plan: _LaunchPlan) -> None:
    n_rows = grad3.shape[0] * grad3.shape[1]
    _scale_rows_kernel[(n_rows, plan.chunks)](
        grad3, factor, *_row_args(grad3), vocab=grad3.shape[-1], chunk=plan.chunk,
        BLOCK=plan.block, num_warps=plan.num_warps,
    )


# ============================================================================ custom ops


_OPTION_SCHEMA = (
    "int ignore_index, float label_smoothing, float z_loss, float? logit_scale, "
    "float? logit_softcap"
)


def _fake_forward(logits, labels, grad_weight, ignore_index, label_smoothing, z_loss,
                  logit_scale, logit_softcap, compute_grad=False, class_weight=None):
    n_rows = labels.numel()
    return (
        logits.new_empty((n_rows,), dtype=torch.float32),
        logits.new_empty((n_rows,), dtype=torch.float32),
        logits.new_empty(logits.shape if compute_grad else (0,)),
    )


def _with_class_weight(op_args: tuple, class_weight: torch.Tensor | None) -> _Options:
    """_Options from the ops' option arguments and their class weights (fp32 [V] or None)."""
    if class_weight is None:
        return _Options(*op_args)
    return _Options(*op_args, class_weight=class_weight, class_weight_sum=class_weight.sum())


def _prepare(logits: torch.Tensor, labels: torch.Tensor):
    """The kernels' view of the inputs, the per-token outputs, and the launch plan."""
    logits3, labels = _as_3d(logits), labels.reshape(-1).contiguous()
    n_rows, device = labels.numel(), logits.device
    loss = _utils.empty((n_rows,), torch.float32, device)
    lse = _utils.empty((n_rows,), torch.float32, device)
    return logits3, labels, loss, lse, _launch_plan(n_rows, logits.shape[-1], device)


@_utils.register_op(
    "cross_entropy_forward(Tensor logits, Tensor labels, Tensor grad_weight, "
    f"{_OPTION_SCHEMA}, bool compute_grad, Tensor? class_weight=None) -> (Tensor, Tensor, Tensor)",
    fake=_fake_forward,
)
def _forward_op(logits, labels, grad_weight, ignore_index, label_smoothing, z_loss, logit_scale,
                logit_softcap, compute_grad, class_weight=None):
    """Per-token loss and logsumexp (fp32, [N]); with compute_grad, the logits gradient scaled by
    grad_weight (0-dim fp32), shaped and typed like logits; else an empty tensor. class_weight:
    None or fp32 [V]."""
    options = _with_class_weight(
        (ignore_index, label_smoothing, z_loss, logit_scale, logit_softcap), class_weight
    )
    logits3, labels, loss, lse, plan = _prepare(logits, labels)
    grad = _utils.empty(logits.shape if compute_grad else (0,), logits.dtype, logits.device)
    if labels.numel():  # an empty grid cannot be launched
        grad3 = _as_3d(grad) if compute_grad else None
        _forward_stats(logits3, labels, options, plan, loss, lse, grad3, grad_weight)
    return loss, lse, grad


@_utils.register_op(
    "cross_entropy_forward_inplace(Tensor(a!) logits, Tensor labels, Tensor grad_weight, "
    f"{_OPTION_SCHEMA}, Tensor? class_weight=None) -> (Tensor, Tensor)",
    fake=lambda *args: _fake_forward(*args[:8])[:2],
)
def _forward_inplace_op(logits, labels, grad_weight, ignore_index, label_smoothing, z_loss,
                        logit_scale, logit_softcap, class_weight=None):
    """cross_entropy_forward with compute_grad, the gradient overwriting ``logits`` (whose last
    dim must be contiguous). Safe in place: each kernel writes a gradient block right after
    reading that same block, and only once the row's logsumexp is complete."""
    options = _with_class_weight(
        (ignore_index, label_smoothing, z_loss, logit_scale, logit_softcap), class_weight
    )
    logits3, labels, loss, lse, plan = _prepare(logits, labels)
    if labels.numel():
        _forward_stats(logits3, labels, options, plan, loss, lse, logits3, grad_weight)
    return loss, lse


@_utils.register_op(
    "cross_entropy_backward(Tensor grad_loss, Tensor logits, Tensor labels, Tensor lse, "
    f"{_OPTION_SCHEMA}, Tensor? class_weight=None) -> Tensor",
    fake=lambda grad_loss, logits, *rest: logits.new_empty(logits.shape),
)
def _backward_op(grad_loss, logits, labels, lse, ignore_index, label_smoothing, z_loss,
                 logit_scale, logit_softcap, class_weight=None):
    """Logits gradient from per-token upstream gradients ``grad_loss`` (fp32 [N] or 0-dim)."""
    options = _with_class_weight(
        (ignore_index, label_smoothing, z_loss, logit_scale, logit_softcap), class_weight
    )
    logits3, labels, _, _, plan = _prepare(logits, labels)
    grad = _utils.empty(logits.shape, logits.dtype, logits.device)
    if labels.numel():
        grad_weight = grad_loss.to(torch.float32).contiguous()
        _write_grad(logits3, labels, lse, grad_weight, _as_3d(grad), options, plan)
    return grad


@_utils.register_op("scale_rows_(Tensor(a!) grad, Tensor factor) -> ()",
                    fake=lambda grad, factor: None)
def _scale_op(grad, factor):
    """grad *= factor (0-dim), skipped on the device when factor == 1."""
    grad3 = _as_3d(grad)
    plan = _launch_plan(grad3.shape[0] * grad3.shape[1], grad.shape[-1], grad.device)
    if grad.numel():
        _scale_grad(grad3, factor.to(torch.float32), plan)


# ============================================================================ autograd


class _CrossEntropyFunction(torch.autograd.Function):
    """Returns (loss, lse): loss reduced with ``inv_denominator`` unless reduction is "none"."""

    @staticmethod
    def forward(
        ctx, logits, labels, class_weight, inv_denominator, ignore_index, label_smoothing, z_loss,
        logit_scale, logit_softcap, reduction, inplace_backward,
    ):
        op_args = (ignore_index, label_smoothing, z_loss, logit_scale, logit_softcap)
        needs_grad = ctx.needs_input_grad[0]
        # With a scalar upstream gradient (mean/sum) the gradient is known now: write it in the
        # same pass over the logits, and only rescale it in backward if the upstream is not 1.
        fused = needs_grad and reduction != "none"
        if fused and inplace_backward:
            loss, lse = _forward_inplace_op(
                logits, labels, inv_denominator, *op_args, class_weight
            )
            grad = logits
            if not torch.compiler.is_compiling():
                # Another autograd node that saved these logits must now fail loudly.
                torch.autograd.graph.increment_version(logits)
        else:
            loss, lse, grad = _forward_op(
                logits, labels, inv_denominator, *op_args, fused, class_weight
            )
        if reduction != "none":
            loss = loss.sum() * inv_denominator
        ctx.op_args, ctx.fused = op_args, fused
        if fused:
            ctx.save_for_backward(grad)
        elif needs_grad:
            ctx.save_for_backward(logits, labels, lse, class_weight)
        ctx.mark_non_differentiable(lse)
        return loss, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss, grad_lse):
        if ctx.fused:
            (grad,) = ctx.saved_tensors
            _scale_op(grad, grad_loss)
        else:
            logits, labels, lse, class_weight = ctx.saved_tensors
            grad = _backward_op(grad_loss, logits, labels, lse, *ctx.op_args, class_weight)
        return grad, *(None,) * 11


# ============================================================================ public function


def _optional_float(value: float | None) -> float | None:
    return None if value is None else float(value)


def op_options(
    ignore_index: int, label_smoothing: float, z_loss: float, logit_scale: float | None,
    logit_softcap: float | None,
) -> tuple:
    """The loss options in the order and Python types of the ops' ``_OPTION_SCHEMA``."""
    return (
        int(ignore_index), float(label_smoothing), float(z_loss), _optional_float(logit_scale),
        _optional_float(logit_softcap),
    )


def loss_scale(
    valid: torch.Tensor, reduction: str, num_items: float | torch.Tensor | None,
    token_class_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """1 / the loss's denominator as a 0-dim fp32 tensor on the device (no host sync): the
    non-ignored token count for "mean" (with class weights, the sum of the non-ignored tokens'
    label weights, as torch; 1 where that is 0), ``num_items`` when given, else 1."""
    if num_items is not None:
        denominator = _utils.scalar_tensor(num_items, valid.device)
    elif reduction == "mean" and token_class_weights is not None:
        total = torch.where(valid, token_class_weights, 0.0).sum()
        denominator = torch.where(total == 0, 1.0, total)
    elif reduction == "mean":
        denominator = valid.sum().clamp_min(1).to(torch.float32)
    else:
        denominator = torch.ones((), dtype=torch.float32, device=valid.device)
    return denominator.reciprocal()


def z_loss_term(
    valid: torch.Tensor, lse: torch.Tensor, z_loss: float, reduction: str,
    inv_denominator: torch.Tensor,
) -> torch.Tensor:
    """The z-loss part of the loss alone, detached, reduced like the loss (for logging)."""
    z_term = torch.where(valid, z_loss * lse.view(valid.shape).square(), 0.0)
    value = z_term if reduction == "none" else z_term.sum() * inv_denominator
    return value.detach()


def _class_weights(
    weight: torch.Tensor | None, labels: torch.Tensor
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(fp32 contiguous class weights [V], each token's label weight) or (None, None). A label
    out of range reads a clamped index here: the kernel gives that token NaN anyway."""
    if weight is None:
        return None, None
    class_weight = weight.detach().to(torch.float32).contiguous()
    safe_labels = labels.clamp(0, class_weight.shape[0] - 1).long()
    return class_weight, class_weight[safe_labels]


def cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, *, ignore_index: int = -100,
    reduction: str = "mean", label_smoothing: float = 0.0, logit_softcap: float | None = None,
    logit_scale: float | None = None, z_loss: float = 0.0,
    num_items: float | torch.Tensor | None = None, return_z_loss: bool = False,
    inplace_backward: bool = False, weight: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy of ``logits`` against integer ``labels``, fused forward and backward.

    Args:
        logits: [N, V] or [B, T, V], float32 / float16 / bfloat16, any strides (a slice such as
            ``logits[:, :-1]`` is read in place). Computation is fp32 whatever the dtype.
        labels: [N] or [B, T] (logits' leading dims), int64 or int32. Tokens equal to
            ``ignore_index`` contribute 0 to the loss and get a zero gradient.
        ignore_index: label value to skip.
        reduction: "mean" (over non-ignored tokens; 0, not NaN, when all are ignored), "sum",
            or "none" (per-token losses shaped like labels; ignored tokens give 0).
        label_smoothing: ε in [0, 1]; the target is (1 - ε) one-hot + ε / V, as in torch.
        logit_softcap: c > 0; logits become c * tanh(x / c) (Gemma 2), after logit_scale.
        logit_scale: s > 0; logits become s * x (Cohere). Both enter the gradient.
        z_loss: coefficient of the auxiliary logsumexp^2 term added per token.
        num_items: when given, loss = sum over tokens / num_items (a Python number or a 1-element
            tensor, read on the device: no host sync); the gradient-accumulation normaliser.
        return_z_loss: also return the z-loss term alone (detached, same reduction) for logging.
        inplace_backward: write the gradient into ``logits``' storage during the forward (saves
            a buffer the size of the logits). Safe only when nothing reads ``logits`` after this
            call: not you, and no other autograd node that saved them (in eager mode autograd
            raises if one did: the logits' version counter is bumped; under torch.compile
            that check is Dynamo's). Needs reduction "mean" or "sum".
        weight: optional class weights [V] (floating, on the logits' device), as in
            ``torch.nn.functional.cross_entropy``: a token's cross-entropy is scaled by its
            label's weight (with label smoothing, each class's share of the smoothed target by
            its own), and "mean" divides by the sum of the non-ignored tokens' label weights
            (0, not NaN, when that sum is 0). The z-loss term is not weighted. Not
            differentiated (nor is it in torch). Costs nothing when not given.

    Returns:
        the loss (fp32; 0-dim, or shaped like labels with reduction "none"), and with
        ``return_z_loss`` a (loss, z_loss) pair. The logits gradient has the logits' dtype.

    Raises:
        TypeError: logits not floating point; labels not an integer tensor; a non-number option.
        ValueError: labels' shape not logits' leading dims; logits not 2-D or 3-D; an unknown
            reduction; label_smoothing outside [0, 1]; logit_softcap or logit_scale <= 0;
            z_loss < 0; num_items with reduction "none"; tensors on different devices; on the
            CPU, a label outside [0, V) that is not ignore_index; weight not [V].

    A label outside [0, V) on the GPU is never read out of bounds; that token's loss and
    gradient come out NaN, so the error shows in the loss without a host sync.
    """
    check_cross_entropy_args(
        logits, labels, weight, reduction=reduction, label_smoothing=label_smoothing,
        logit_softcap=logit_softcap, logit_scale=logit_scale, z_loss=z_loss, num_items=num_items,
        inplace_backward=inplace_backward,
    )
    if _utils.backend(logits) == "reference":
        return reference_cross_entropy(
            logits, labels, ignore_index=ignore_index, reduction=reduction,
            label_smoothing=label_smoothing, logit_softcap=logit_softcap, logit_scale=logit_scale,
            z_loss=z_loss, num_items=num_items, return_z_loss=return_z_loss, weight=weight,
        )
    if logits.device.type == "cpu" and not torch.compiler.is_compiling():
        check_labels_in_range(labels, logits.shape[-1], ignore_index)

    if inplace_backward and logits.stride(-1) != 1:
        logits = logits.contiguous()  # the kernels need a unit column stride to write in place
    valid = labels != ignore_index
    class_weight, token_class_weights = _class_weights(weight, labels)
    inv_denominator = loss_scale(valid, reduction, num_items, token_class_weights)

    loss, lse = _CrossEntropyFunction.apply(
        logits, labels, class_weight, inv_denominator,
        *op_options(ignore_index, label_smoothing, z_loss, logit_scale, logit_softcap),
        reduction, inplace_backward,
    )
    if reduction == "none":
        loss = loss.view(labels.shape)
    if not return_z_loss:
        return loss
    return loss, z_loss_term(valid, lse, z_loss, reduction, inv_denominator)
