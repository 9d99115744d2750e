"""Chunked gated slot attention kernels (mode="chunk" of :func:`fusetune.gated_slot_attention`).

``states_kernel`` walks each sequence in chunks of S = 64 tokens and stores every chunk's
starting states [K, M] and [M, V] (fp32; recomputed in backward, never kept from the forward),
one program per block of BMS slots (the slot columns of both states evolve independently), and
the chunk-local gate cumsum G (fp32), which every later kernel reads, so all of them see
bit-identical decays. The per-chunk kernels then carry no state: they cut the chunk into blocks
of BT = 16 tokens and work in [BT, D] tiles (few registers, many programs):
  - the chunk-start states enter every row as e_i = exp(G_i) times a matmul;
  - a pair of blocks (rows i of a later block, columns j of an earlier one) factorises the decay
    through the cumsum r at the boundary between them: exp(G_i - G_j) = exp(G_i - r) exp(r - G_j),
    both factors <= 1, so the pair is two matmuls and no gate however negative overflows;
  - a diagonal block is one more such pair through the same r, its products masked to i >= j;
    one factor then exceeds 1, by at most exp(its gate drop), so a block whose gates drop by more
    than FAST_DROP = 60 (a reset: gates near -1e4 or -inf) instead forms the exact decay
    W[i, j, m] = exp(G_i - G_j) (i >= j, else 0) one column j at a time, a [BT, M] tile (sweep B
    does that in a second pass over the chunks that need it, see ``bwd_b_kernel``).

Per row block (scale folded in; A = q k^T; rows i, columns j; H0 the chunk-start states):
    a  = e * (q @ Hk0) + sum_j A[i, j] s_j W[i, j]              p = softmax(a)
    o  = (p e) @ Hv0 + sum_j A2[i, j] v_j,   A2[i, j] = sum_m p_i s_j W[i, j]
Sweep A adds dp = e * (do @ Hv0^T) + sum_j (do_i . v_j) s_j W[i, j], da = softmax'(dp) and
dq = (da e) @ Hk0^T + B @ k, B[i, j] = sum_m da_i s_j W[i, j]. Sweep B walks each chunk's blocks in
reverse as columns j, against the chunk-end state gradients and the later blocks i (see ``gsa``
for the math).
"""

from __future__ import annotations

from fusetune._triton import tl, triton
from fusetune.ops.linear_attention._common import (
    chunk_slot,
    gate_sums,
    load_gate,
    load_hk,
    load_hv,
    mm,
    mm_inputs,
    sequence_bounds,
    store_states,
)

SUB_CHUNK = 16  # BT: tokens per block (rows of every tile)
# S: tokens per chunk; one pair of fp32 states is kept per S tokens (recomputed in backward).
# Smaller under the interpreter so tests cross chunk boundaries.
STATE_CHUNK, STATE_CHUNK_INTERPRETED = 64, 32
SLOT_BLOCK = 16  # BMS: slots per program of the sequential state kernels (more programs)
# Warps per kernel. Timed on the H100 (tools/tune_gsa.py, 2026-11-23): 4 everywhere beat 8 for
# every kernel, in both designs measured, though ptxas reports more spill at 4 (two CTAs of 4
# warps per SM keep as many warps resident as one of 8, with cheaper block-wide exchanges).
NUM_WARPS = {"states": 4, "dstates": 4, "fwd": 4, "bwd_a": 4, "bwd_b": 4}


def constants(seq_len: int, interpreting: bool) -> dict:
    chunk = STATE_CHUNK_INTERPRETED if interpreting else STATE_CHUNK
    return dict(BT=min(SUB_CHUNK, chunk), S=chunk)


# ----------------------------------------------------------------------------- tiles


@triton.jit
def _tile(ptr, rows, stride_t, row_mask, cols, col_mask):
    """A [rows, cols] tile as fp32, 0 outside the masks."""
    mask = row_mask[:, None] & col_mask[None, :]
    return tl.load(ptr + rows[:, None] * stride_t + cols[None, :], mask=mask, other=0.0).to(
        tl.float32)


@triton.jit
def _inputs(ptr, rows, stride_t, row_mask, cols, col_mask):
    """A [rows, cols] tile in the input dtype (q, k, v, do only feed matmuls), 0 outside."""
    mask = row_mask[:, None] & col_mask[None, :]
    return tl.load(ptr + rows[:, None] * stride_t + cols[None, :], mask=mask, other=0.0)


@triton.jit
def _row(ptr, t, stride_t, cols, col_mask):
    """Row ``t`` as fp32, 0 outside the mask."""
    return tl.load(ptr + t * stride_t + cols, mask=col_mask, other=0.0).to(tl.float32)


@triton.jit
def _store(ptr, rows, stride_t, row_mask, cols, col_mask, value):
    mask = row_mask[:, None] & col_mask[None, :]
    tl.store(ptr + rows[:, None] * stride_t + cols[None, :], value.to(ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def _decay(exponent, row_mask):
    """exp of a [BT, BM] exponent (<= 0 by construction) on valid rows, 0 on the others."""
    return tl.exp(tl.where(row_mask[:, None], exponent, float("-inf")))


@triton.jit
def _column(x, ti, j):
    """Column ``j`` of a [BT, BT] tile."""
    return tl.sum(tl.where(ti[None, :] == j, x, 0.0), axis=1)


@triton.jit
def _put_column(x, ti, j, column):
    return tl.where(ti[None, :] == j, column[:, None], x)


@triton.jit
def _decay_column(gcum, g_j, ti, j, n):
    """Column ``j`` of the diagonal block's decay, W[:, j] = exp(G_i - G_j) [BT, BM] for valid
    rows i >= j, else 0: every factor <= 1. -inf before exp, so no row forms exp(+big)."""
    return tl.exp(tl.where(((ti >= j) & (ti < n))[:, None], gcum - g_j[None, :], float("-inf")))


@triton.jit
def _softmax(a, mm_):
    a = tl.where(mm_[None, :], a, float("-inf"))
    p = tl.exp(a - tl.max(a, axis=1)[:, None])
    return a, p / tl.sum(p, axis=1)[:, None]


@triton.jit
def _chunk_span(cu, i_n, c, T, S: tl.constexpr, NT, VARLEN: tl.constexpr):
    """(batch index, sequence end, chunk start, chunk end, slot). A program past the sequence's
    last chunk gets an empty range and slot 0 (read, never written)."""
    i_b, bos, eos = sequence_bounds(cu, i_n, T, VARLEN)
    c0 = bos + c * S
    c_end = tl.minimum(c0 + S, eos)
    slot = tl.where(c0 < eos, chunk_slot(i_n, bos, c, S, NT, VARLEN), 0)
    return i_b, eos, c0, c_end, slot


@triton.jit
def _ref_row(gc, t, sc_t, cm, mm_, lo, hi):
    """The cumsum at token ``t`` (a block boundary), or 0 (the chunk start) unless lo <= t < hi."""
    return tl.load(gc + t * sc_t + cm, mask=mm_ & (cm * 0 + t >= lo) & (cm * 0 + t < hi),
                   other=0.0)


# ----------------------------------------------------------------------------- state passing


@triton.jit
def states_kernel(
    k, v, s, g, gc, hk0, hv0, hk_buf, hv_buf, hkT, hvT, dhkT, dhvT, f_buf, cu,
    sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, ss_b, ss_t, ss_h, sg_b, sg_t, sg_h, sc_b, sc_t, sc_h,
    T, H, K, V, M, NT, BK: tl.constexpr, BV: tl.constexpr, BMS: tl.constexpr, S: tl.constexpr,
    HAS_H0: tl.constexpr, STORE_HT: tl.constexpr, HAS_DHT: tl.constexpr, VARLEN: tl.constexpr,
    DOT: tl.constexpr, UPCAST: tl.constexpr,
):
    """Per (block of BMS slots, sequence x key/value head): walk the chunks of S tokens carrying
    the slots' columns of Hk and rows of Hv; store each chunk's starting states (fp32), the
    chunk-local gate cumsum, the final states, and with HAS_DHT the final-state term of dg,
    sum_k dHk_T * Hk_T + sum_v dHv_T * Hv_T, per slot."""
    i_m, pid = tl.program_id(0), tl.program_id(1).to(tl.int64)
    i_n, i_h = pid // H, pid % H
    i_b, bos, eos = sequence_bounds(cu, i_n, T, VARLEN)
    ck, cv, cm = tl.arange(0, BK), tl.arange(0, BV), i_m * BMS + tl.arange(0, BMS)
    mk, mv, mm_ = ck < K, cv < V, cm < M
    k += i_b * sk_b + i_h * sk_h
    v += i_b * sv_b + i_h * sv_h
    s += i_b * ss_b + i_h * ss_h
    g += i_b * sg_b + i_h * sg_h
    gc += i_b * sc_b + i_h * sc_h
    hk = tl.zeros([BK, BMS], dtype=tl.float32)
    hv = tl.zeros([BMS, BV], dtype=tl.float32)
    if HAS_H0:
        hk += load_hk(hk0, pid, ck, cm, mk, mm_, K, M)
        hv += load_hv(hv0, pid, cv, cm, mv, mm_, V, M)
    for c in range(0, tl.cdiv(eos - bos, S)):
        slot = chunk_slot(i_n, bos, c, S, NT, VARLEN) * H + i_h
        store_states(hk_buf, hv_buf, slot, hk, hv, ck, cv, cm, mk, mv, mm_, K, V, M)
        rows = bos + c * S + tl.arange(0, S).to(tl.int64)
        mt = rows < eos
        gate = load_gate(g + rows[:, None] * sg_t + cm[None, :], mt[:, None] & mm_[None, :])
        gcum, last = gate_sums(gate)
        _store(gc, rows, sc_t, mt, cm, mm_, gcum)
        sd = _tile(s, rows, ss_t, mt, cm, mm_) * tl.exp(last[None, :] - gcum)
        decay = tl.exp(last)
        hk = hk * decay[None, :] + mm(tl.trans(_tile(k, rows, sk_t, mt, ck, mk)), sd, DOT, UPCAST)
        hv = hv * decay[:, None] + mm(tl.trans(sd), _tile(v, rows, sv_t, mt, cv, mv), DOT, UPCAST)
    if STORE_HT:
        store_states(hkT, hvT, pid, hk, hv, ck, cv, cm, mk, mv, mm_, K, V, M)
    if HAS_DHT:
        final = (tl.sum(load_hk(dhkT, pid, ck, cm, mk, mm_, K, M) * hk, axis=0)
                 + tl.sum(load_hv(dhvT, pid, cv, cm, mv, mm_, V, M) * hv, axis=1))
        tl.store(f_buf + pid * M + cm, final, mask=mm_)


@triton.jit
def dstates_kernel(
    q, gc, do, p_buf, da_buf, dhkT, dhvT, dhk_buf, dhv_buf, dhk0, dhv0, cu,
    sq_b, sq_t, sq_h, sc_b, sc_t, sc_h, sdo_b, sdo_t, sdo_h, sw_b, sw_t, sw_h, scale, T, HQ,
    GROUP: tl.constexpr, K, V, M, NT, BK: tl.constexpr, BV: tl.constexpr, BMS: tl.constexpr,
    S: tl.constexpr, HAS_DHT: tl.constexpr, VARLEN: tl.constexpr, DOT: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Per (block of BMS slots, sequence x query head), chunks in reverse: store the gradients
    w.r.t. each chunk's end states that come from later tokens (and the final-state gradient),
    carried as dH = dH * exp(G_last) + q^T (da e) scale (resp. (p e)^T do); the rest is dh0."""
    i_m, pid = tl.program_id(0), tl.program_id(1).to(tl.int64)
    i_n, i_hq = pid // HQ, pid % HQ
    i_h = i_hq // GROUP
    i_b, bos, eos = sequence_bounds(cu, i_n, T, VARLEN)
    ck, cv, cm = tl.arange(0, BK), tl.arange(0, BV), i_m * BMS + tl.arange(0, BMS)
    mk, mv, mm_ = ck < K, cv < V, cm < M
    q += i_b * sq_b + i_hq * sq_h
    gc += i_b * sc_b + i_h * sc_h
    do += i_b * sdo_b + i_hq * sdo_h
    w_off = i_b * sw_b + i_hq * sw_h
    p_buf += w_off
    da_buf += w_off
    dhk = tl.zeros([BK, BMS], dtype=tl.float32)
    dhv = tl.zeros([BMS, BV], dtype=tl.float32)
    if HAS_DHT:
        if i_hq % GROUP == 0:  # the final-state gradient counts once per key/value head
            state = i_n * (HQ // GROUP) + i_h
            dhk += load_hk(dhkT, state, ck, cm, mk, mm_, K, M)
            dhv += load_hv(dhvT, state, cv, cm, mv, mm_, V, M)
    n_chunks = tl.cdiv(eos - bos, S)
    for i in range(0, n_chunks):
        c = n_chunks - 1 - i
        slot = chunk_slot(i_n, bos, c, S, NT, VARLEN) * HQ + i_hq
        store_states(dhk_buf, dhv_buf, slot, dhk, dhv, ck, cv, cm, mk, mv, mm_, K, V, M)
        rows = bos + c * S + tl.arange(0, S).to(tl.int64)
        mt = rows < eos
        e = _decay(_tile(gc, rows, sc_t, mt, cm, mm_), mt)
        decay = tl.exp(_row(gc, tl.minimum(bos + c * S + S, eos) - 1, sc_t, cm, mm_))
        da = _tile(da_buf, rows, sw_t, mt, cm, mm_) * e
        dhk = dhk * decay[None, :] + mm(tl.trans(_tile(q, rows, sq_t, mt, ck, mk)), da, DOT,
                                        UPCAST) * scale
        pe = _tile(p_buf, rows, sw_t, mt, cm, mm_) * e
        dhv = dhv * decay[:, None] + mm(tl.trans(pe), _tile(do, rows, sdo_t, mt, cv, mv), DOT,
                                        UPCAST)
    store_states(dhk0, dhv0, pid, dhk, dhv, ck, cv, cm, mk, mv, mm_, K, V, M)


# ----------------------------------------------------------------------------- per block
# A pair of blocks (rows i later than columns j) is two matmuls through a boundary cumsum ref:
# exp(G_i - G_j) = exp(G_i - ref) exp(ref - G_j). The diagonal block joins the pairs through the
# same ref, its products masked to i >= j; one of its two factors then exceeds 1, by at most
# exp(drop) with drop the block's largest gate drop over 16 tokens. Up to FAST_DROP that factor
# (<= 1.2e26) times a 16-term sum of products stays far inside fp32 (and tf32); a steeper block
# (gates near -1e4 or -inf, a full reset) takes the exact decay-column loops instead.
FAST_DROP = tl.constexpr(60.0)


@triton.jit
def _decayed_slots(s, gc, rows, ss_t, sc_t, row_mask, cm, mm_, ref):
    """s_j exp(ref - G_j) [BT, BM] for a block of tokens j (0 on rows outside the mask)."""
    gcum = _tile(gc, rows, sc_t, row_mask, cm, mm_)
    return _tile(s, rows, ss_t, row_mask, cm, mm_) * _decay(ref[None, :] - gcum, row_mask)


@triton.jit
def _steep(gcum, ref, row_mask):
    """Whether a block's largest |G - ref| (its gate drop) passes FAST_DROP: a scalar."""
    drop = tl.where(row_mask[:, None], tl.abs(gcum - ref[None, :]), 0.0)
    return tl.max(tl.max(drop, axis=1), axis=0) > FAST_DROP


@triton.jit
def _lower(x, rows, cols):
    """x [rows, cols] where token cols <= token rows, else 0."""
    return tl.where(cols[None, :] <= rows[:, None], x, 0.0)


@triton.jit
def _upper(x, rows, cols):
    """x [rows, cols] where token cols >= token rows, else 0."""
    return tl.where(cols[None, :] >= rows[:, None], x, 0.0)


@triton.jit
def _exact_gated(acc, x, s, gc, gcum, start, ss_t, sc_t, cm, mm_, ti, n):
    """acc + sum_j x[:, j] s_j W[:, j] over the diagonal block, W[i, j] = exp(G_i - G_j) [BM]
    for i >= j (a slot-gated product: scores or dp), one decay column at a time."""
    for j in range(0, n):
        w = _decay_column(gcum, _row(gc, start + j, sc_t, cm, mm_), ti, j, n)
        acc += _column(x, ti, j)[:, None] * _row(s, start + j, ss_t, cm, mm_)[None, :] * w
    return acc


@triton.jit
def _exact_pairs(y, s, gc, gcum, start, ss_t, sc_t, cm, mm_, ti, n, BT: tl.constexpr):
    """[BT, BT] with (i, j) = sum_m y_i s_j W[i, j] over the diagonal block (0 for i < j)."""
    out = tl.zeros([BT, BT], dtype=tl.float32)
    for j in range(0, n):
        w = _decay_column(gcum, _row(gc, start + j, sc_t, cm, mm_), ti, j, n)
        out = _put_column(out, ti, j, tl.sum(y * _row(s, start + j, ss_t, cm, mm_)[None, :] * w,
                                             axis=1))
    return out


@triton.jit
def _exact_ds(acc, xa, ya, xb, yb, gc, gcum, start, sc_t, cm, mm_, ti, n):
    """acc + row j: sum_i W[i, j] (xa[i, j] ya_i + xb[i, j] yb_i) over the diagonal block (the
    diagonal's part of ds)."""
    for j in range(0, n):
        w = _decay_column(gcum, _row(gc, start + j, sc_t, cm, mm_), ti, j, n)
        x = w * (_column(xa, ti, j)[:, None] * ya + _column(xb, ti, j)[:, None] * yb)
        acc += tl.where(ti[:, None] == j, tl.sum(x, axis=0)[None, :], 0.0)
    return acc


@triton.jit
def _row_block(i_cb, cu, i_n, T, S: tl.constexpr, BT: tl.constexpr, NT, VARLEN: tl.constexpr):
    """(batch index, chunk start, chunk end, slot, block index in the chunk, first token) of
    program ``i_cb`` of the per-block kernels."""
    c, bi = i_cb // (S // BT), i_cb % (S // BT)
    i_b, eos, c0, c_end, slot = _chunk_span(cu, i_n, c, T, S, NT, VARLEN)
    return i_b, c0, c_end, slot, bi, c0 + bi * BT


@triton.jit
def fwd_kernel(
    q, k, v, s, gc, o, hk_buf, hv_buf, cu,
    sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, ss_b, ss_t, ss_h, sc_b, sc_t, sc_h,
    so_b, so_t, so_h, scale, T, HQ, GROUP: tl.constexpr, K, V, M, NT,
    BK: tl.constexpr, BV: tl.constexpr, BM: tl.constexpr, BT: tl.constexpr, S: tl.constexpr,
    VARLEN: tl.constexpr, DOT: tl.constexpr, UPCAST: tl.constexpr,
):
    """One program per (block of BT tokens, sequence x query head): o of its rows, from the
    chunk-start states, the chunk's earlier blocks and the diagonal block."""
    i_cb, pid = tl.program_id(0), tl.program_id(1).to(tl.int64)
    i_n, i_hq = pid // HQ, pid % HQ
    i_h = i_hq // GROUP
    i_b, c0, c_end, slot, bi, start = _row_block(i_cb, cu, i_n, T, S, BT, NT, VARLEN)
    if start >= c_end:
        return
    ck, cv, cm, ti = tl.arange(0, BK), tl.arange(0, BV), tl.arange(0, BM), tl.arange(0, BT)
    mk, mv, mm_ = ck < K, cv < V, cm < M
    q += i_b * sq_b + i_hq * sq_h
    k += i_b * sk_b + i_h * sk_h
    v += i_b * sv_b + i_h * sv_h
    s += i_b * ss_b + i_h * ss_h
    gc += i_b * sc_b + i_h * sc_h
    o += i_b * so_b + i_hq * so_h
    state = slot * (HQ // GROUP) + i_h
    rows = start + ti.to(tl.int64)
    mt = rows < c_end
    n = tl.minimum(c_end - start, BT)
    q_i = _inputs(q, rows, sq_t, mt, ck, mk)
    g_i = _tile(gc, rows, sc_t, mt, cm, mm_)
    ref = _ref_row(gc, start - 1, sc_t, cm, mm_, c0, c_end)  # the cumsum before the block
    e = _decay(g_i, mt)
    u = _decay(g_i - ref[None, :], mt)
    steep = _steep(g_i, ref, mt)
    n_pairs = bi + 1 - steep.to(tl.int32)  # the earlier blocks, and the diagonal unless steep
    # Slot scores: chunk-start state, then the block pairs.
    a = e * mm(q_i, load_hk(hk_buf, state, ck, cm, mk, mm_, K, M), DOT, UPCAST)
    pairs = tl.zeros([BT, BM], dtype=tl.float32)
    for bj in range(0, n_pairs):
        rows_j = c0 + bj * BT + ti.to(tl.int64)
        mj = rows_j < c_end
        sd = _decayed_slots(s, gc, rows_j, ss_t, sc_t, mj, cm, mm_, ref)
        qk = mm_inputs(q_i, tl.trans(_inputs(k, rows_j, sk_t, mj, ck, mk)), DOT, UPCAST)
        pairs += mm(_lower(qk, rows, rows_j), sd, DOT, UPCAST)
    a += u * pairs
    if steep:
        qk = mm_inputs(q_i, tl.trans(_inputs(k, rows, sk_t, mt, ck, mk)), DOT, UPCAST)
        a = _exact_gated(a, qk, s, gc, g_i, start, ss_t, sc_t, cm, mm_, ti, n)
    a, p = _softmax(a * scale, mm_)
    # Output: the same parts with p in place of q.
    o_c = mm(p * e, load_hv(hv_buf, state, cv, cm, mv, mm_, V, M), DOT, UPCAST)
    pu = p * u
    for bj in range(0, n_pairs):
        rows_j = c0 + bj * BT + ti.to(tl.int64)
        mj = rows_j < c_end
        sd = _decayed_slots(s, gc, rows_j, ss_t, sc_t, mj, cm, mm_, ref)
        attn = _lower(mm(pu, tl.trans(sd), DOT, UPCAST), rows, rows_j)
        o_c += mm(attn, _inputs(v, rows_j, sv_t, mj, cv, mv), DOT, UPCAST)
    if steep:
        attn = _exact_pairs(p, s, gc, g_i, start, ss_t, sc_t, cm, mm_, ti, n, BT)
        o_c += mm(attn, _inputs(v, rows, sv_t, mt, cv, mv), DOT, UPCAST)
    _store(o, rows, so_t, mt, cv, mv, o_c)


@triton.jit
def bwd_a_kernel(
    q, k, v, s, gc, do, dq, p_buf, da_buf, r_buf, hk_buf, hv_buf, cu,
    sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, ss_b, ss_t, ss_h, sc_b, sc_t, sc_h,
    sdo_b, sdo_t, sdo_h, sdq_b, sdq_t, sdq_h, sw_b, sw_t, sw_h, scale, T, HQ,
    GROUP: tl.constexpr, K, V, M, NT, BK: tl.constexpr, BV: tl.constexpr, BM: tl.constexpr,
    BT: tl.constexpr, S: tl.constexpr, VARLEN: tl.constexpr, DOT: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Sweep A per (block, sequence x query head): dq, and p, da, r = a*da + p*dp (fp32)."""
    i_cb, pid = tl.program_id(0), tl.program_id(1).to(tl.int64)
    i_n, i_hq = pid // HQ, pid % HQ
    i_h = i_hq // GROUP
    i_b, c0, c_end, slot, bi, start = _row_block(i_cb, cu, i_n, T, S, BT, NT, VARLEN)
    if start >= c_end:
        return
    ck, cv, cm, ti = tl.arange(0, BK), tl.arange(0, BV), tl.arange(0, BM), tl.arange(0, BT)
    mk, mv, mm_ = ck < K, cv < V, cm < M
    q += i_b * sq_b + i_hq * sq_h
    k += i_b * sk_b + i_h * sk_h
    v += i_b * sv_b + i_h * sv_h
    s += i_b * ss_b + i_h * ss_h
    gc += i_b * sc_b + i_h * sc_h
    do += i_b * sdo_b + i_hq * sdo_h
    dq += i_b * sdq_b + i_hq * sdq_h
    w_off = i_b * sw_b + i_hq * sw_h
    state = slot * (HQ // GROUP) + i_h
    rows = start + ti.to(tl.int64)
    mt = rows < c_end
    n = tl.minimum(c_end - start, BT)
    q_i = _inputs(q, rows, sq_t, mt, ck, mk)
    do_i = _inputs(do, rows, sdo_t, mt, cv, mv)
    g_i = _tile(gc, rows, sc_t, mt, cm, mm_)
    ref = _ref_row(gc, start - 1, sc_t, cm, mm_, c0, c_end)
    e = _decay(g_i, mt)
    u = _decay(g_i - ref[None, :], mt)
    steep = _steep(g_i, ref, mt)
    n_pairs = bi + 1 - steep.to(tl.int32)
    a = e * mm(q_i, load_hk(hk_buf, state, ck, cm, mk, mm_, K, M), DOT, UPCAST)
    dp = e * mm(do_i, tl.trans(load_hv(hv_buf, state, cv, cm, mv, mm_, V, M)), DOT, UPCAST)
    pairs_a = tl.zeros([BT, BM], dtype=tl.float32)
    pairs_dp = tl.zeros([BT, BM], dtype=tl.float32)
    for bj in range(0, n_pairs):
        rows_j = c0 + bj * BT + ti.to(tl.int64)
        mj = rows_j < c_end
        sd = _decayed_slots(s, gc, rows_j, ss_t, sc_t, mj, cm, mm_, ref)
        qk = mm_inputs(q_i, tl.trans(_inputs(k, rows_j, sk_t, mj, ck, mk)), DOT, UPCAST)
        dov = mm_inputs(do_i, tl.trans(_inputs(v, rows_j, sv_t, mj, cv, mv)), DOT, UPCAST)
        pairs_a += mm(_lower(qk, rows, rows_j), sd, DOT, UPCAST)
        pairs_dp += mm(_lower(dov, rows, rows_j), sd, DOT, UPCAST)
    a += u * pairs_a
    dp += u * pairs_dp
    if steep:
        qk = mm_inputs(q_i, tl.trans(_inputs(k, rows, sk_t, mt, ck, mk)), DOT, UPCAST)
        dov = mm_inputs(do_i, tl.trans(_inputs(v, rows, sv_t, mt, cv, mv)), DOT, UPCAST)
        a = _exact_gated(a, qk, s, gc, g_i, start, ss_t, sc_t, cm, mm_, ti, n)
        dp = _exact_gated(dp, dov, s, gc, g_i, start, ss_t, sc_t, cm, mm_, ti, n)
    a, p = _softmax(a * scale, mm_)
    da = p * (dp - tl.sum(p * dp, axis=1)[:, None])
    dq_c = mm(da * e, tl.trans(load_hk(hk_buf, state, ck, cm, mk, mm_, K, M)), DOT, UPCAST)
    du = da * u
    for bj in range(0, n_pairs):
        rows_j = c0 + bj * BT + ti.to(tl.int64)
        mj = rows_j < c_end
        sd = _decayed_slots(s, gc, rows_j, ss_t, sc_t, mj, cm, mm_, ref)
        b = _lower(mm(du, tl.trans(sd), DOT, UPCAST), rows, rows_j)
        dq_c += mm(b, _inputs(k, rows_j, sk_t, mj, ck, mk), DOT, UPCAST)
    if steep:
        b = _exact_pairs(da, s, gc, g_i, start, ss_t, sc_t, cm, mm_, ti, n, BT)
        dq_c += mm(b, _inputs(k, rows, sk_t, mt, ck, mk), DOT, UPCAST)
    _store(dq, rows, sdq_t, mt, ck, mk, dq_c * scale)
    _store(p_buf + w_off, rows, sw_t, mt, cm, mm_, p)
    _store(da_buf + w_off, rows, sw_t, mt, cm, mm_, da)
    _store(r_buf + w_off, rows, sw_t, mt, cm, mm_, tl.where(mm_[None, :], a, 0.0) * da + p * dp)


@triton.jit
def bwd_b_kernel(
    q, k, v, s, gc, do, p_buf, da_buf, r_buf, dhk_buf, dhv_buf, dk, dv, ds, dgl_buf, tot_buf,
    steep_buf, cu, sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, ss_b, ss_t, ss_h,
    sc_b, sc_t, sc_h, sdo_b, sdo_t, sdo_h, sw_b, sw_t, sw_h, sdk_b, sdk_t, sdk_h,
    sdv_b, sdv_t, sdv_h, sds_b, sds_t, sds_h, scale, T, HQ, GROUP: tl.constexpr, K, V, M, NT,
    BK: tl.constexpr, BV: tl.constexpr, BM: tl.constexpr, BT: tl.constexpr, S: tl.constexpr,
    VARLEN: tl.constexpr, DOT: tl.constexpr, UPCAST: tl.constexpr, EXACT: tl.constexpr,
):
    """Sweep B per (chunk, sequence x query head), its blocks j in reverse: dk, dv, ds from the
    chunk-end state gradients and the block pairs (rows j, columns i of the same or a later block
    of the chunk, through the cumsum ref at block j's last token); dg within the chunk (fp32;
    dg_kernel adds what later chunks contribute, from each chunk's total stored here).
    Launched twice. EXACT=False has no decay-column code (inline, it cost bwd_b a third of its
    time on the H100 through register pressure, steep blocks or not): it leaves out the diagonal
    of a steep block, so that chunk's outputs are wrong, and stores each chunk's count of steep
    blocks. EXACT=True then redoes exactly the chunks with a count > 0, overwriting all their
    outputs, and returns at once for the others."""
    c, pid = tl.program_id(0), tl.program_id(1).to(tl.int64)
    i_n, i_hq = pid // HQ, pid % HQ
    i_h = i_hq // GROUP
    i_b, eos, c0, c_end, slot = _chunk_span(cu, i_n, c, T, S, NT, VARLEN)
    ck, cv, cm, ti = tl.arange(0, BK), tl.arange(0, BV), tl.arange(0, BM), tl.arange(0, BT)
    mk, mv, mm_ = ck < K, cv < V, cm < M
    state = slot * HQ + i_hq
    if EXACT:
        if tl.load(steep_buf + state) == 0:
            return
    q += i_b * sq_b + i_hq * sq_h
    k += i_b * sk_b + i_h * sk_h
    v += i_b * sv_b + i_h * sv_h
    s += i_b * ss_b + i_h * ss_h
    gc += i_b * sc_b + i_h * sc_h
    do += i_b * sdo_b + i_hq * sdo_h
    w_off = i_b * sw_b + i_hq * sw_h
    p_buf += w_off
    da_buf += w_off
    # Gradient outputs have one head per query head (summed over a group on the host).
    dk += i_b * sdk_b + i_hq * sdk_h
    dv += i_b * sdv_b + i_hq * sdv_h
    ds += i_b * sds_b + i_hq * sds_h
    g_last = _ref_row(gc, c_end - 1, sc_t, cm, mm_, c0, c_end)
    dg_run = tl.zeros([BM], dtype=tl.float32)
    n_steep = 0
    n_blocks = tl.cdiv(c_end - c0, BT)
    for i in range(0, n_blocks):
        bj = n_blocks - 1 - i
        start = c0 + bj * BT
        rows = start + ti.to(tl.int64)
        mt = rows < c_end
        g_j = _tile(gc, rows, sc_t, mt, cm, mm_)
        s_j = _tile(s, rows, ss_t, mt, cm, mm_)
        k_j = _inputs(k, rows, sk_t, mt, ck, mk)
        v_j = _inputs(v, rows, sv_t, mt, cv, mv)
        # Tokens after the chunk, through the chunk-end state gradients.
        to_end = _decay(g_last[None, :] - g_j, mt)
        dhk = load_hk(dhk_buf, state, ck, cm, mk, mm_, K, M)
        dhv = load_hv(dhv_buf, state, cv, cm, mv, mm_, V, M)
        dk_c = mm(s_j * to_end, tl.trans(dhk), DOT, UPCAST)
        dv_c = mm(s_j * to_end, dhv, DOT, UPCAST)
        ds_c = to_end * (mm(k_j, dhk, DOT, UPCAST) + mm(v_j, tl.trans(dhv), DOT, UPCAST))
        # Block pairs: products rows j x columns i, masked to i >= j.
        ref = _row(gc, tl.minimum(start + BT, c_end) - 1, sc_t, cm, mm_)
        w_j = _decay(ref[None, :] - g_j, mt)
        sw = s_j * w_j
        steep = _steep(g_j, ref, mt)
        n_steep += steep.to(tl.int32)
        dk_pairs = tl.zeros([BT, BK], dtype=tl.float32)
        dv_pairs = tl.zeros([BT, BV], dtype=tl.float32)
        ds_pairs = tl.zeros([BT, BM], dtype=tl.float32)
        for bi in range(bj + steep.to(tl.int32), n_blocks):
            rows_i = c0 + bi * BT + ti.to(tl.int64)
            mi = rows_i < c_end
            u = _decay(_tile(gc, rows_i, sc_t, mi, cm, mm_) - ref[None, :], mi)
            dau = _tile(da_buf, rows_i, sw_t, mi, cm, mm_) * u
            pu = _tile(p_buf, rows_i, sw_t, mi, cm, mm_) * u
            q_i = _inputs(q, rows_i, sq_t, mi, ck, mk)
            do_i = _inputs(do, rows_i, sdo_t, mi, cv, mv)
            b = _upper(mm(sw, tl.trans(dau), DOT, UPCAST), rows, rows_i)
            attn = _upper(mm(sw, tl.trans(pu), DOT, UPCAST), rows, rows_i)
            dk_pairs += mm(b, q_i, DOT, UPCAST)
            dv_pairs += mm(attn, do_i, DOT, UPCAST)
            kq = _upper(mm_inputs(k_j, tl.trans(q_i), DOT, UPCAST), rows, rows_i) * scale
            vdo = _upper(mm_inputs(v_j, tl.trans(do_i), DOT, UPCAST), rows, rows_i)
            ds_pairs += mm(kq, dau, DOT, UPCAST) + mm(vdo, pu, DOT, UPCAST)
        dk_c += dk_pairs * scale
        dv_c += dv_pairs
        ds_c += w_j * ds_pairs
        if EXACT:  # the diagonal block of a steep block, one decay column at a time
            if steep:
                n = tl.minimum(c_end - start, BT)
                q_j = _inputs(q, rows, sq_t, mt, ck, mk)
                do_j = _inputs(do, rows, sdo_t, mt, cv, mv)
                p = _tile(p_buf, rows, sw_t, mt, cm, mm_)
                da = _tile(da_buf, rows, sw_t, mt, cm, mm_)
                b = _exact_pairs(da, s, gc, g_j, start, ss_t, sc_t, cm, mm_, ti, n, BT)
                attn = _exact_pairs(p, s, gc, g_j, start, ss_t, sc_t, cm, mm_, ti, n, BT)
                dk_c += mm(tl.trans(b), q_j, DOT, UPCAST) * scale
                dv_c += mm(tl.trans(attn), do_j, DOT, UPCAST)
                qk = mm_inputs(q_j, tl.trans(k_j), DOT, UPCAST) * scale
                dov = mm_inputs(do_j, tl.trans(v_j), DOT, UPCAST)
                ds_c = _exact_ds(ds_c, qk, da, dov, p, gc, g_j, start, sc_t, cm, mm_, ti, n)
        x = _tile(r_buf + w_off, rows, sw_t, mt, cm, mm_) - s_j * ds_c  # dL/dG per token
        total = tl.sum(x, axis=0)
        dg_c = dg_run[None, :] + total[None, :] - tl.cumsum(x, axis=0) + x
        dg_run += total
        _store(dk, rows, sdk_t, mt, ck, mk, dk_c)
        _store(dv, rows, sdv_t, mt, cv, mv, dv_c)
        _store(ds, rows, sds_t, mt, cm, mm_, ds_c)
        _store(dgl_buf + w_off, rows, sw_t, mt, cm, mm_, dg_c)
    tl.store(tot_buf + state * M + cm, dg_run, mask=mm_ & (cm * 0 + c0 < eos))
    if not EXACT:
        tl.store(steep_buf + state, n_steep, mask=c0 < eos)


@triton.jit
def dg_kernel(
    dgl_buf, tot_buf, f_buf, dg, cu, sw_b, sw_t, sw_h, sdg_b, sdg_t, sdg_h, T, HQ,
    GROUP: tl.constexpr, M, NT, BM: tl.constexpr, S: tl.constexpr, HAS_DHT: tl.constexpr,
    VARLEN: tl.constexpr,
):
    """dg = the in-chunk reverse sum + the totals of every later chunk of the sequence + the
    final-state term (once per key/value head)."""
    c, pid = tl.program_id(0), tl.program_id(1).to(tl.int64)
    i_n, i_hq = pid // HQ, pid % HQ
    i_b, bos, eos = sequence_bounds(cu, i_n, T, VARLEN)
    cm = tl.arange(0, BM)
    mm_ = cm < M
    c0 = bos + c * S
    offset = tl.zeros([BM], dtype=tl.float32)
    if HAS_DHT:
        if i_hq % GROUP == 0:
            offset += tl.load(f_buf + (i_n * (HQ // GROUP) + i_hq // GROUP) * M + cm, mask=mm_,
                              other=0.0)
    for later in range(c + 1, tl.cdiv(eos - bos, S)):
        slot = chunk_slot(i_n, bos, later, S, NT, VARLEN) * HQ + i_hq
        offset += tl.load(tot_buf + slot * M + cm, mask=mm_, other=0.0)
    rows = c0 + tl.arange(0, S).to(tl.int64)
    mt = rows < eos
    local = _tile(dgl_buf + i_b * sw_b + i_hq * sw_h, rows, sw_t, mt, cm, mm_)
    _store(dg + i_b * sdg_b + i_hq * sdg_h, rows, sdg_t, mt, cm, mm_, local + offset[None, :])


KERNELS = {"states": states_kernel, "dstates": dstates_kernel, "fwd": fwd_kernel,
           "bwd_a": bwd_a_kernel, "bwd_b": bwd_b_kernel, "dg": dg_kernel}
