"""Mixture-of-experts expert MLP with LoRA: grouped Triton GEMMs over expert-sorted tokens.

Semantics, layouts and the precision rule: :mod:`fusetune.reference.moe`. S = N * K routed
(token, expert) pairs ("slots"), sorted by expert once per forward (torch.sort on the device,
no host sync); every kernel walks a tile table of (expert, first row, end row) with at most
min(S, S / BM + E) tiles, so grids depend on shapes only.

  forward   xa_gu = x[tok] Agu[e]^T                       (grouped mm, LoRA only)
            gu = x[tok] Wgu[e]^T + bgu + s xa_gu Bgu^T;  h = act(gu)
                                                          (one kernel: gate and up accumulators,
                                                           the activation in its epilogue; gu
                                                           is saved, h is not)
            xa_d = h Ad[e]^T                              (LoRA only)
            y = (h Wd[e]^T + bd + s xa_d Bd^T) * w        (routing weight in the epilogue, rows
                                                           stored at their slot: un-permuted)
            out[n] = sum_k y[n, k]                         (fp32 sum over K, torch)
  backward  g_d = dout[tok] Bd[e]                         (LoRA only)
            g = dout[tok] Wd[e] + s g_d Ad;  the epilogue recomputes h from gu, writes
            dgu = w g * act'(gu) over gu (eager) and d(w) partial sums <g, h>
            g_gu = dgu Bgu[e]                             (LoRA only)
            dx[slot] = dgu Wgu[e] + s g_gu Agu            (stored at its slot; fp32 sum over K)
            LoRA grads per expert (one program per expert and output tile, deterministic):
            dBgu = s dgu^T xa_gu, dAgu = s g_gu^T x[tok], dBd = s (w dout[tok])^T xa_d,
            dAd = s (w g_d)^T h
            expert weights / biases: only when they require grad (full fine-tuning), by the
            same per-expert kernel (biases: against a ones column).
Nothing uses atomics: results are deterministic. Not fused: the sort, offsets and tile table
(a few small torch ops), x A^T and dout B_d (own thin grouped GEMMs: fusing them into the big
kernels' loops would recompute them once per column tile), the K-sums of out and dx (torch),
the bias part of d(w) (one [N, E] matmul).

TMA (FUSETUNE_MOE_TMA, see tma_mode; by default on Hopper and later): the expert weights enter
the gate/up forward, the GLU backward and the grouped mm through TMA (host tensor descriptors;
Qwen's concatenated gate/up as one 4-d box of both halves), and so do the activation rows in
sorted order (down forward, dx, the LoRA GEMMs of h / dgu, and x and dout copied into sorted
order: Hopper's TMA cannot gather). Weights whose strides TMA cannot take keep pointer loads.

Layout: kernels, launchers, registered ops, autograd Function, public function.
"""

from __future__ import annotations

import functools
import os
import warnings

import torch

from fusetune import _utils
from fusetune._triton import INTERPRET, dot, tl, triton
from fusetune.reference import moe as reference
from fusetune.reference.moe import Layout, MoeLora

try:  # (Triton >= 3.3; absent only where Triton is, and then no kernel launches)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover
    TensorDescriptor = None

ACTIVATION_CODES = {"swiglu": 0, "gpt_oss": 1}

# ============================================================================ kernels


@triton.jit
def _mm(a, b, acc, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """acc + a @ b in fp32: IEEE fp32 products for fp32 compute, tensor cores for 16-bit."""
    if IEEE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return dot(a, b, acc, UPCAST)


@triton.jit
def _tile(tiles_ptr, n_cols, BM: tl.constexpr, BN: tl.constexpr, GROUP: tl.constexpr):
    """(expert, rows, row mask, non-empty, column tile) of this program. One flat grid in
    groups of GROUP row tiles: within a group the row tiles vary fastest, so the programs
    running at once share a few weight column slabs and gathered row tiles in L2 (at gpt-oss's
    widths one expert's gate_up is 33 MB: streaming all its columns per row tile misses L2)."""
    pid = tl.program_id(0)
    col_tiles = tl.cdiv(n_cols, BN)
    row_tiles = tl.num_programs(0) // col_tiles
    per_group = GROUP * col_tiles
    first = (pid // per_group) * GROUP
    size = tl.minimum(row_tiles - first, GROUP)
    pid_m = first + (pid % per_group) % size
    pid_n = (pid % per_group) // size
    expert = tl.load(tiles_ptr + 3 * pid_m)
    row0 = tl.load(tiles_ptr + 3 * pid_m + 1)
    row_end = tl.load(tiles_ptr + 3 * pid_m + 2)
    rows = row0 + tl.arange(0, BM)
    return expert.to(tl.int64), rows, rows < row_end, row0 < row_end, pid_n


@triton.jit
def _rows_tile(ptr, rows, row_mask, stride, ks, k_mask):
    offsets = rows.to(tl.int64)[:, None] * stride + ks[None, :]
    return tl.load(ptr + offsets, mask=row_mask[:, None] & k_mask[None, :], other=0.0)


@triton.jit
def _w_tile(base, ks, k_mask, cols, col_mask, stride_k, stride_n):
    """[BK, BN] tile of one expert's [n, k] matrix stored with any strides."""
    offsets = ks.to(tl.int64)[:, None] * stride_k + cols.to(tl.int64)[None, :] * stride_n
    return tl.load(base + offsets, mask=k_mask[:, None] & col_mask[None, :], other=0.0)


@triton.jit
def _gathered_mm(a_ptr, src, row_mask, a_stride, w_base, cols, col_mask, w_sk, w_sn, k_in, valid,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr,
                 UPCAST: tl.constexpr):
    """fp32 [BM, BN] a[src] @ w[cols]^T over k_in (w one expert's [n, k], any strides), BK at a
    step: the main loop of every grouped GEMM here. An empty tile (not ``valid``) skips it."""
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    k_stop = tl.where(valid, k_in, 0)
    for k0 in range(0, k_stop, BK):
        ks = k0 + tl.arange(0, BK)
        k_mask = ks < k_in
        a = _rows_tile(a_ptr, src, row_mask, a_stride, ks, k_mask)
        w = _w_tile(w_base, ks, k_mask, cols, col_mask, w_sk, w_sn)
        acc = _mm(a, w, acc, IEEE, UPCAST)
    return acc


@triton.jit
def _w_desc_tile(desc, expert, n0, k0, BN: tl.constexpr, BK: tl.constexpr, K_MAJOR: tl.constexpr,
                 HALVES: tl.constexpr):
    """[BK, BN] tile (columns n0.., rows k0..) of one expert's [n, k] matrix through its TMA
    descriptor (zeros past the bounds: no masks). K_MAJOR: stored [E, n, k], else [E, k, n].
    HALVES: the descriptor splits n into (2, n / 2) and the tile is BN / 2 columns from n0 of
    each half (gate, then up): one 4-d TMA box, so both halves feed one n = BN product."""
    if K_MAJOR:
        if HALVES:
            t = desc.load([expert, 0, n0, k0])
        else:
            t = desc.load([expert, n0, k0])
        return tl.trans(tl.reshape(t, (BN, BK)))
    else:
        if HALVES:
            t = desc.load([expert, k0, 0, n0])
        else:
            t = desc.load([expert, k0, n0])
        return tl.reshape(t, (BK, BN))


@triton.jit
def _gathered_mm_tma(a_ptr, src, row_mask, a_stride, w_desc, expert, n0, k_in, valid,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr,
                     UPCAST: tl.constexpr, K_MAJOR: tl.constexpr, HALVES: tl.constexpr,
                     a_desc=None, A_TMA: tl.constexpr = False):
    """_gathered_mm with the weight tile a TMA load (FUSETUNE_MOE_TMA=1). Gathered rows stay
    pointer loads (Hopper's TMA has no row gather); A_TMA: the rows are a_desc's rows src[0]..
    (already in sorted order), a TMA load too; rows of the next expert past the tile's end come
    along and are never stored."""
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    k_stop = tl.where(valid, k_in, 0)
    e = expert.to(tl.int32)
    if A_TMA:
        row0 = tl.min(src, axis=0).to(tl.int32)  # (src = the tile's rows, row0 + 0..BM-1)
    for k0 in range(0, k_stop, BK):
        if A_TMA:
            a = a_desc.load([row0, k0])
        else:
            ks = k0 + tl.arange(0, BK)
            a = _rows_tile(a_ptr, src, row_mask, a_stride, ks, ks < k_in)
        w = _w_desc_tile(w_desc, e, n0, k0, BN, BK, K_MAJOR, HALVES)
        acc = _mm(a, w, acc, IEEE, UPCAST)
    return acc


@triton.jit
def _lora_add(acc, xa_ptr, xa_stride, rows, row_mask, lb_base, lb_sn, lb_sr, cols, col_mask,
              rank, scaling, R: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """acc + scaling * xa[rows] @ lb[cols]^T (xa [S, rank], lb one expert's [n, rank])."""
    rs = tl.arange(0, R)
    r_mask = rs < rank
    xa = _rows_tile(xa_ptr, rows, row_mask, xa_stride, rs, r_mask)
    lb = _w_tile(lb_base, rs, r_mask, cols, col_mask, lb_sr, lb_sn)
    return acc + scaling * _mm(xa, lb, None, IEEE, UPCAST)


@triton.jit
def _glu(gate, up, ACT: tl.constexpr, alpha, limit):
    """(h, dh/dgate, dh/dup) in fp32. ACT 0: silu(gate) * up; 1: gpt-oss's clamped SwiGLU."""
    if ACT == 0:
        sig = 1.0 / (1.0 + tl.exp(-gate))
        value = gate * sig
        return value * up, up * sig * (1.0 + gate * (1.0 - sig)), value
    else:
        g = tl.minimum(gate, limit)
        u = tl.minimum(tl.maximum(up, -limit), limit)
        sig = 1.0 / (1.0 + tl.exp(-alpha * g))
        value = g * sig
        d_gate = tl.where(gate <= limit, (u + 1.0) * sig * (1.0 + alpha * g * (1.0 - sig)), 0.0)
        d_up = tl.where((up >= -limit) & (up <= limit), value, 0.0)
        return (u + 1.0) * value, d_gate, d_up


@triton.jit
def _split_pairs(t, BM: tl.constexpr, BN: tl.constexpr):
    """(even columns, odd columns) of a [BM, 2 BN] tile: interleaved gate and up."""
    return tl.split(tl.reshape(t, (BM, BN, 2)))


@triton.jit
def _split_halves(t, BM: tl.constexpr, BN: tl.constexpr):
    """(first BN columns, last BN columns) of a [BM, 2 BN] tile."""
    return tl.split(tl.permute(tl.reshape(t, (BM, 2, BN)), (0, 2, 1)))


@triton.jit
def _join_pairs(even, odd, BM: tl.constexpr, BN: tl.constexpr):
    """[BM, 2 BN] tile with even columns from ``even`` and odd ones from ``odd``."""
    return tl.reshape(tl.join(even, odd), (BM, 2 * BN))


@triton.jit
def _grouped_mm_kernel(
    a_ptr, a_rows_ptr, a_desc, w_ptr, w_desc, xa_ptr, lb_ptr, bias_ptr, scale_ptr, out_ptr,
    out_rows_ptr, tiles_ptr, scaling, n_out, k_in, rank,
    a_stride, w_se, w_sn, w_sk, xa_stride, lb_se, lb_sn, lb_sr, bias_stride, out_stride,
    GATHER: tl.constexpr, SCATTER: tl.constexpr, LORA: tl.constexpr, BIAS: tl.constexpr,
    SCALE: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr, R: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr,
    W_TMA: tl.constexpr, K_MAJOR: tl.constexpr, A_TMA: tl.constexpr,
):
    """out[dst(r)] = (a[src(r)] @ w[e]^T + s xa[r] lb[e]^T + bias[e]) * scale[r] for the rows r
    of one tile of expert e; w[e] is [n_out, k_in] with any strides (W_TMA: read through
    w_desc, see _w_desc_tile; A_TMA, not GATHER: a through a_desc too)."""
    expert, rows, row_mask, valid, pid_n = _tile(tiles_ptr, n_out, BM, BN, GROUP)
    cols = pid_n * BN + tl.arange(0, BN)
    col_mask = cols < n_out
    src = rows
    if GATHER:
        src = tl.load(a_rows_ptr + rows, mask=row_mask, other=0)
    if W_TMA:
        acc = _gathered_mm_tma(a_ptr, src, row_mask, a_stride, w_desc, expert, pid_n * BN,
                               k_in, valid, BM, BN, BK, IEEE, UPCAST, K_MAJOR, False, a_desc,
                               A_TMA)
    else:
        acc = _gathered_mm(a_ptr, src, row_mask, a_stride, w_ptr + expert * w_se, cols,
                           col_mask, w_sk, w_sn, k_in, valid, BM, BN, BK, IEEE, UPCAST)
    if LORA:
        acc = _lora_add(acc, xa_ptr, xa_stride, rows, row_mask, lb_ptr + expert * lb_se, lb_sn,
                        lb_sr, cols, col_mask, rank, scaling, R, IEEE, UPCAST)
    if BIAS:
        bias = tl.load(bias_ptr + expert * bias_stride + cols, mask=col_mask, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    if SCALE:
        acc *= tl.load(scale_ptr + rows, mask=row_mask, other=0.0)[:, None]
    dst = rows
    if SCATTER:
        dst = tl.load(out_rows_ptr + rows, mask=row_mask, other=0)
    offsets = dst.to(tl.int64)[:, None] * out_stride + cols[None, :]
    tl.store(out_ptr + offsets, acc.to(out_ptr.dtype.element_ty),
             mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _glu_forward_kernel(
    x_ptr, tokens_ptr, x_desc, w_ptr, w_desc, xa_ptr, lb_ptr, bias_ptr, gu_ptr, h_ptr,
    tiles_ptr,
    scaling, alpha, limit, inter, hidden, rank, col_step, up_offset,
    x_stride, w_se, w_sn, w_sk, xa_stride, lb_se, lb_sn, lb_sr, bias_stride, gu_stride,
    h_stride,
    LORA: tl.constexpr, BIAS: tl.constexpr, ACT: tl.constexpr, INTERLEAVED: tl.constexpr,
    IEEE: tl.constexpr, UPCAST: tl.constexpr, R: tl.constexpr, BM: tl.constexpr,
    BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr, W_TMA: tl.constexpr,
    K_MAJOR: tl.constexpr, HALVES: tl.constexpr, GATHER: tl.constexpr, A_TMA: tl.constexpr,
):
    """gu = x[tok] Wgu[e]^T (+ LoRA, + bias) for BN gate columns and their up columns (gate j
    at j * col_step, up at that + up_offset); stores gu (rounded) and h = act(gate, up).
    One accumulator over the BN (gate, up) pairs, split into gate and up in registers.
    INTERLEAVED: the pairs are 2 BN adjacent gu columns (contiguous weight loads: a stride-2
    gather defeats vectorized / async loads).
    W_TMA: Wgu through w_desc (_w_desc_tile); with HALVES (W_TMA, not INTERLEAVED) the
    accumulator holds the BN gate columns, then their BN up columns (a TMA box is rectangular:
    it cannot interleave rows from the two halves). Not GATHER: x is already in sorted order
    (FUSETUNE_MOE_TMA=2), A_TMA: read through x_desc."""
    expert, rows, row_mask, valid, pid_n = _tile(tiles_ptr, inter, BM, BN, GROUP)
    cols = pid_n * BN + tl.arange(0, BN)
    col_mask = cols < inter
    mask = row_mask[:, None] & col_mask[None, :]
    gu_rows = rows.to(tl.int64)[:, None] * gu_stride
    src = rows
    if GATHER:
        src = tl.load(tokens_ptr + rows, mask=row_mask, other=0)
    # One [BM, 2 BN] accumulator over (gate, up) column pairs: its column c is gate column
    # j = pid_n BN + c // 2 for even c and that column's up for odd c, W's row
    # j col_step + (c % 2) up_offset (interleaved: the 2 BN adjacent gu columns). One n = 2 BN
    # tensor-core product a k-step, where two accumulators of BN took two n = BN ones.
    c = tl.arange(0, 2 * BN)
    pair_j = pid_n * BN + c // 2
    if INTERLEAVED:  # (affine, mask too: Triton sees contiguous columns and vectorizes)
        pair_cols = pid_n * 2 * BN + c
        pair_mask = pair_cols < 2 * inter
    elif HALVES:
        pair_j = pid_n * BN + c % BN
        pair_cols = pair_j * col_step + (c // BN) * up_offset
        pair_mask = pair_j < inter
    else:
        pair_cols = pair_j * col_step + (c % 2) * up_offset
        pair_mask = pair_j < inter
    if W_TMA:
        n0 = pid_n * 2 * BN
        if HALVES:
            n0 = pid_n * BN
        acc = _gathered_mm_tma(x_ptr, src, row_mask, x_stride, w_desc, expert, n0, hidden,
                               valid, BM, 2 * BN, BK, IEEE, UPCAST, K_MAJOR, HALVES, x_desc,
                               A_TMA)
    else:
        acc = _gathered_mm(x_ptr, src, row_mask, x_stride, w_ptr + expert * w_se, pair_cols,
                           pair_mask, w_sk, w_sn, hidden, valid, BM, 2 * BN, BK, IEEE, UPCAST)
    if LORA:
        acc = _lora_add(acc, xa_ptr, xa_stride, rows, row_mask, lb_ptr + expert * lb_se,
                        lb_sn, lb_sr, pair_cols, pair_mask, rank, scaling, R, IEEE, UPCAST)
    if BIAS:
        bias = tl.load(bias_ptr + expert * bias_stride + pair_cols, mask=pair_mask, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    pair = acc.to(gu_ptr.dtype.element_ty)
    if INTERLEAVED:  # (one contiguous store)
        tl.store(gu_ptr + gu_rows + pair_cols[None, :], pair,
                 mask=row_mask[:, None] & pair_mask[None, :])
    if HALVES:
        gate, up = _split_halves(pair.to(tl.float32), BM, BN)
    else:
        gate, up = _split_pairs(pair.to(tl.float32), BM, BN)
    if not INTERLEAVED:  # (gate and up each a contiguous store)
        gate_cols = cols * col_step
        tl.store(gu_ptr + gu_rows + gate_cols[None, :], gate.to(gu_ptr.dtype.element_ty),
                 mask=mask)
        tl.store(gu_ptr + gu_rows + (gate_cols + up_offset)[None, :],
                 up.to(gu_ptr.dtype.element_ty), mask=mask)
    h, _, _ = _glu(gate, up, ACT, alpha, limit)
    offsets = rows.to(tl.int64)[:, None] * h_stride + cols[None, :]
    tl.store(h_ptr + offsets, h.to(h_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _glu_backward_kernel(
    dout_ptr, tokens_ptr, dout_desc, w_ptr, w_desc, gd_ptr, la_ptr, gu_ptr, scale_ptr, dgu_ptr,
    h_ptr, part_ptr,
    tiles_ptr, scaling, alpha, limit, inter, hidden, rank, col_step, up_offset, n_rows,
    dout_stride, w_se, w_sn, w_sk, gd_stride, la_se, la_sn, la_sr, gu_stride, dgu_stride,
    h_stride,
    LORA: tl.constexpr, STORE_H: tl.constexpr, ACT: tl.constexpr, INTERLEAVED: tl.constexpr,
    IEEE: tl.constexpr, UPCAST: tl.constexpr, R: tl.constexpr, BM: tl.constexpr,
    BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr, W_TMA: tl.constexpr,
    K_MAJOR: tl.constexpr, GATHER: tl.constexpr, A_TMA: tl.constexpr,
):
    """g = dout[tok] Wd[e] (+ s g_d Ad[e]) for BN intermediate columns; recomputes h from the
    saved gu and stores dgu = w g act'(gu) (may overwrite gu: each element is read first),
    optionally h, and the fp32 partial row sums <g, h> of d(w) at [column tile, row].
    W_TMA: Wd through w_desc (_w_desc_tile); not GATHER: dout already in sorted order, A_TMA:
    read through dout_desc."""
    expert, rows, row_mask, valid, pid_n = _tile(tiles_ptr, inter, BM, BN, GROUP)
    cols = pid_n * BN + tl.arange(0, BN)
    col_mask = cols < inter
    src = rows
    if GATHER:
        src = tl.load(tokens_ptr + rows, mask=row_mask, other=0)
    if W_TMA:
        g = _gathered_mm_tma(dout_ptr, src, row_mask, dout_stride, w_desc, expert, pid_n * BN,
                             hidden, valid, BM, BN, BK, IEEE, UPCAST, K_MAJOR, False, dout_desc,
                             A_TMA)
    else:
        g = _gathered_mm(dout_ptr, src, row_mask, dout_stride, w_ptr + expert * w_se, cols,
                         col_mask, w_sk, w_sn, hidden, valid, BM, BN, BK, IEEE, UPCAST)
    if LORA:
        g = _lora_add(g, gd_ptr, gd_stride, rows, row_mask, la_ptr + expert * la_se, la_sn,
                      la_sr, cols, col_mask, rank, scaling, R, IEEE, UPCAST)
    mask = row_mask[:, None] & col_mask[None, :]
    gu_rows = rows.to(tl.int64)[:, None] * gu_stride
    dgu_rows = rows.to(tl.int64)[:, None] * dgu_stride
    # INTERLEAVED: gate and up of these columns are 2 BN adjacent gu columns (one contiguous
    # load and store, split / joined in registers).
    pair_cols = pid_n * 2 * BN + tl.arange(0, 2 * BN)
    pair_mask = row_mask[:, None] & (pair_cols < 2 * inter)[None, :]
    gate_cols = cols * col_step
    up_cols = gate_cols + up_offset
    if INTERLEAVED:
        pair = tl.load(gu_ptr + gu_rows + pair_cols[None, :], mask=pair_mask, other=0.0)
        gate, up = _split_pairs(pair.to(tl.float32), BM, BN)
    else:
        gate = tl.load(gu_ptr + gu_rows + gate_cols[None, :], mask=mask, other=0.0)
        up = tl.load(gu_ptr + gu_rows + up_cols[None, :], mask=mask, other=0.0)
        gate = gate.to(tl.float32)
        up = up.to(tl.float32)
    h, d_gate, d_up = _glu(gate, up, ACT, alpha, limit)
    h = h.to(h_ptr.dtype.element_ty).to(tl.float32)  # the forward's rounded h
    weight = tl.load(scale_ptr + rows, mask=row_mask, other=0.0)
    dh = (g * weight[:, None]).to(dgu_ptr.dtype.element_ty).to(tl.float32)  # as stored by torch
    if INTERLEAVED:
        pair = _join_pairs(dh * d_gate, dh * d_up, BM, BN)
        tl.store(dgu_ptr + dgu_rows + pair_cols[None, :], pair.to(dgu_ptr.dtype.element_ty),
                 mask=pair_mask)
    else:
        tl.store(dgu_ptr + dgu_rows + gate_cols[None, :],
                 (dh * d_gate).to(dgu_ptr.dtype.element_ty), mask=mask)
        tl.store(dgu_ptr + dgu_rows + up_cols[None, :],
                 (dh * d_up).to(dgu_ptr.dtype.element_ty), mask=mask)
    if STORE_H:
        offsets = rows.to(tl.int64)[:, None] * h_stride + cols[None, :]
        tl.store(h_ptr + offsets, h.to(h_ptr.dtype.element_ty), mask=mask)
    partial = tl.sum(tl.where(mask, g * h, 0.0), axis=1)
    tl.store(part_ptr + pid_n.to(tl.int64) * n_rows + rows, partial, mask=row_mask)


@triton.jit
def _expert_outer_kernel(
    x_ptr, x_rows_ptr, scale_ptr, y_ptr, y_rows_ptr, out_ptr, offsets_ptr, scaling,
    dim_i, dim_j, x_stride, y_stride, o_se, o_si, o_sj,
    X_GATHER: tl.constexpr, Y_GATHER: tl.constexpr, X_SCALE: tl.constexpr,
    IEEE: tl.constexpr, UPCAST: tl.constexpr, BI: tl.constexpr, BJ: tl.constexpr,
    BK: tl.constexpr,
):
    """out[e, i, j] = scaling * sum over expert e's rows r of (scale[r] x[xr(r), i]) y[yr(r), j]:
    one program per (expert, [BI, BJ] tile), rows in BK steps (deterministic, no atomics)."""
    expert = tl.program_id(0)
    pid = tl.program_id(1)
    tiles_j = tl.cdiv(dim_j, BJ)
    i_idx = (pid // tiles_j) * BI + tl.arange(0, BI)
    j_idx = (pid % tiles_j) * BJ + tl.arange(0, BJ)
    i_mask, j_mask = i_idx < dim_i, j_idx < dim_j
    start = tl.load(offsets_ptr + expert)
    end = tl.load(offsets_ptr + expert + 1)
    acc = tl.zeros((BI, BJ), dtype=tl.float32)
    for r0 in range(start, end, BK):
        rs = r0 + tl.arange(0, BK)
        r_mask = rs < end
        x_rows = rs
        if X_GATHER:
            x_rows = tl.load(x_rows_ptr + rs, mask=r_mask, other=0)
        y_rows = rs
        if Y_GATHER:
            y_rows = tl.load(y_rows_ptr + rs, mask=r_mask, other=0)
        xt = tl.load(x_ptr + x_rows.to(tl.int64)[None, :] * x_stride + i_idx[:, None],
                     mask=i_mask[:, None] & r_mask[None, :], other=0.0)
        if X_SCALE:
            scale = tl.load(scale_ptr + rs, mask=r_mask, other=0.0)
            xt = (xt.to(tl.float32) * scale[None, :]).to(xt.dtype)
        yt = tl.load(y_ptr + y_rows.to(tl.int64)[:, None] * y_stride + j_idx[None, :],
                     mask=r_mask[:, None] & j_mask[None, :], other=0.0)
        acc = _mm(xt, yt, acc, IEEE, UPCAST)
    offsets = expert.to(tl.int64) * o_se + i_idx.to(tl.int64)[:, None] * o_si
    offsets += j_idx[None, :] * o_sj
    tl.store(out_ptr + offsets, (scaling * acc).to(out_ptr.dtype.element_ty),
             mask=i_mask[:, None] & j_mask[None, :])


# ============================================================================ host launchers


# (BM, BN, BK, warps, stages, group) of the grouped GEMMs (group: row tiles per L2 group, see
# _tile) for 16-bit inputs, by kernel: "glu" (the
# gate/up forward and the down-gradient backward, which take BN / 2 per accumulator: BN is
# the gu columns a program covers) and "mm" (down forward, dx, the thin LoRA GEMMs). Untuned
# guesses (vLLM-like fused-MoE tiles), compiled for sm_90 without spills (ptxas: 174-232
# registers at 8 warps); a module dict so a GPU sweep (tools/tune_moe.py) can set them.
# tools/tune_moe.py on the H100 (docs/bench/moe-tune-h100-2026-11-24.txt), fwd+bwd, LoRA r16, 8192
# tokens: (128, 128, 64, 8 warps, 4 stages, group 8) was best for both shapes: Qwen3-30B-A3B
# 6.41 -> 5.97 ms, gpt-oss-20b 13.94 -> 11.38 ms against the previous (64, 128, 64, 8, 3, 8).
TILES_16BIT = {"glu": (128, 128, 64, 8, 4, 8), "mm": (128, 128, 64, 8, 4, 8)}
TILES_FP32 = (32, 64, 32, 4, 2, 8)
TILES_INTERPRETER = (16, 64, 32, 4, 1, 2)  # few, small programs: the interpreter's cost


def _blocks(dtype: torch.dtype, kernel: str = "mm") -> tuple[int, ...]:
    if INTERPRET:
        return TILES_INTERPRETER
    return TILES_FP32 if dtype == torch.float32 else TILES_16BIT[kernel]


TMA_VARIABLE = "FUSETUNE_MOE_TMA"


def tma_mode(device: torch.device | None = None) -> int:
    """FUSETUNE_MOE_TMA=1: the expert weights enter the grouped GEMMs (gate/up forward, GLU
    backward, the plain grouped mm) through TMA (host tensor descriptors) instead of pointer
    loads, and so do activation rows already in sorted order; the gathered token rows stay
    pointer loads. 2: also copies x (forward) and dout (backward) into sorted order first
    (S x H elements each, freed before the next [S, H] buffer: no higher peak), so that the
    gate/up forward and the GLU backward read both operands through TMA. 0: pointer loads.
    Unset: 2 on a GPU with TMA (compute capability 9.0 or later), else 0 (measured on an H200,
    2026-11-28 twenty-second: NOTES). Read per call (each forward and backward)."""
    value = os.environ.get(TMA_VARIABLE, "").strip()
    if value == "":
        return 2 if device is not None and _has_tma(device) else 0
    if value not in ("0", "1", "2"):
        raise ValueError(f"{TMA_VARIABLE} must be '0', '1' or '2', got {value!r}")
    return int(value)


@functools.cache
def _has_tma(device: torch.device) -> bool:
    return (device.type == "cuda" and not INTERPRET and TensorDescriptor is not None
            and torch.cuda.get_device_capability(device)[0] >= 9)  # fmt: skip


def _weight_desc(w: torch.Tensor, bn: int, bk: int, halves: bool = False):
    """(TMA descriptor of w [E, n, k] in its stored order, k_major) for [BN, BK] tiles
    (_w_desc_tile), or (None, False) where TMA cannot read w: it needs a unit stride and a
    16-byte aligned base and other strides. Host-side descriptors (triton.tools'
    TensorDescriptor): the launch encodes the tensor map once, so no program builds one on the
    device and no triton.set_allocator scratch is needed (tl.make_tensor_descriptor's cost)."""
    e, n, k = w.shape
    se, sn, sk = w.stride()
    half = n // 2
    if sk == 1:
        shape, strides, block = [e, n, k], [se, sn, 1], [1, bn, bk]
        if halves:
            shape, strides, block = [e, 2, half, k], [se, half * sn, sn, 1], [1, 2, bn // 2, bk]
    elif sn == 1:
        shape, strides, block = [e, k, n], [se, sk, 1], [1, bk, bn]
        if halves:
            shape, strides, block = [e, k, 2, half], [se, sk, half, 1], [1, bk, 2, bn // 2]
    else:
        return _tma_skipped("an expert weight: neither of its last two strides is 1"), False
    size = w.element_size()
    if w.data_ptr() % 16 or any(s * size % 16 for s in strides[:-1]) or 0 in shape:
        return _tma_skipped("an expert weight's base or a stride is not 16-byte aligned"), False
    return TensorDescriptor(w, shape, strides, block), sk == 1


_TMA_WARNED: set[str] = set()


def _tma_skipped(why: str) -> None:
    """No descriptor (None), after one warning a reason where FUSETUNE_MOE_TMA asked for TMA
    and this operand keeps pointer loads (no silent fallback; by default the choice of loads is
    the kernel's own, as its tiles are)."""
    if os.environ.get(TMA_VARIABLE, "").strip() and why not in _TMA_WARNED:  # (as tma_mode)
        _TMA_WARNED.add(why)
        warnings.warn(f"fusetune.moe_mlp: {TMA_VARIABLE} is set, but an operand keeps pointer "
                      f"loads: {why}", stacklevel=2)  # fmt: skip
    return None


def _rows_desc(a: torch.Tensor, k: int, bm: int, bk: int):
    """TMA descriptor of rows already in sorted order (a [S, >= k], unit columns) for [BM, BK]
    tiles, or None where the rows are not 16-byte aligned."""
    if a.data_ptr() % 16 or (a.stride(0) * a.element_size()) % 16:
        return _tma_skipped("sorted activation rows are not 16-byte aligned")
    return TensorDescriptor(a, [a.shape[0], k], [a.stride(0), 1], [bm, bk])


def _padded_rank(rank: int) -> int:
    return max(16, _utils.next_power_of_2(rank))


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


class _Route:
    """Slots sorted by expert: tokens[r] (the source token of sorted row r), slots[r] (its flat
    n * K + k index), offsets [E + 1] (expert e's rows are offsets[e]:offsets[e + 1]) and the
    per-BM tile tables. All device tensors; nothing syncs."""

    def __init__(self, topk_ids: torch.Tensor, experts: int, tokens=None, slots=None,
                 offsets=None):
        self.experts = experts
        self.tma = tma_mode(topk_ids.device)  # read once per forward / backward call
        if tokens is None:
            ids = topk_ids.reshape(-1).long()
            sorted_ids, order = torch.sort(ids, stable=True)
            # Expert e's rows start at the first sorted id >= e: no atomics (deterministic).
            bounds = torch.arange(experts + 1, device=ids.device)
            offsets = torch.searchsorted(sorted_ids, bounds).to(torch.int32)
            slots = order.to(torch.int32)
            tokens = (order // topk_ids.shape[1]).to(torch.int32)
        self.tokens, self.slots, self.offsets = tokens, slots, offsets
        self.n_rows = slots.shape[0]
        self._tables: dict[int, torch.Tensor] = {}

    def sorted_rows(self, t: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """(t, gather=True), or with FUSETUNE_MOE_TMA=2 (t[tokens], False): a copy in sorted
        order whose tiles are TMA boxes."""
        if self.tma == 2:
            return t[self.tokens.long()], False
        return t, True

    def tiles(self, bm: int) -> torch.Tensor:
        """[T, 3] int32 (expert, first row, end row); rows past the last tile are empty."""
        if bm not in self._tables:
            offsets = self.offsets.long()
            counts = offsets[1:] - offsets[:-1]
            per_expert = (counts + bm - 1) // bm
            tile_end = per_expert.cumsum(0)
            n_tiles = min(self.n_rows, _utils.cdiv(self.n_rows, bm) + self.experts)
            t = torch.arange(n_tiles, device=offsets.device)
            expert = torch.searchsorted(tile_end, t, right=True)
            valid = expert < self.experts
            e = expert.clamp(max=self.experts - 1)
            row0 = offsets[e] + (t - (tile_end[e] - per_expert[e])) * bm
            row0 = torch.where(valid, row0, 0)
            end = torch.where(valid, torch.minimum(row0 + bm, offsets[e + 1]), 0)
            self._tables[bm] = torch.stack([e, row0, end], 1).to(torch.int32).contiguous()
        return self._tables[bm]


def _grouped_mm(a, w, route, out, *, gather=False, scatter=False, xa=None, lb=None,
                scaling=0.0, bias=None, scale=None):
    """out[dst] = (a[src] w[e]^T + scaling xa lb[e]^T + bias[e]) * scale over sorted rows.
    w [E, n, k] and lb [E, n, r] are views with any strides; a, xa, out have unit columns."""
    n_out, k_in = w.shape[1], w.shape[2]
    if route.n_rows == 0 or n_out == 0:
        return out
    bm, bn, bk, warps, stages, group = _blocks(a.dtype)
    if n_out <= 32:
        bn = max(16, _utils.next_power_of_2(n_out))
    tiles = route.tiles(bm)
    lora = xa is not None and xa.shape[1] > 0
    dummy = route.tokens
    grid = (tiles.shape[0] * _utils.cdiv(n_out, bn),)
    desc, k_major = _weight_desc(w, bn, bk) if route.tma else (None, False)
    a_desc = _rows_desc(a, k_in, bm, bk) if desc is not None and not gather else None
    _grouped_mm_kernel[grid](
        a, route.tokens, a_desc, w, desc, xa if lora else a, lb if lora else w,
        bias if bias is not None else a, scale if scale is not None else a, out, route.slots,
        tiles, scaling, n_out, k_in, xa.shape[1] if lora else 0,
        a.stride(0), w.stride(0), w.stride(1), w.stride(2),
        xa.stride(0) if lora else 0, *(lb.stride() if lora else (0, 0, 0)),
        bias.stride(0) if bias is not None else 0, out.stride(0),
        GATHER=gather, SCATTER=scatter, LORA=lora, BIAS=bias is not None,
        SCALE=scale is not None, IEEE=a.dtype == torch.float32, UPCAST=INTERPRET,
        R=_padded_rank(xa.shape[1] if lora else 1), BM=bm, BN=bn, BK=bk,
        GROUP=group, W_TMA=desc is not None, K_MAJOR=k_major, A_TMA=a_desc is not None,
        num_warps=warps, num_stages=stages,
    )
    del dummy
    return out


def _glu_columns(layout: Layout) -> tuple[int, int]:
    """(col_step, up_offset): gate column j of gu at j * col_step, its up column + up_offset."""
    return (2, 1) if layout.interleaved else (1, layout.intermediate)


def _glu_forward(x, w_gu, route, layout, xa, lb, scaling, bias, act, alpha, limit, gather=True):
    """(gu [S, 2I], h [S, I]) in x's dtype (the compute dtype); not gather: x is [S, H] in
    sorted order (route.sorted_rows)."""
    n_rows, inter = route.n_rows, layout.intermediate
    gu = _utils.empty((n_rows, 2 * inter), x.dtype, x.device)
    h = _utils.empty((n_rows, inter), x.dtype, x.device)
    if n_rows == 0 or inter == 0:
        return gu, h
    bm, bn, bk, warps, stages, group = _blocks(x.dtype, "glu")
    bn //= 2  # two accumulators (gate and up)
    lora = xa is not None and xa.shape[1] > 0
    tiles = route.tiles(bm)
    grid = (tiles.shape[0] * _utils.cdiv(inter, bn),)
    halves = not layout.interleaved
    desc, k_major = _weight_desc(w_gu, 2 * bn, bk, halves) if route.tma else (None, False)
    x_desc = _rows_desc(x, layout.hidden, bm, bk) if desc is not None and not gather else None
    _glu_forward_kernel[grid](
        x, route.tokens, x_desc, w_gu, desc, xa if lora else x, lb if lora else w_gu,
        bias if bias is not None else x, gu, h, tiles, scaling, alpha, limit, inter,
        layout.hidden, xa.shape[1] if lora else 0, *_glu_columns(layout),
        x.stride(0), *w_gu.stride(), xa.stride(0) if lora else 0,
        *(lb.stride() if lora else (0, 0, 0)), bias.stride(0) if bias is not None else 0,
        gu.stride(0), h.stride(0),
        LORA=lora, BIAS=bias is not None, ACT=act, INTERLEAVED=layout.interleaved,
        IEEE=x.dtype == torch.float32,
        UPCAST=INTERPRET, R=_padded_rank(xa.shape[1] if lora else 1), BM=bm, BN=bn, BK=bk,
        GROUP=group, W_TMA=desc is not None, K_MAJOR=k_major, HALVES=halves and desc is not None,
        GATHER=gather, A_TMA=x_desc is not None, num_warps=warps, num_stages=stages,
    )
    return gu, h


def _glu_backward(dout, w_d_t, route, layout, gd, la_t, scaling, gu, weights, dgu, store_h,
                  act, alpha, limit, gather=True):
    """Fill dgu [S, 2I] (may be gu itself); return (h [S, I] or None, d(w) <g, h> [S] fp32).
    Not gather: dout is [S, H] in sorted order (route.sorted_rows)."""
    n_rows, inter = route.n_rows, layout.intermediate
    bm, bn, bk, warps, stages, group = _blocks(dout.dtype, "glu")
    bn //= 2  # two accumulators (gate and up)
    col_tiles = max(1, _utils.cdiv(inter, bn))
    h = _utils.empty((n_rows, inter), dout.dtype, dout.device) if store_h else None
    partial = _utils.empty((col_tiles, n_rows), torch.float32, dout.device)
    if n_rows == 0 or inter == 0:
        return h, partial.zero_().sum(0)
    lora = gd is not None and gd.shape[1] > 0
    tiles = route.tiles(bm)
    desc, k_major = _weight_desc(w_d_t, bn, bk) if route.tma else (None, False)
    dout_desc = _rows_desc(dout, layout.hidden, bm, bk) if desc is not None and not gather else None
    _glu_backward_kernel[(tiles.shape[0] * col_tiles,)](
        dout, route.tokens, dout_desc, w_d_t, desc, gd if lora else dout,
        la_t if lora else w_d_t, gu, weights, dgu, h if store_h else gu, partial, tiles,
        scaling, alpha, limit, inter, layout.hidden, gd.shape[1] if lora else 0,
        *_glu_columns(layout), n_rows,
        dout.stride(0), *w_d_t.stride(), gd.stride(0) if lora else 0,
        *(la_t.stride() if lora else (0, 0, 0)), gu.stride(0), dgu.stride(0),
        h.stride(0) if store_h else 0,
        LORA=lora, STORE_H=store_h, ACT=act, INTERLEAVED=layout.interleaved,
        IEEE=dout.dtype == torch.float32,
        UPCAST=INTERPRET, R=_padded_rank(gd.shape[1] if lora else 1), BM=bm, BN=bn, BK=bk,
        GROUP=group, W_TMA=desc is not None, K_MAJOR=k_major, GATHER=gather,
        A_TMA=dout_desc is not None, num_warps=warps, num_stages=stages,
    )
    return h, partial.sum(0)


def _expert_outer(x, y, route, out, scaling=1.0, *, x_gather=False, y_gather=False,
                  scale=None):
    """out[e] (a [E, I, J] view, any strides) = scaling * sum over expert e's rows of
    (scale x[xr])^T y[yr]; x [*, I], y [*, J] with unit columns."""
    experts, dim_i, dim_j = out.shape
    if out.numel() == 0:
        return out
    bi = max(16, min(64, _utils.next_power_of_2(dim_i)))
    bj = max(16, min(64, _utils.next_power_of_2(dim_j)))
    bk = 16 if INTERPRET else 64
    grid = (experts, _utils.cdiv(dim_i, bi) * _utils.cdiv(dim_j, bj))
    _expert_outer_kernel[grid](
        x, route.tokens, scale if scale is not None else x, y, route.tokens, out,
        route.offsets, scaling, dim_i, dim_j, x.stride(0), y.stride(0), *out.stride(),
        X_GATHER=x_gather, Y_GATHER=y_gather, X_SCALE=scale is not None,
        IEEE=x.dtype == torch.float32, UPCAST=INTERPRET, BI=bi, BJ=bj, BK=bk,
        num_warps=4,
    )
    return out


# ============================================================================ forward / backward


def _weights_out_in(gate_up, down, transposed):
    """gate_up as [E, 2I, H] and down as [E, H, I] (views of the stored tensors)."""
    if transposed:
        return gate_up.transpose(1, 2), down.transpose(1, 2)
    return gate_up, down


def _cast(dtype, *tensors):
    """Biases and LoRA tensors in the compute dtype (small; their gradients are computed in
    fp32 and cast to their own dtype, so an fp32 adapter beside bf16 experts keeps fp32 grads)."""
    return [None if t is None else t.to(dtype) for t in tensors]


def _empty_rank(x):
    return x.new_empty((0, 0))


def _forward(x, topk_ids, topk_weights, gate_up, down, gate_up_bias, down_bias, a_gu, b_gu,
             a_d, b_d, s_gu, s_d, layout, act, alpha, limit):
    """(out [N, H], tokens, slots, offsets, gu [S, 2I], xa_gu [S, r], xa_d [S, r_d]).
    Tensors are in the compute dtype (weights too); topk_weights any float dtype."""
    n = x.shape[0]
    gate_up_bias, down_bias, a_gu, b_gu, a_d, b_d = _cast(
        x.dtype, gate_up_bias, down_bias, a_gu, b_gu, a_d, b_d
    )
    route = _Route(topk_ids, layout.experts)
    w_gu, w_d = _weights_out_in(gate_up, down, layout.transposed)
    x = _rows(x)
    weights = topk_weights.reshape(-1).float()[route.slots.long()]
    xa_gu = xa_d = None
    if a_gu is not None:
        xa_gu = _utils.empty((route.n_rows, a_gu.shape[1]), x.dtype, x.device)
    x_rows, gather = route.sorted_rows(x)
    if a_gu is not None:
        _grouped_mm(x_rows, a_gu, route, xa_gu, gather=gather)
    gu, h = _glu_forward(x_rows, w_gu, route, layout, xa_gu, b_gu, s_gu, gate_up_bias, act,
                         alpha, limit, gather)
    del x_rows
    if a_d is not None:
        xa_d = _utils.empty((route.n_rows, a_d.shape[1]), x.dtype, x.device)
        _grouped_mm(h, a_d, route, xa_d)
    y = _utils.empty((route.n_rows, layout.hidden), x.dtype, x.device)
    _grouped_mm(h, w_d, route, y, scatter=True, xa=xa_d, lb=b_d, scaling=s_d, bias=down_bias,
                scale=weights)
    out = y.view(n, layout.top_k, layout.hidden).sum(1, dtype=torch.float32).to(x.dtype)
    xa_gu = _empty_rank(x) if xa_gu is None else xa_gu
    xa_d = _empty_rank(x) if xa_d is None else xa_d
    return out, route.tokens, route.slots, route.offsets, gu, xa_gu, xa_d


# needs: which gradients to compute, in this order.
GRAD_NAMES = ("x", "topk_weights", "gate_up", "down", "gate_up_bias", "down_bias",
              "gate_up_a", "gate_up_b", "down_a", "down_b")


def _backward(grad, x, topk_ids, topk_weights, gate_up, down, gate_up_bias, down_bias, a_gu,
              b_gu, a_d, b_d, s_gu, s_d, tokens, slots, offsets, gu, xa_gu, xa_d, layout, act,
              alpha, limit, needs, inplace):
    """Gradients in GRAD_NAMES order (None where not needed): dx and the weights' gradients in
    the compute dtype, d(topk_weights) and the LoRA gradients in fp32."""
    need = dict(zip(GRAD_NAMES, needs, strict=True))
    n, experts = x.shape[0], layout.experts
    down_bias, a_gu, b_gu, a_d, b_d = _cast(x.dtype, down_bias, a_gu, b_gu, a_d, b_d)
    route = _Route(topk_ids, experts, tokens, slots, offsets)
    w_gu, w_d = _weights_out_in(gate_up, down, layout.transposed)
    dout = _rows(grad)
    x = _rows(x)
    weights = topk_weights.reshape(-1).float()[slots.long()]
    dtype = x.dtype
    lora_gu, lora_d = a_gu is not None, a_d is not None
    g_d = None
    dout_rows, gather = route.sorted_rows(dout)
    if lora_d:
        g_d = _utils.empty((route.n_rows, a_d.shape[1]), dtype, x.device)
        _grouped_mm(dout_rows, b_d.transpose(1, 2), route, g_d, gather=gather)
    dgu = gu if inplace else _utils.empty(gu.shape, dtype, x.device)
    store_h = need["down_a"] or need["down"]
    h, dw_sorted = _glu_backward(
        dout_rows, w_d.transpose(1, 2), route, layout, g_d,
        a_d.transpose(1, 2) if lora_d else None, s_d, gu, weights, dgu, store_h, act, alpha,
        limit, gather,
    )
    del dout_rows
    grads = dict.fromkeys(GRAD_NAMES)
    if need["topk_weights"]:
        dw = torch.empty_like(dw_sorted)
        dw[slots.long()] = dw_sorted
        dw = dw.view(n, layout.top_k)
        if down_bias is not None:
            dw = dw + (dout.float() @ down_bias.float().t()).gather(1, topk_ids.long())
        grads["topk_weights"] = dw
    g_gu = None
    if lora_gu and (need["x"] or need["gate_up_a"]):
        g_gu = _utils.empty((route.n_rows, a_gu.shape[1]), dtype, x.device)
        _grouped_mm(dgu, b_gu.transpose(1, 2), route, g_gu)
    if need["x"]:
        dx = _utils.empty((route.n_rows, layout.hidden), dtype, x.device)
        _grouped_mm(dgu, w_gu.transpose(1, 2), route, dx, scatter=True, xa=g_gu,
                    lb=a_gu.transpose(1, 2) if lora_gu else None, scaling=s_gu)
        # summed in fp32, returned in the compute dtype (as the fake says)
        dx = dx.view(n, layout.top_k, layout.hidden).sum(1, dtype=torch.float32)
        grads["x"] = dx.to(dtype)
    _lora_grads(grads, need, route, x, dout, dgu, h, g_gu, g_d, xa_gu, xa_d, weights, a_gu,
                b_gu, a_d, b_d, s_gu, s_d)
    _weight_grads(grads, need, route, layout, x, dout, dgu, h, weights, gate_up, down, slots)
    return tuple(grads[name] for name in GRAD_NAMES)


def _lora_grads(grads, need, route, x, dout, dgu, h, g_gu, g_d, xa_gu, xa_d, weights, a_gu,
                b_gu, a_d, b_d, s_gu, s_d):
    f32 = torch.float32

    def new(like):
        return _utils.empty(like.shape, f32, like.device)

    if need["gate_up_b"]:
        grads["gate_up_b"] = _expert_outer(dgu, xa_gu, route, new(b_gu), s_gu)
    if need["gate_up_a"]:
        grads["gate_up_a"] = _expert_outer(g_gu, x, route, new(a_gu), s_gu, y_gather=True)
    if need["down_b"]:
        grads["down_b"] = _expert_outer(dout, xa_d, route, new(b_d), s_d, x_gather=True,
                                        scale=weights)
    if need["down_a"]:
        grads["down_a"] = _expert_outer(g_d, h, route, new(a_d), s_d, scale=weights)


def _weight_grads(grads, need, route, layout, x, dout, dgu, h, weights, gate_up, down, slots):
    """Full fine-tuning: gradients of the expert weights and biases (stored layout)."""
    experts = layout.experts
    if need["gate_up"]:
        out = _utils.empty(gate_up.shape, x.dtype, x.device)
        view = out.transpose(1, 2) if layout.transposed else out
        grads["gate_up"] = out
        _expert_outer(dgu, x, route, view, y_gather=True)
    if need["down"]:
        out = _utils.empty(down.shape, x.dtype, x.device)
        view = out.transpose(1, 2) if layout.transposed else out
        grads["down"] = out
        _expert_outer(dout, h, route, view, x_gather=True, scale=weights)
    # Bias gradients: per-expert column sums, the outer-product kernel against a ones column.
    ones = x.new_ones((route.n_rows, 1))
    if need["gate_up_bias"]:
        out = _utils.empty((experts, dgu.shape[1], 1), torch.float32, x.device)
        grads["gate_up_bias"] = _expert_outer(dgu, ones, route, out)[..., 0]
    if need["down_bias"]:
        out = _utils.empty((experts, layout.hidden, 1), torch.float32, x.device)
        grads["down_bias"] = _expert_outer(dout, ones, route, out, x_gather=True,
                                           scale=weights)[..., 0]


# ============================================================================ custom ops

_TENSOR_ARGS = (
    "Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor gate_up, Tensor down, "
    "Tensor? gate_up_bias, Tensor? down_bias, Tensor? gate_up_a, Tensor? gate_up_b, "
    "Tensor? down_a, Tensor? down_b, float s_gate_up, float s_down"
)
_LAYOUT_ARGS = "bool transposed, bool interleaved, int activation, float alpha, float limit"


def _layout_of(x, topk_ids, gate_up, transposed, interleaved) -> Layout:
    two_i = gate_up.shape[2] if transposed else gate_up.shape[1]
    return Layout(gate_up.shape[0], topk_ids.shape[1], x.shape[1], two_i // 2, x.dtype,
                  transposed, interleaved)


def _fake_forward(x, topk_ids, topk_weights, gate_up, down, gate_up_bias, down_bias, a_gu,
                  b_gu, a_d, b_d, s_gu, s_d, transposed, interleaved, act, alpha, limit):
    layout = _layout_of(x, topk_ids, gate_up, transposed, interleaved)
    n_rows = topk_ids.shape[0] * topk_ids.shape[1]
    index = {"dtype": torch.int32}
    return (
        x.new_empty(x.shape),
        x.new_empty((n_rows,), **index),
        x.new_empty((n_rows,), **index),
        x.new_empty((layout.experts + 1,), **index),
        x.new_empty((n_rows, 2 * layout.intermediate)),
        x.new_empty((n_rows, a_gu.shape[1]) if a_gu is not None else (0, 0)),
        x.new_empty((n_rows, a_d.shape[1]) if a_d is not None else (0, 0)),
    )


@_utils.register_op(
    f"moe_forward({_TENSOR_ARGS}, {_LAYOUT_ARGS}) -> "
    "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
    fake=_fake_forward,
)
def _forward_op(x, topk_ids, topk_weights, gate_up, down, gate_up_bias, down_bias, a_gu, b_gu,
                a_d, b_d, s_gu, s_d, transposed, interleaved, act, alpha, limit):
    layout = _layout_of(x, topk_ids, gate_up, transposed, interleaved)
    return _forward(x, topk_ids, topk_weights, gate_up, down, gate_up_bias, down_bias, a_gu,
                    b_gu, a_d, b_d, s_gu, s_d, layout, act, alpha, limit)


def _grad_like(shape, dtype, like, wanted):
    """A wanted gradient; else the real op's placeholder, an empty tensor in x's dtype."""
    return like.new_empty(shape, dtype=dtype) if wanted else like.new_empty((0,))


def _fake_backward(grad, x, topk_ids, topk_weights, gate_up, down, gate_up_bias, down_bias,
                   a_gu, b_gu, a_d, b_d, s_gu, s_d, tokens, slots, offsets, gu, xa_gu, xa_d,
                   transposed, interleaved, act, alpha, limit, needs):
    f32, dtype = torch.float32, x.dtype
    specs = [
        (x.shape, dtype), (topk_weights.shape, f32), (gate_up.shape, dtype),
        (down.shape, dtype), (getattr(gate_up_bias, "shape", (0,)), f32),
        (getattr(down_bias, "shape", (0,)), f32),
        *((getattr(t, "shape", (0,)), f32) for t in (a_gu, b_gu, a_d, b_d)),
    ]
    return tuple(_grad_like(s, d, x, w) for (s, d), w in zip(specs, needs, strict=True))


@_utils.register_op(
    f"moe_backward(Tensor grad, {_TENSOR_ARGS}, Tensor tokens, Tensor slots, Tensor offsets, "
    f"Tensor gu, Tensor xa_gu, Tensor xa_d, {_LAYOUT_ARGS}, bool[] needs) -> "
    f"({', '.join(['Tensor'] * len(GRAD_NAMES))})",
    fake=_fake_backward,
)
def _backward_op(grad, x, topk_ids, topk_weights, gate_up, down, gate_up_bias, down_bias, a_gu,
                 b_gu, a_d, b_d, s_gu, s_d, tokens, slots, offsets, gu, xa_gu, xa_d, transposed,
                 interleaved, act, alpha, limit, needs):
    """The functional backward (fresh dgu buffer): traced code (torch.compile) runs this."""
    layout = _layout_of(x, topk_ids, gate_up, transposed, interleaved)
    grads = _backward(grad, x, topk_ids, topk_weights, gate_up, down, gate_up_bias, down_bias,
                      a_gu, b_gu, a_d, b_d, s_gu, s_d, tokens, slots, offsets, gu, xa_gu, xa_d,
                      layout, act, alpha, limit, needs, inplace=False)
    return tuple(g if g is not None else x.new_empty((0,)) for g in grads)


# ============================================================================ autograd


class _MoeFunction(torch.autograd.Function):
    """Inputs: x, topk_ids, topk_weights, gate_up, down, the two biases, the four LoRA
    tensors (all in the compute dtype except topk_ids / topk_weights), then the two scalings,
    the layout flags, the activation code, alpha and limit."""

    @staticmethod
    def forward(ctx, x, topk_ids, topk_weights, gate_up, down, gate_up_bias, down_bias, a_gu,
                b_gu, a_d, b_d, s_gu, s_d, transposed, interleaved, act, alpha, limit):
        tensors = (x, topk_ids, topk_weights, gate_up, down, gate_up_bias, down_bias, a_gu,
                   b_gu, a_d, b_d)
        eager = _utils.plain_eager(*tensors)
        args = (*tensors, s_gu, s_d, transposed, interleaved, act, alpha, limit)
        if eager:
            layout = _layout_of(x, topk_ids, gate_up, transposed, interleaved)
            outputs = _forward(*tensors, s_gu, s_d, layout, act, alpha, limit)
        else:
            outputs = _forward_op(*args)
        out, *saved = outputs
        ctx.save_for_backward(*tensors, *saved)
        ctx.options = (s_gu, s_d, transposed, interleaved, act, alpha, limit)
        ctx.flags = tuple(ctx.needs_input_grad)  # read in forward (see ops/lora.py)
        ctx.overwritten = False
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        tensors = ctx.saved_tensors
        inputs, saved = tensors[:11], tensors[11:]
        s_gu, s_d, transposed, interleaved, act, alpha, limit = ctx.options
        flags = ctx.flags
        needs = [flags[0], flags[2], flags[3], flags[4], flags[5], flags[6], *flags[7:11]]
        needs = [bool(n) and inputs[i] is not None
                 for n, i in zip(needs, (0, 2, 3, 4, 5, 6, 7, 8, 9, 10), strict=True)]
        grad = grad.to(inputs[0].dtype)
        if _utils.plain_eager(grad, *inputs):
            if ctx.overwritten:
                raise RuntimeError(
                    "fusetune.moe_mlp: backward ran twice through one graph (retain_graph=True); "
                    "its first backward overwrote the saved activations with their gradients. "
                    "Run the forward again for each backward."
                )
            ctx.overwritten = True
            layout = _layout_of(inputs[0], inputs[1], inputs[3], transposed, interleaved)
            grads = _backward(grad, *inputs, s_gu, s_d, *saved, layout, act, alpha, limit,
                              needs, inplace=True)
        else:
            grads = _backward_op(grad, *inputs, s_gu, s_d, *saved, transposed, interleaved,
                                 act, alpha, limit, needs)
            grads = [g if want else None for g, want in zip(grads, needs, strict=True)]
        owners = [inputs[i] for i in (0, 2, 3, 4, 5, 6, 7, 8, 9, 10)]
        grads = [None if g is None else g.to(t.dtype) for g, t in zip(grads, owners, strict=True)]
        dx, dw, *rest = grads
        return (dx, None, dw, *rest, None, None, None, None, None, None, None)


# ============================================================================ public function


def moe_mlp(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    *,
    activation: str = "swiglu",
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    lora: MoeLora | None = None,
    transposed: bool = False,
    interleaved: bool = False,
    alpha: float = 1.702,
    limit: float = 7.0,
) -> torch.Tensor:
    """Mixture-of-experts expert MLP with optional per-expert LoRA, fused (module docstring).

    Args:
        x: [N, H] tokens, float32 / float16 / bfloat16.
        topk_ids: [N, K] int32 / int64 expert of each routed slot, each in [0, E) (not checked
            on the device: an id outside it is undefined behaviour, as an index would be).
        topk_weights: [N, K] routing weights (any float dtype).
        gate_up, down: the expert weights as transformers 5.x stores them: [E, 2I, H] and
            [E, H, I], or with ``transposed=True`` [E, H, 2I] and [E, I, H] (gpt-oss).
        activation: "swiglu" or "gpt_oss" (clamped SwiGLU with ``alpha`` and ``limit``).
        gate_up_bias [E, 2I], down_bias [E, H]: optional (gpt-oss).
        lora: a :class:`fusetune.reference.moe.MoeLora` (PEFT's target_parameters factors).
        interleaved: gate/up columns interleaved (gpt-oss) instead of concatenated.

    Returns [N, H] in the compute dtype (the autocast dtype under torch.autocast; else x's and
    gate_up's, or the 16-bit one of the two). Gradients: x, topk_weights, the LoRA tensors,
    and the expert weights and biases only where they require grad, each in its own dtype.
    Backward through one graph works once in eager mode (it overwrites saved activations).

    Raises:
        TypeError: non-tensor or non-floating arguments, integer topk_ids expected, float16
            mixed with bfloat16 outside autocast, down's dtype not gate_up's, lora not a MoeLora.
        ValueError: shapes that do not fit (each argument named with the expected layout),
            an unknown activation, a non-positive limit, tensors on different devices.
    """
    layout = reference.check_moe_args(
        x, topk_ids, topk_weights, gate_up, down, activation, gate_up_bias, down_bias, lora,
        transposed, interleaved, alpha, limit,
    )
    return moe_mlp_checked(x, topk_ids, topk_weights, gate_up, down, layout, activation,
                           gate_up_bias, down_bias, lora, alpha, limit)


def moe_mlp_checked(x, topk_ids, topk_weights, gate_up, down, layout, activation,
                    gate_up_bias=None, down_bias=None, lora=None, alpha=1.702, limit=7.0):
    """:func:`moe_mlp` after ``reference.check_moe_args`` (the integration checks once)."""
    tma_mode()  # a bad FUSETUNE_MOE_TMA fails here on every backend, not at a launch
    dtype = layout.dtype
    if _utils.backend(x) == "reference" or dtype not in _utils.KERNEL_DTYPES:
        return reference.moe_mlp_checked(x, topk_ids, topk_weights, gate_up, down, layout,
                                         activation, gate_up_bias, down_bias, lora, alpha, limit)
    if lora is None:
        lora = MoeLora(None, None, None, None)
    s_gu, s_d = lora.scalings

    def cast(t):
        return None if t is None else t.to(dtype)

    return _MoeFunction.apply(
        x.to(dtype), topk_ids, topk_weights, cast(gate_up), cast(down), gate_up_bias, down_bias,
        lora.gate_up_a, lora.gate_up_b, lora.down_a, lora.down_b, s_gu, s_d, layout.transposed,
        layout.interleaved,
        ACTIVATION_CODES[activation], float(alpha), float(limit),
    )
