"""Recurrent gated slot attention kernels (mode="recurrent"): one program per (sequence, query
head) walks the tokens one by one with both states [K, M] and [M, V] in registers. For decoding
(T = 1) and short sequences.

Forward: the recurrence of ``fusetune.reference.gsa``. Backward, in two sweeps (see ``gsa`` for
the math):
  A (forward in time): recompute the states; dp = do @ Hv^T, da = softmax'(dp), dq = da @ Hk^T;
    keep p, da and r = a*da + p*dp (fp32) for sweep B, and the final-state term of dg.
  B (backward in time): carry dHk and dHv; dk, dv, ds, and dg as a reverse running sum.
All three kernels share one argument order with the chunked ones (``gsa_chunk.py``).
"""

from __future__ import annotations

from fusetune._triton import tl, triton
from fusetune.ops.linear_attention._common import (
    load_gate,
    load_hk,
    load_hv,
    sequence_bounds,
    store_states,
)

# A program keeps both states in registers: from 16384 elements each (K*M, e.g. 256 x 64 or
# 128 x 128) 4 warps spill (ptxas: 700-2900 B of stack per thread); and with K = V = 256, Triton
# 3.6's LLVM aborts compiling the forward and sweep A at 4 warps (an SLPVectorizer assertion, at
# M = 16, 32 and 64; fine at 8 warps, and at 4 on Triton 3.9).
LARGE_STATE = 16384


def constants(blocks: dict[str, int]) -> dict:
    """Launch constants for the head sizes' blocks (BK, BV, BM)."""
    wide = max(blocks["BK"], blocks["BV"]) * blocks["BM"] >= LARGE_STATE
    wide = wide or min(blocks["BK"], blocks["BV"]) >= 256
    return dict(num_warps=8 if wide else 4, BT=1)  # BT: in the shared signature


@triton.jit
def _token(q, k, v, s, t, sq_t, sk_t, sv_t, ss_t, ck, cv, cm, mk, mv, mm_, scale):
    """Token ``t``'s q (times scale), k, v and s as fp32, 0 outside the masks."""
    q_t = tl.load(q + t * sq_t + ck, mask=mk, other=0.0).to(tl.float32) * scale
    k_t = tl.load(k + t * sk_t + ck, mask=mk, other=0.0).to(tl.float32)
    v_t = tl.load(v + t * sv_t + cv, mask=mv, other=0.0).to(tl.float32)
    s_t = tl.load(s + t * ss_t + cm, mask=mm_, other=0.0).to(tl.float32)
    return q_t, k_t, v_t, s_t


@triton.jit
def _step(hk, hv, q_t, k_t, v_t, s_t, decay, mm_):
    """One token of both passes: the new states, the slot scores a (-inf on padded slots) and
    p = softmax(a)."""
    hk = hk * decay[None, :] + k_t[:, None] * s_t[None, :]
    a = tl.where(mm_, tl.sum(q_t[:, None] * hk, axis=0), float("-inf"))
    p = tl.exp(a - tl.max(a, axis=0))
    p = p / tl.sum(p, axis=0)
    hv = hv * decay[:, None] + s_t[:, None] * v_t[None, :]
    return hk, hv, a, p


@triton.jit
def fwd_kernel(
    q, k, v, s, g, o, hk0, hv0, hkT, hvT, cu,
    sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, ss_b, ss_t, ss_h, sg_b, sg_t, sg_h,
    so_b, so_t, so_h, scale, T, HQ, GROUP: tl.constexpr, K, V, M,
    BK: tl.constexpr, BV: tl.constexpr, BM: tl.constexpr, HAS_H0: tl.constexpr,
    STORE_HT: tl.constexpr, VARLEN: tl.constexpr, DOT: tl.constexpr, UPCAST: tl.constexpr,
    BT: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    i_n, i_hq = pid // HQ, pid % HQ
    i_h = i_hq // GROUP
    i_b, bos, eos = sequence_bounds(cu, i_n, T, VARLEN)
    ck, cv, cm = tl.arange(0, BK), tl.arange(0, BV), tl.arange(0, BM)
    mk, mv, mm_ = ck < K, cv < V, cm < M
    q += i_b * sq_b + i_hq * sq_h
    k += i_b * sk_b + i_h * sk_h
    v += i_b * sv_b + i_h * sv_h
    s += i_b * ss_b + i_h * ss_h
    g += i_b * sg_b + i_h * sg_h
    o += i_b * so_b + i_hq * so_h
    state = i_n * (HQ // GROUP) + i_h
    hk = tl.zeros([BK, BM], dtype=tl.float32)
    hv = tl.zeros([BM, BV], dtype=tl.float32)
    if HAS_H0:
        hk += load_hk(hk0, state, ck, cm, mk, mm_, K, M)
        hv += load_hv(hv0, state, cv, cm, mv, mm_, V, M)
    for t in range(bos, eos):
        q_t, k_t, v_t, s_t = _token(q, k, v, s, t, sq_t, sk_t, sv_t, ss_t, ck, cv, cm, mk, mv, mm_,
                                    scale)
        decay = tl.exp(load_gate(g + t * sg_t + cm, mm_))
        hk, hv, a, p = _step(hk, hv, q_t, k_t, v_t, s_t, decay, mm_)
        o_t = tl.sum(p[:, None] * hv, axis=0)
        tl.store(o + t * so_t + cv, o_t.to(o.dtype.element_ty), mask=mv)
    if STORE_HT:
        if i_hq % GROUP == 0:  # one query head of a group writes the shared state
            store_states(hkT, hvT, state, hk, hv, ck, cv, cm, mk, mv, mm_, K, V, M)


@triton.jit
def bwd_a_kernel(
    q, k, v, s, g, do, dq, p_buf, da_buf, r_buf, f_buf, hk0, hv0, dhkT, dhvT, cu,
    sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, ss_b, ss_t, ss_h, sg_b, sg_t, sg_h,
    sdo_b, sdo_t, sdo_h, sdq_b, sdq_t, sdq_h, sw_b, sw_t, sw_h, scale, T, HQ,
    GROUP: tl.constexpr, K, V, M, BK: tl.constexpr, BV: tl.constexpr, BM: tl.constexpr,
    HAS_H0: tl.constexpr, HAS_DHT: tl.constexpr, VARLEN: tl.constexpr, DOT: tl.constexpr,
    UPCAST: tl.constexpr, BT: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    i_n, i_hq = pid // HQ, pid % HQ
    i_h = i_hq // GROUP
    i_b, bos, eos = sequence_bounds(cu, i_n, T, VARLEN)
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
    state = i_n * (HQ // GROUP) + i_h
    hk = tl.zeros([BK, BM], dtype=tl.float32)
    hv = tl.zeros([BM, BV], dtype=tl.float32)
    if HAS_H0:
        hk += load_hk(hk0, state, ck, cm, mk, mm_, K, M)
        hv += load_hv(hv0, state, cv, cm, mv, mm_, V, M)
    for t in range(bos, eos):
        q_t, k_t, v_t, s_t = _token(q, k, v, s, t, sq_t, sk_t, sv_t, ss_t, ck, cv, cm, mk, mv, mm_,
                                    scale)
        do_t = tl.load(do + t * sdo_t + cv, mask=mv, other=0.0).to(tl.float32)
        decay = tl.exp(load_gate(g + t * sg_t + cm, mm_))
        hk, hv, a, p = _step(hk, hv, q_t, k_t, v_t, s_t, decay, mm_)
        dp = tl.sum(hv * do_t[None, :], axis=1)
        da = p * (dp - tl.sum(p * dp, axis=0))
        dq_t = tl.sum(hk * da[None, :], axis=1) * scale
        r = tl.where(mm_, a * da + p * dp, 0.0)
        tl.store(dq + t * sdq_t + ck, dq_t.to(dq.dtype.element_ty), mask=mk)
        tl.store(p_buf + t * sw_t + cm, p, mask=mm_)
        tl.store(da_buf + t * sw_t + cm, da, mask=mm_)
        tl.store(r_buf + t * sw_t + cm, r, mask=mm_)
    final = tl.zeros([BM], dtype=tl.float32)
    if HAS_DHT:
        if i_hq % GROUP == 0:  # the final-state gradient counts once per key/value head
            final = (tl.sum(load_hk(dhkT, state, ck, cm, mk, mm_, K, M) * hk, axis=0)
                     + tl.sum(load_hv(dhvT, state, cv, cm, mv, mm_, V, M) * hv, axis=1))
    tl.store(f_buf + pid * M + cm, final, mask=mm_)


@triton.jit
def bwd_b_kernel(
    q, k, v, s, g, do, p_buf, da_buf, r_buf, f_buf, dhkT, dhvT, dk, dv, ds, dg, dhk0, dhv0, cu,
    sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, ss_b, ss_t, ss_h, sg_b, sg_t, sg_h,
    sdo_b, sdo_t, sdo_h, sw_b, sw_t, sw_h, sdk_b, sdk_t, sdk_h, sdv_b, sdv_t, sdv_h,
    sds_b, sds_t, sds_h, sdg_b, sdg_t, sdg_h, scale, T, HQ, GROUP: tl.constexpr, K, V, M,
    BK: tl.constexpr, BV: tl.constexpr, BM: tl.constexpr, HAS_DHT: tl.constexpr,
    VARLEN: tl.constexpr, DOT: tl.constexpr, UPCAST: tl.constexpr, BT: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    i_n, i_hq = pid // HQ, pid % HQ
    i_h = i_hq // GROUP
    i_b, bos, eos = sequence_bounds(cu, i_n, T, VARLEN)
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
    # Gradient outputs have one head per query head (summed over a group on the host).
    dk += i_b * sdk_b + i_hq * sdk_h
    dv += i_b * sdv_b + i_hq * sdv_h
    ds += i_b * sds_b + i_hq * sds_h
    dg += i_b * sdg_b + i_hq * sdg_h
    state = i_n * (HQ // GROUP) + i_h
    dhk = tl.zeros([BK, BM], dtype=tl.float32)
    dhv = tl.zeros([BM, BV], dtype=tl.float32)
    if HAS_DHT:
        if i_hq % GROUP == 0:
            dhk += load_hk(dhkT, state, ck, cm, mk, mm_, K, M)
            dhv += load_hv(dhvT, state, cv, cm, mv, mm_, V, M)
    dg_run = tl.load(f_buf + pid * M + cm, mask=mm_, other=0.0)
    for i in range(0, eos - bos):
        t = eos - 1 - i
        q_t, k_t, v_t, s_t = _token(q, k, v, s, t, sq_t, sk_t, sv_t, ss_t, ck, cv, cm, mk, mv, mm_,
                                    scale)
        do_t = tl.load(do + t * sdo_t + cv, mask=mv, other=0.0).to(tl.float32)
        p = tl.load(p_buf + t * sw_t + cm, mask=mm_, other=0.0)
        da = tl.load(da_buf + t * sw_t + cm, mask=mm_, other=0.0)
        r = tl.load(r_buf + t * sw_t + cm, mask=mm_, other=0.0)
        decay = tl.exp(load_gate(g + t * sg_t + cm, mm_))
        dhk += q_t[:, None] * da[None, :]  # dHk_t: the gradient w.r.t. the state after step t
        dhv += p[:, None] * do_t[None, :]
        dk_t = tl.sum(dhk * s_t[None, :], axis=1)
        dv_t = tl.sum(s_t[:, None] * dhv, axis=0)
        ds_t = tl.sum(k_t[:, None] * dhk, axis=0) + tl.sum(dhv * v_t[None, :], axis=1)
        dg_run += r - s_t * ds_t
        tl.store(dk + t * sdk_t + ck, dk_t.to(dk.dtype.element_ty), mask=mk)
        tl.store(dv + t * sdv_t + cv, dv_t.to(dv.dtype.element_ty), mask=mv)
        tl.store(ds + t * sds_t + cm, ds_t.to(ds.dtype.element_ty), mask=mm_)
        tl.store(dg + t * sdg_t + cm, dg_run.to(dg.dtype.element_ty), mask=mm_)
        dhk = dhk * decay[None, :]
        dhv = dhv * decay[:, None]
    store_states(dhk0, dhv0, pid, dhk, dhv, ck, cv, cm, mk, mv, mm_, K, V, M)
