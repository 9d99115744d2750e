"""Chunked GSA kernels. ``states_kernel`` walks each sequence in chunks of S = 64 tokens and
stores every chunk's starting states [K, M] and [M, V] (fp32; recomputed in backward, never kept
from the forward); then one program per (chunk, query head) walks its chunk in sub-chunks of
BT = 16 tokens with both states in registers. Inside a sub-chunk everything is
matmuls plus one exact decay tensor W[i, j, m] = exp(G_i - G_j) (i >= j, else 0; G the
chunk-local cumsum of the gates, fp32): every factor is <= 1, so no gate however negative can
overflow, unlike factorising exp(G_i) * exp(-G_j). Across chunks the carried states move with
exp(G_last - G_j) <= 1 too.

Per chunk (scale folded into the fp32 products; e = exp(G), rows i, j in the chunk):
    a  = e * (q @ Hk) + sum_j (q_i . k_j) s_j W[i, j]          p = softmax(a)
    o  = (p e) @ Hv + A @ v,   A[i, j] = sum_m p_i s_j W[i, j]
    Hk = Hk * exp(G_last) + k^T (s exp(G_last - G));  Hv likewise with s^T v.
Sweep A adds dp = e * (do @ Hv^T) + sum_j (do_i . v_j) s_j W[i, j], da = softmax'(dp) and
dq = (da e) @ Hk^T + B @ k, B[i, j] = sum_m da_i s_j W[i, j]. Sweep B runs the chunks in reverse
with the state gradients dHk, dHv (see ``api`` for the math).
"""

from __future__ import annotations

from fusetune._triton import tl, triton
from fusetune.gsa._common import load_gate, mm, mm_inputs, sequence_bounds

SUB_CHUNK = 16  # BT: tokens per step inside a program; W is BT x BT x M fp32 in registers
# S: tokens per program of the parallel kernels; one pair of fp32 states is kept per S tokens
# (recomputed in backward). Smaller under the interpreter so tests cross chunk boundaries.
STATE_CHUNK, STATE_CHUNK_INTERPRETED = 64, 32


def constants(seq_len: int, interpreting: bool) -> dict:
    return dict(BT=SUB_CHUNK, S=STATE_CHUNK_INTERPRETED if interpreting else STATE_CHUNK,
                num_warps=8)


@triton.jit
def _tile(ptr, rows, stride_t, row_mask, cols, col_mask):
    """A [rows, cols] tile as fp32, 0 outside the masks."""
    mask = row_mask[:, None] & col_mask[None, :]
    return tl.load(ptr + rows[:, None] * stride_t + cols[None, :], mask=mask, other=0.0).to(
        tl.float32)


@triton.jit
def _store(ptr, rows, stride_t, row_mask, cols, col_mask, value):
    mask = row_mask[:, None] & col_mask[None, :]
    tl.store(ptr + rows[:, None] * stride_t + cols[None, :], value.to(ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def _gate_cumsum(g, rows, stride_t, row_mask, cm, mm_):
    """Chunk-local cumsum G [rows, BM] (rows past the end repeat the last value) and G_last."""
    gate = load_gate(g + rows[:, None] * stride_t + cm[None, :], row_mask[:, None] & mm_[None, :])
    return tl.cumsum(gate, axis=0), tl.sum(gate, axis=0)


@triton.jit
def _chunk_gates(g, rows, stride_t, row_mask, cm, mm_, BT: tl.constexpr):
    """G and G_last (see _gate_cumsum) and W[i, j, m] = exp(G_i - G_j) for i >= j, else 0."""
    cum, last = _gate_cumsum(g, rows, stride_t, row_mask, cm, mm_)
    ti = tl.arange(0, BT)
    causal = (ti[:, None] >= ti[None, :])[:, :, None]
    w = tl.exp(tl.where(causal, cum[:, None, :] - cum[None, :, :], float("-inf")))
    return cum, last, w


@triton.jit
def _scores(q_c, k_c, s_c, w, hk, e, scale, mm_, DOT: tl.constexpr, UPCAST: tl.constexpr):
    """Slot scores a [BT, BM] (-inf on padded slots), their softmax p, and q k^T * scale."""
    qk = mm_inputs(q_c, tl.trans(k_c), DOT, UPCAST) * scale
    a = e * mm(q_c, hk, DOT, UPCAST) * scale + tl.sum(qk[:, :, None] * s_c[None, :, :] * w, axis=1)
    a = tl.where(mm_[None, :], a, float("-inf"))
    p = tl.exp(a - tl.max(a, axis=1)[:, None])
    p = p / tl.sum(p, axis=1)[:, None]
    return a, p, qk


@triton.jit
def _advance(hk, hv, k_c, v_c, s_c, cum, last, DOT: tl.constexpr, UPCAST: tl.constexpr):
    """Both states carried over one chunk."""
    sd = s_c * tl.exp(last[None, :] - cum)
    decay = tl.exp(last)
    hk = hk * decay[None, :] + mm(tl.trans(k_c), sd, DOT, UPCAST)
    hv = hv * decay[:, None] + mm(tl.trans(sd), v_c, DOT, UPCAST)
    return hk, hv


@triton.jit
def _slot(i_n, c, bos, S: tl.constexpr, NT, VARLEN: tl.constexpr):
    """Index of chunk ``c`` of sequence ``i_n`` in the per-chunk buffers. Packed sequences never
    overlap: sequence n owns [bos // S + n, ...) and needs at most cdiv(length, S) slots."""
    if VARLEN:
        return bos // S + i_n + c
    else:
        return i_n * NT + c


@triton.jit
def _chunk_span(cu, i_n, c, T, S: tl.constexpr, NT, VARLEN: tl.constexpr):
    """(batch index, sequence end, chunk start, chunk end, slot). A program past the sequence's
    last chunk gets an empty range and slot 0 (read, never written)."""
    i_b, bos, eos = sequence_bounds(cu, i_n, T, VARLEN)
    c0 = bos + c * S
    c_end = tl.minimum(c0 + S, eos)
    slot = tl.where(c0 < eos, _slot(i_n, c, bos, S, NT, VARLEN), 0)
    return i_b, eos, c0, c_end, slot


@triton.jit
def states_kernel(
    k, v, s, g, hk0, hv0, hk_buf, hv_buf, hkT, hvT, dhkT, dhvT, f_buf, cu,
    sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, ss_b, ss_t, ss_h, sg_b, sg_t, sg_h,
    T, H, K, V, M, NT, BK: tl.constexpr, BV: tl.constexpr, BM: tl.constexpr, S: tl.constexpr,
    HAS_H0: tl.constexpr, STORE_HT: tl.constexpr, HAS_DHT: tl.constexpr, VARLEN: tl.constexpr,
    DOT: tl.constexpr, UPCAST: tl.constexpr,
):
    """Per (sequence, key/value head): walk the chunks of S tokens carrying both states and
    store each chunk's starting states (fp32); the final states; with HAS_DHT the final-state
    term of dg, sum_k dHk_T * Hk_T + sum_v dHv_T * Hv_T, per slot."""
    pid = tl.program_id(0).to(tl.int64)
    i_n, i_h = pid // H, pid % H
    i_b, bos, eos = sequence_bounds(cu, i_n, T, VARLEN)
    ck, cv, cm = tl.arange(0, BK), tl.arange(0, BV), tl.arange(0, BM)
    mk, mv, mm_ = ck < K, cv < V, cm < M
    k += i_b * sk_b + i_h * sk_h
    v += i_b * sv_b + i_h * sv_h
    s += i_b * ss_b + i_h * ss_h
    g += i_b * sg_b + i_h * sg_h
    pk = ck[:, None] * M + cm[None, :]
    pv = cm[:, None] * V + cv[None, :]
    mask_k, mask_v = mk[:, None] & mm_[None, :], mm_[:, None] & mv[None, :]
    hk = tl.zeros([BK, BM], dtype=tl.float32)
    hv = tl.zeros([BM, BV], dtype=tl.float32)
    if HAS_H0:
        hk += tl.load(hk0 + pid * K * M + pk, mask=mask_k, other=0.0).to(tl.float32)
        hv += tl.load(hv0 + pid * M * V + pv, mask=mask_v, other=0.0).to(tl.float32)
    for c in range(0, tl.cdiv(eos - bos, S)):
        slot = _slot(i_n, c, bos, S, NT, VARLEN) * H + i_h
        tl.store(hk_buf + slot * K * M + pk, hk, mask=mask_k)
        tl.store(hv_buf + slot * M * V + pv, hv, mask=mask_v)
        rows = bos + c * S + tl.arange(0, S).to(tl.int64)
        mt = rows < eos
        k_c = _tile(k, rows, sk_t, mt, ck, mk)
        v_c = _tile(v, rows, sv_t, mt, cv, mv)
        s_c = _tile(s, rows, ss_t, mt, cm, mm_)
        cum, last = _gate_cumsum(g, rows, sg_t, mt, cm, mm_)
        hk, hv = _advance(hk, hv, k_c, v_c, s_c, cum, last, DOT, UPCAST)
    if STORE_HT:
        tl.store(hkT + pid * K * M + pk, hk, mask=mask_k)
        tl.store(hvT + pid * M * V + pv, hv, mask=mask_v)
    if HAS_DHT:
        dhk = tl.load(dhkT + pid * K * M + pk, mask=mask_k, other=0.0).to(tl.float32)
        dhv = tl.load(dhvT + pid * M * V + pv, mask=mask_v, other=0.0).to(tl.float32)
        final = tl.sum(dhk * hk, axis=0) + tl.sum(dhv * hv, axis=1)
        tl.store(f_buf + pid * M + cm, final, mask=mm_)


@triton.jit
def fwd_kernel(
    q, k, v, s, g, o, hk_buf, hv_buf, cu,
    sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, ss_b, ss_t, ss_h, sg_b, sg_t, sg_h,
    so_b, so_t, so_h, scale, T, HQ, GROUP: tl.constexpr, K, V, M, NT,
    BK: tl.constexpr, BV: tl.constexpr, BM: tl.constexpr, BT: tl.constexpr, S: tl.constexpr,
    VARLEN: tl.constexpr, DOT: tl.constexpr, UPCAST: tl.constexpr,
):
    """One program per (chunk of S tokens, sequence x query head), from the stored states."""
    c, pid = tl.program_id(0), tl.program_id(1).to(tl.int64)
    i_n, i_hq = pid // HQ, pid % HQ
    i_h = i_hq // GROUP
    i_b, eos, c0, c_end, slot = _chunk_span(cu, i_n, c, T, S, NT, VARLEN)
    ck, cv, cm = tl.arange(0, BK), tl.arange(0, BV), tl.arange(0, BM)
    mk, mv, mm_ = ck < K, cv < V, cm < M
    q += i_b * sq_b + i_hq * sq_h
    k += i_b * sk_b + i_h * sk_h
    v += i_b * sv_b + i_h * sv_h
    s += i_b * ss_b + i_h * ss_h
    g += i_b * sg_b + i_h * sg_h
    o += i_b * so_b + i_hq * so_h
    state = slot * (HQ // GROUP) + i_h
    hk = tl.load(hk_buf + state * K * M + ck[:, None] * M + cm[None, :],
                 mask=mk[:, None] & mm_[None, :], other=0.0)
    hv = tl.load(hv_buf + state * M * V + cm[:, None] * V + cv[None, :],
                 mask=mm_[:, None] & mv[None, :], other=0.0)
    for start in range(c0, c_end, BT):
        rows = start + tl.arange(0, BT).to(tl.int64)
        mt = rows < c_end
        q_c = _tile(q, rows, sq_t, mt, ck, mk)
        k_c = _tile(k, rows, sk_t, mt, ck, mk)
        v_c = _tile(v, rows, sv_t, mt, cv, mv)
        s_c = _tile(s, rows, ss_t, mt, cm, mm_)
        cum, last, w = _chunk_gates(g, rows, sg_t, mt, cm, mm_, BT)
        e = tl.exp(cum)
        a, p, qk = _scores(q_c, k_c, s_c, w, hk, e, scale, mm_, DOT, UPCAST)
        attn = tl.sum(p[:, None, :] * s_c[None, :, :] * w, axis=2)
        o_c = mm(p * e, hv, DOT, UPCAST) + mm(attn, v_c, DOT, UPCAST)
        _store(o, rows, so_t, mt, cv, mv, o_c)
        hk, hv = _advance(hk, hv, k_c, v_c, s_c, cum, last, DOT, UPCAST)


@triton.jit
def bwd_a_kernel(
    q, k, v, s, g, do, dq, p_buf, da_buf, r_buf, hk_buf, hv_buf, cu,
    sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, ss_b, ss_t, ss_h, sg_b, sg_t, sg_h,
    sdo_b, sdo_t, sdo_h, sdq_b, sdq_t, sdq_h, sw_b, sw_t, sw_h, scale, T, HQ,
    GROUP: tl.constexpr, K, V, M, NT, BK: tl.constexpr, BV: tl.constexpr, BM: tl.constexpr,
    BT: tl.constexpr, S: tl.constexpr, VARLEN: tl.constexpr, DOT: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Sweep A per (chunk, sequence x query head): dq, and p, da, r = a*da + p*dp (fp32)."""
    c, pid = tl.program_id(0), tl.program_id(1).to(tl.int64)
    i_n, i_hq = pid // HQ, pid % HQ
    i_h = i_hq // GROUP
    i_b, eos, c0, c_end, slot = _chunk_span(cu, i_n, c, T, S, NT, VARLEN)
    ck, cv, cm = tl.arange(0, BK), tl.arange(0, BV), tl.arange(0, BM)
    mk, mv, mm_ = ck < K, cv < V, cm < M
    q += i_b * sq_b + i_hq * sq_h
    k += i_b * sk_b + i_h * sk_h
    v += i_b * sv_b + i_h * sv_h
    s += i_b * ss_b + i_h * ss_h
    g += i_b * sg_b + i_h * sg_h
    do += i_b * sdo_b + i_hq * sdo_h
    dq += i_b * sdq_b + i_hq * sdq_h
    w_off = i_b * sw_b + i_hq * sw_h
    p_buf += w_off
    da_buf += w_off
    r_buf += w_off
    state = slot * (HQ // GROUP) + i_h
    hk = tl.load(hk_buf + state * K * M + ck[:, None] * M + cm[None, :],
                 mask=mk[:, None] & mm_[None, :], other=0.0)
    hv = tl.load(hv_buf + state * M * V + cm[:, None] * V + cv[None, :],
                 mask=mm_[:, None] & mv[None, :], other=0.0)
    for start in range(c0, c_end, BT):
        rows = start + tl.arange(0, BT).to(tl.int64)
        mt = rows < c_end
        q_c = _tile(q, rows, sq_t, mt, ck, mk)
        k_c = _tile(k, rows, sk_t, mt, ck, mk)
        v_c = _tile(v, rows, sv_t, mt, cv, mv)
        s_c = _tile(s, rows, ss_t, mt, cm, mm_)
        do_c = _tile(do, rows, sdo_t, mt, cv, mv)
        cum, last, w = _chunk_gates(g, rows, sg_t, mt, cm, mm_, BT)
        e = tl.exp(cum)
        a, p, qk = _scores(q_c, k_c, s_c, w, hk, e, scale, mm_, DOT, UPCAST)
        dov = mm_inputs(do_c, tl.trans(v_c), DOT, UPCAST)
        dp = e * mm(do_c, tl.trans(hv), DOT, UPCAST) + tl.sum(
            dov[:, :, None] * s_c[None, :, :] * w, axis=1)
        da = p * (dp - tl.sum(p * dp, axis=1)[:, None])
        b = tl.sum(da[:, None, :] * s_c[None, :, :] * w, axis=2)
        dq_c = (mm(da * e, tl.trans(hk), DOT, UPCAST) + mm(b, k_c, DOT, UPCAST)) * scale
        r = tl.where(mm_[None, :], a * da + p * dp, 0.0)
        _store(dq, rows, sdq_t, mt, ck, mk, dq_c)
        _store(p_buf, rows, sw_t, mt, cm, mm_, p)
        _store(da_buf, rows, sw_t, mt, cm, mm_, da)
        _store(r_buf, rows, sw_t, mt, cm, mm_, r)
        hk, hv = _advance(hk, hv, k_c, v_c, s_c, cum, last, DOT, UPCAST)


@triton.jit
def dstates_kernel(
    q, g, do, p_buf, da_buf, dhkT, dhvT, dhk_buf, dhv_buf, dhk0, dhv0, cu,
    sq_b, sq_t, sq_h, sg_b, sg_t, sg_h, sdo_b, sdo_t, sdo_h, sw_b, sw_t, sw_h, scale, T, HQ,
    GROUP: tl.constexpr, K, V, M, NT, BK: tl.constexpr, BV: tl.constexpr, BM: tl.constexpr,
    S: tl.constexpr, HAS_DHT: tl.constexpr, VARLEN: tl.constexpr, DOT: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Per (sequence, query head), chunks in reverse: store the gradients w.r.t. each chunk's
    end states that come from later tokens (and the final-state gradient), carried as
    dH = dH * exp(G_last) + q^T (da e) scale (resp. (p e)^T do); the rest is dh0."""
    pid = tl.program_id(0).to(tl.int64)
    i_n, i_hq = pid // HQ, pid % HQ
    i_h = i_hq // GROUP
    i_b, bos, eos = sequence_bounds(cu, i_n, T, VARLEN)
    ck, cv, cm = tl.arange(0, BK), tl.arange(0, BV), tl.arange(0, BM)
    mk, mv, mm_ = ck < K, cv < V, cm < M
    q += i_b * sq_b + i_hq * sq_h
    g += i_b * sg_b + i_h * sg_h
    do += i_b * sdo_b + i_hq * sdo_h
    w_off = i_b * sw_b + i_hq * sw_h
    p_buf += w_off
    da_buf += w_off
    pk = ck[:, None] * M + cm[None, :]
    pv = cm[:, None] * V + cv[None, :]
    mask_k, mask_v = mk[:, None] & mm_[None, :], mm_[:, None] & mv[None, :]
    dhk = tl.zeros([BK, BM], dtype=tl.float32)
    dhv = tl.zeros([BM, BV], dtype=tl.float32)
    if HAS_DHT:
        if i_hq % GROUP == 0:  # the final-state gradient counts once per key/value head
            state = i_n * (HQ // GROUP) + i_h
            dhk += tl.load(dhkT + state * K * M + pk, mask=mask_k, other=0.0).to(tl.float32)
            dhv += tl.load(dhvT + state * M * V + pv, mask=mask_v, other=0.0).to(tl.float32)
    n_chunks = tl.cdiv(eos - bos, S)
    for i in range(0, n_chunks):
        c = n_chunks - 1 - i
        slot = _slot(i_n, c, bos, S, NT, VARLEN) * HQ + i_hq
        tl.store(dhk_buf + slot * K * M + pk, dhk, mask=mask_k)
        tl.store(dhv_buf + slot * M * V + pv, dhv, mask=mask_v)
        rows = bos + c * S + tl.arange(0, S).to(tl.int64)
        mt = rows < eos
        q_c = _tile(q, rows, sq_t, mt, ck, mk)
        do_c = _tile(do, rows, sdo_t, mt, cv, mv)
        p = _tile(p_buf, rows, sw_t, mt, cm, mm_)
        da = _tile(da_buf, rows, sw_t, mt, cm, mm_)
        cum, last = _gate_cumsum(g, rows, sg_t, mt, cm, mm_)
        e = tl.exp(cum)
        decay = tl.exp(last)
        dhk = dhk * decay[None, :] + mm(tl.trans(q_c), da * e, DOT, UPCAST) * scale
        dhv = dhv * decay[:, None] + mm(tl.trans(p * e), do_c, DOT, UPCAST)
    tl.store(dhk0 + pid * K * M + pk, dhk, mask=mask_k)
    tl.store(dhv0 + pid * M * V + pv, dhv, mask=mask_v)


@triton.jit
def bwd_b_kernel(
    q, k, v, s, g, do, p_buf, da_buf, r_buf, dhk_buf, dhv_buf, dk, dv, ds, dgl_buf, tot_buf, cu,
    sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, ss_b, ss_t, ss_h, sg_b, sg_t, sg_h,
    sdo_b, sdo_t, sdo_h, sw_b, sw_t, sw_h, sdk_b, sdk_t, sdk_h, sdv_b, sdv_t, sdv_h,
    sds_b, sds_t, sds_h, scale, T, HQ, GROUP: tl.constexpr, K, V, M, NT,
    BK: tl.constexpr, BV: tl.constexpr, BM: tl.constexpr, BT: tl.constexpr, S: tl.constexpr,
    VARLEN: tl.constexpr, DOT: tl.constexpr, UPCAST: tl.constexpr,
):
    """Sweep B per (chunk, sequence x query head), sub-chunks in reverse from the chunk's end
    state gradients: dk, dv, ds, and dg within the chunk (fp32; dg_kernel adds what later
    chunks contribute, from each chunk's total stored here)."""
    c, pid = tl.program_id(0), tl.program_id(1).to(tl.int64)
    i_n, i_hq = pid // HQ, pid % HQ
    i_h = i_hq // GROUP
    i_b, eos, c0, c_end, slot = _chunk_span(cu, i_n, c, T, S, NT, VARLEN)
    ck, cv, cm = tl.arange(0, BK), tl.arange(0, BV), tl.arange(0, BM)
    mk, mv, mm_ = ck < K, cv < V, cm < M
    q += i_b * sq_b + i_hq * sq_h
    k += i_b * sk_b + i_h * sk_h
    v += i_b * sv_b + i_h * sv_h
    s += i_b * ss_b + i_h * ss_h
    g += i_b * sg_b + i_h * sg_h
    do += i_b * sdo_b + i_hq * sdo_h
    w_off = i_b * sw_b + i_hq * sw_h
    p_buf += w_off
    da_buf += w_off
    r_buf += w_off
    dgl_buf += w_off
    # Gradient outputs have one head per query head (summed over a group on the host).
    dk += i_b * sdk_b + i_hq * sdk_h
    dv += i_b * sdv_b + i_hq * sdv_h
    ds += i_b * sds_b + i_hq * sds_h
    state = slot * HQ + i_hq
    dhk = tl.load(dhk_buf + state * K * M + ck[:, None] * M + cm[None, :],
                  mask=mk[:, None] & mm_[None, :], other=0.0)
    dhv = tl.load(dhv_buf + state * M * V + cm[:, None] * V + cv[None, :],
                  mask=mm_[:, None] & mv[None, :], other=0.0)
    dg_run = tl.zeros([BM], dtype=tl.float32)
    n_sub = tl.cdiv(c_end - c0, BT)
    for i in range(0, n_sub):
        rows = c0 + (n_sub - 1 - i) * BT + tl.arange(0, BT).to(tl.int64)
        mt = rows < c_end
        q_c = _tile(q, rows, sq_t, mt, ck, mk)
        k_c = _tile(k, rows, sk_t, mt, ck, mk)
        v_c = _tile(v, rows, sv_t, mt, cv, mv)
        s_c = _tile(s, rows, ss_t, mt, cm, mm_)
        do_c = _tile(do, rows, sdo_t, mt, cv, mv)
        p = _tile(p_buf, rows, sw_t, mt, cm, mm_)
        da = _tile(da_buf, rows, sw_t, mt, cm, mm_)
        r = _tile(r_buf, rows, sw_t, mt, cm, mm_)
        cum, last, w = _chunk_gates(g, rows, sg_t, mt, cm, mm_, BT)
        e = tl.exp(cum)
        to_end = tl.exp(last[None, :] - cum)
        sd = s_c * to_end
        # Row i' (later token) x column i (earlier token) matrices of the sub-chunk.
        qk = mm_inputs(q_c, tl.trans(k_c), DOT, UPCAST) * scale
        dov = mm_inputs(do_c, tl.trans(v_c), DOT, UPCAST)
        b = tl.sum(da[:, None, :] * s_c[None, :, :] * w, axis=2)
        attn = tl.sum(p[:, None, :] * s_c[None, :, :] * w, axis=2)
        dk_c = mm(sd, tl.trans(dhk), DOT, UPCAST) + mm(tl.trans(b), q_c, DOT, UPCAST) * scale
        dv_c = mm(sd, dhv, DOT, UPCAST) + mm(tl.trans(attn), do_c, DOT, UPCAST)
        ds_c = to_end * (mm(k_c, dhk, DOT, UPCAST) + mm(v_c, tl.trans(dhv), DOT, UPCAST))
        ds_c += tl.sum(w * (qk[:, :, None] * da[:, None, :] + dov[:, :, None] * p[:, None, :]),
                       axis=0)
        x = r - s_c * ds_c  # dL/dG per token; dg is its reverse running sum
        total = tl.sum(x, axis=0)
        dg_c = dg_run[None, :] + total[None, :] - tl.cumsum(x, axis=0) + x
        dg_run += total
        _store(dk, rows, sdk_t, mt, ck, mk, dk_c)
        _store(dv, rows, sdv_t, mt, cv, mv, dv_c)
        _store(ds, rows, sds_t, mt, cm, mm_, ds_c)
        _store(dgl_buf, rows, sw_t, mt, cm, mm_, dg_c)
        decay = tl.exp(last)
        dhk = dhk * decay[None, :] + mm(tl.trans(q_c), da * e, DOT, UPCAST) * scale
        dhv = dhv * decay[:, None] + mm(tl.trans(p * e), do_c, DOT, UPCAST)
    tl.store(tot_buf + state * M + cm, dg_run, mask=mm_ & (cm * 0 + c0 < eos))


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
        slot = _slot(i_n, later, bos, S, NT, VARLEN) * HQ + i_hq
        offset += tl.load(tot_buf + slot * M + cm, mask=mm_, other=0.0)
    rows = c0 + tl.arange(0, S).to(tl.int64)
    mt = rows < eos
    local = _tile(dgl_buf + i_b * sw_b + i_hq * sw_h, rows, sw_t, mt, cm, mm_)
    _store(dg + i_b * sdg_b + i_hq * sdg_h, rows, sdg_t, mt, cm, mm_, local + offset[None, :])
