"""Rotary position embedding of q and k in one launch, forward and backward.

Each rotated pair (i, j) of a head maps as a 2x2 matrix (half-split: j = i + R/2; interleaved:
i = 2p, j = 2p + 1):
    [out_i]   [cos_i  -sin_i] [x_i]
    [out_j] = [sin_j   cos_j] [x_j]
The backward applies the transpose of that matrix (the inverse rotation when cos_i = cos_j and
sin_i = sin_j, as rotary tables have), so one kernel serves both directions. cos and sin are
read in full (no assumption that their halves repeat), which keeps the op exactly
transformers' ``q * cos + rotate_half(q) * sin`` for any table.

One program per token (batch, position): it loads that position's cos/sin row once and walks
the heads of q and then of k in tiles; dims past rotary_dim are copied through. Layouts differ
only in strides, so BTHD and BHTD (and strided views of either) share the kernel.

Layout: kernels, host launchers, custom ops, the autograd Function, the public function.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from fusetune import _utils
from fusetune._triton import tl, triton
from fusetune.reference.rope import check_rope_args
from fusetune.reference.rope import rope as reference_rope

# ============================================================================ kernels


@triton.jit
def _rotate_heads(
    x_ptr, out_ptr, x_token, out_token, x_head_stride, out_head_stride, n_heads, cos_first,
    cos_second, sin_first, sin_second, first, second, pair_mask, rotary_dim, head_dim,
    TRANSPOSE: tl.constexpr, HAS_PASS: tl.constexpr, BLOCK_HEADS: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
):
    """Rotate every head of one token (x_token / out_token: int64 element offsets)."""
    for head_start in range(0, n_heads, BLOCK_HEADS):
        heads = head_start + tl.arange(0, BLOCK_HEADS)
        head_mask = heads < n_heads
        mask = head_mask[:, None] & pair_mask[None, :]
        x_heads = x_ptr + x_token + heads[:, None].to(tl.int64) * x_head_stride
        out_heads = out_ptr + out_token + heads[:, None].to(tl.int64) * out_head_stride
        x_first = tl.load(x_heads + first[None, :], mask=mask, other=0.0).to(tl.float32)
        x_second = tl.load(x_heads + second[None, :], mask=mask, other=0.0).to(tl.float32)
        if TRANSPOSE:
            out_first = x_first * cos_first[None, :] + x_second * sin_second[None, :]
            out_second = x_second * cos_second[None, :] - x_first * sin_first[None, :]
        else:
            out_first = x_first * cos_first[None, :] - x_second * sin_first[None, :]
            out_second = x_second * cos_second[None, :] + x_first * sin_second[None, :]
        out_dtype = out_ptr.dtype.element_ty
        tl.store(out_heads + first[None, :], out_first.to(out_dtype), mask=mask)
        tl.store(out_heads + second[None, :], out_second.to(out_dtype), mask=mask)
        if HAS_PASS:  # dims past rotary_dim: copied (gradient passes through unchanged)
            for pass_start in range(rotary_dim, head_dim, BLOCK_PASS):
                cols = pass_start + tl.arange(0, BLOCK_PASS)
                pass_mask = head_mask[:, None] & (cols < head_dim)[None, :]
                rest = tl.load(x_heads + cols[None, :], mask=pass_mask, other=0.0)
                tl.store(out_heads + cols[None, :], rest.to(out_dtype), mask=pass_mask)


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, q_out_ptr, k_out_ptr, cos_ptr, sin_ptr, position_ids_ptr, seq_len,
    n_q_heads, n_k_heads, head_dim, rotary_dim, n_positions,
    q_stride_b, q_stride_t, q_stride_h, k_stride_b, k_stride_t, k_stride_h,
    q_out_stride_b, q_out_stride_t, q_out_stride_h, k_out_stride_b, k_out_stride_t,
    k_out_stride_h, cos_stride_b, cos_stride_t, position_stride_b, position_stride_t,
    HAS_POSITION_IDS: tl.constexpr, INTERLEAVED: tl.constexpr, TRANSPOSE: tl.constexpr,
    HAS_PASS: tl.constexpr, BLOCK_PAIRS: tl.constexpr, BLOCK_HEADS: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
):
    """One program per token: rotate q's and k's heads at (batch, t)."""
    token = tl.program_id(0)
    batch = (token // seq_len).to(tl.int64)
    t = (token % seq_len).to(tl.int64)
    pairs = tl.arange(0, BLOCK_PAIRS)
    pair_mask = pairs < rotary_dim // 2
    if INTERLEAVED:
        first, second = 2 * pairs, 2 * pairs + 1
    else:
        first, second = pairs, pairs + rotary_dim // 2
    if HAS_POSITION_IDS:
        position = tl.load(position_ids_ptr + batch * position_stride_b + t * position_stride_t)
        position = position.to(tl.int64)
        cos_row = position * cos_stride_t
        # An out-of-range position is never read: its outputs come out NaN (no host sync).
        positions = position + tl.zeros([BLOCK_PAIRS], dtype=tl.int64)
        cos_mask = pair_mask & (positions >= 0) & (positions < n_positions)
    else:
        cos_row = batch * cos_stride_b + t * cos_stride_t
        cos_mask = pair_mask
    nan = float("nan")
    cos_first = tl.load(cos_ptr + cos_row + first, mask=cos_mask, other=nan).to(tl.float32)
    cos_second = tl.load(cos_ptr + cos_row + second, mask=cos_mask, other=nan).to(tl.float32)
    sin_first = tl.load(sin_ptr + cos_row + first, mask=cos_mask, other=nan).to(tl.float32)
    sin_second = tl.load(sin_ptr + cos_row + second, mask=cos_mask, other=nan).to(tl.float32)
    _rotate_heads(
        q_ptr, q_out_ptr, batch * q_stride_b + t * q_stride_t,
        batch * q_out_stride_b + t * q_out_stride_t, q_stride_h, q_out_stride_h, n_q_heads,
        cos_first, cos_second, sin_first, sin_second, first, second, pair_mask, rotary_dim,
        head_dim, TRANSPOSE, HAS_PASS, BLOCK_HEADS, BLOCK_PASS,
    )
    _rotate_heads(
        k_ptr, k_out_ptr, batch * k_stride_b + t * k_stride_t,
        batch * k_out_stride_b + t * k_out_stride_t, k_stride_h, k_out_stride_h, n_k_heads,
        cos_first, cos_second, sin_first, sin_second, first, second, pair_mask, rotary_dim,
        head_dim, TRANSPOSE, HAS_PASS, BLOCK_HEADS, BLOCK_PASS,
    )


# ============================================================================ host launchers


@dataclass(frozen=True)
class _LaunchPlan:
    block_pairs: int
    block_heads: int
    block_pass: int
    num_warps: int


# Elements per [heads, pairs] tile: two such tiles (first and second halves) per step.
TILE_ELEMENTS = 2048


@functools.lru_cache(maxsize=256)  # host time counts: these kernels take ~0.1 ms
def _launch_plan(n_heads: int, head_dim: int, rotary_dim: int) -> _LaunchPlan:
    block_pairs = _utils.next_power_of_2(rotary_dim // 2)
    block_heads = min(_utils.next_power_of_2(n_heads), max(1, TILE_ELEMENTS // block_pairs))
    block_pass = min(_utils.next_power_of_2(max(head_dim - rotary_dim, 1)), 128)
    warps = max(1, min(8, block_heads * block_pairs // 256))
    return _LaunchPlan(block_pairs, block_heads, block_pass, _utils.next_power_of_2(warps))


def _unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _bth_strides(t: torch.Tensor, layout: str) -> tuple[int, int, int]:
    """(batch, seq, head) strides of a 4-D tensor in ``layout``."""
    if layout == "BTHD":
        return t.stride(0), t.stride(1), t.stride(2)
    return t.stride(0), t.stride(2), t.stride(1)


def _cos_strides(cos: torch.Tensor, has_position_ids: bool) -> tuple[int, int]:
    """(batch, position) strides of the cos/sin table; batch 0 where it broadcasts."""
    if has_position_ids or cos.dim() == 2:
        return 0, cos.stride(0)
    return (0 if cos.shape[0] == 1 else cos.stride(0)), cos.stride(1)


def _position_strides(position_ids: torch.Tensor | None) -> tuple[int, int]:
    if position_ids is None:
        return 0, 0
    if position_ids.dim() == 1:
        return 0, position_ids.stride(0)
    return (0 if position_ids.shape[0] == 1 else position_ids.stride(0)), position_ids.stride(1)


def _rotate(q, k, cos, sin, position_ids, layout, interleaved, transpose):
    """Rotated q and k (new tensors, contiguous in ``layout``)."""
    q, k = _unit_last_stride(q), _unit_last_stride(k)
    cos, sin = _unit_last_stride(cos), _unit_last_stride(sin)
    if cos.stride() != sin.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    q_out = _utils.empty(q.shape, q.dtype, q.device)
    k_out = _utils.empty(k.shape, k.dtype, k.device)
    seq_dim = 1 if layout == "BTHD" else 2
    batch, seq_len, head_dim = q.shape[0], q.shape[seq_dim], q.shape[3]
    n_q_heads, n_k_heads = q.shape[3 - seq_dim], k.shape[3 - seq_dim]
    rotary_dim = cos.shape[-1]
    if batch * seq_len == 0:
        return q_out, k_out
    plan = _launch_plan(max(n_q_heads, n_k_heads), head_dim, rotary_dim)
    _rope_kernel[(batch * seq_len,)](
        q, k, q_out, k_out, cos, sin, position_ids if position_ids is not None else cos,
        seq_len, n_q_heads, n_k_heads, head_dim, rotary_dim, cos.shape[-2],
        *_bth_strides(q, layout), *_bth_strides(k, layout), *_bth_strides(q_out, layout),
        *_bth_strides(k_out, layout), *_cos_strides(cos, position_ids is not None),
        *_position_strides(position_ids), HAS_POSITION_IDS=position_ids is not None,
        INTERLEAVED=interleaved, TRANSPOSE=transpose, HAS_PASS=rotary_dim < head_dim,
        BLOCK_PAIRS=plan.block_pairs, BLOCK_HEADS=plan.block_heads, BLOCK_PASS=plan.block_pass,
        num_warps=plan.num_warps,
    )
    return q_out, k_out


# ============================================================================ custom ops


@_utils.register_op(
    "rope_rotate(Tensor q, Tensor k, Tensor cos, Tensor sin, Tensor? position_ids, "
    "str layout, bool interleaved, bool transpose) -> (Tensor, Tensor)",
    fake=lambda q, k, *rest: (q.new_empty(q.shape), k.new_empty(k.shape)),
)
def _rotate_op(q, k, cos, sin, position_ids, layout, interleaved, transpose):
    """q and k rotated (transpose=False) or rotated back (transpose=True: the backward)."""
    return _rotate(q, k, cos, sin, position_ids, layout, interleaved, transpose)


# ============================================================================ autograd


class _RopeFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin, position_ids, layout, interleaved):
        rotate = _rotate if _utils.plain_eager(q, k, cos, sin, position_ids) else _rotate_op
        q_out, k_out = rotate(q, k, cos, sin, position_ids, layout, interleaved, False)
        ctx.save_for_backward(cos, sin, position_ids)
        ctx.options = (layout, interleaved)
        return q_out, k_out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_q, grad_k):
        cos, sin, position_ids = ctx.saved_tensors
        rotate = _rotate if _utils.plain_eager(grad_q, grad_k, cos) else _rotate_op
        grad_q, grad_k = rotate(grad_q, grad_k, cos, sin, position_ids, *ctx.options, True)
        return grad_q, grad_k, None, None, None, None, None


# ============================================================================ public function


def rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
    position_ids: torch.Tensor | None = None, layout: str = "BTHD", rotary_dim: int | None = None,
    interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary position embedding of q and k together (one kernel launch each way).

    Args:
        q: [B, T, Hq, D] ("BTHD") or [B, Hq, T, D] ("BHTD"), float32 / float16 / bfloat16; any
            strides (e.g. transformers' ``view(...).transpose(1, 2)``).
        k: like q with its own head count Hk (GQA/MQA) and dtype.
        cos, sin: [T, R], [1, T, R] or [B, T, R] (transformers' rotary embedding output), any
            floating dtype; with ``position_ids``, a [max_positions, R] table. R = rotary_dim:
            each frequency appears twice, at i and i + R/2 (half-split) or at 2p and 2p + 1
            (interleaved). They get no gradient (transformers makes them under no_grad).
        position_ids: optional [T], [1, T] or [B, T] integer rows of the cos/sin table. A
            position outside the table is never read; its outputs come out NaN on the kernels
            (the reference raises).
        layout: "BTHD" or "BHTD".
        rotary_dim: how many leading dims of each head rotate (partial rotary); must equal
            cos' last dim, which it defaults to. Dims past it pass through unchanged.
        interleaved: rotate pairs (2p, 2p + 1) (GPT-J) instead of (i, i + R/2) (GPT-NeoX,
            Llama, Qwen2).

    Returns:
        (q_rotated, k_rotated), each contiguous in ``layout`` with its input's dtype; computed in
        fp32 and rounded once. Autocast does not change this op. Gradients (the inverse
        rotation) come back in q's and k's dtypes.

    Raises:
        TypeError: a non-floating q, k, cos or sin; non-integer position_ids; rotary_dim not int.
        ValueError: q or k not 4-D; q and k differing in batch, sequence or head_dim; cos and
            sin shapes differing or not matching T (or B); rotary_dim odd, larger than D or not
            cos' last dim; an unknown layout; cos or sin requiring grad; different devices.
    """
    rotary_dim = check_rope_args(q, k, cos, sin, position_ids, layout, rotary_dim)
    if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
        raise ValueError(
            "cos and sin must not require grad: fusetune.rope gives them no gradient (detach "
            "them; transformers' rotary embedding computes them under no_grad)"
        )
    if _utils.backend(q) == "reference":
        return reference_rope(
            q, k, cos, sin, position_ids=position_ids, layout=layout, rotary_dim=rotary_dim,
            interleaved=interleaved,
        )
    return _RopeFunction.apply(q, k, cos, sin, position_ids, layout, bool(interleaved))
