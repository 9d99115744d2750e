"""Recurrent gated delta rule kernels: one program per (sequence, value head, block of BV value
columns) walks the tokens one by one with its [K, BV] slice of the fp32 state in registers.
Columns of the state never mix (u = S^T k reads each column alone), so value blocks are
independent programs; only dq, dk, dbeta and dg sum over them (fp32 partials, summed on the host).

Forward: the recurrence of ``fusetune.reference.gated_delta_rule``. Backward, two sweeps
(math in ``gated_delta_rule.py``):
  1. forward in time: recompute S; keep e_t = v_t - S'^T k_t (fp32), dq_t = scale S_t do_t,
     and the state before every C-th token (checkpoints).
  2. backward in time: carry the state gradient L; at each token rebuild S'_t from its block's
     checkpoint (up to C - 1 steps), then dv, dk, dbeta, dg = <dS'_t, S'_t>, and dh0.
Internal fp32 buffers are contiguous, indexed by row r = (b * T + t) * HV + h.
"""

from __future__ import annotations

from fusetune._triton import tl, triton
from fusetune.ops.linear_attention._common import chunk_slot, sequence_bounds


def block_v(value_dim: int, key_dim: int, interpreting: bool) -> int:
    """Value columns per program: the whole head under the interpreter (fewer programs to run
    one after another); on the GPU 32 (16 for K > 128) keeps the state slice in registers."""
    from fusetune._utils import next_power_of_2

    full = next_power_of_2(value_dim)
    if interpreting:
        return min(full, MAX_BV_INTERPRET)
    return min(full, 32 if key_dim <= 128 else 16)


MAX_BV_INTERPRET = 64  # tests lower it to run several value blocks
# Tokens between state checkpoints of the backward: sweep 2 redoes (C - 1) / 2 steps a token.
CHECKPOINT_EVERY = 8


@triton.jit
def _program(cu, T, HV, GROUP: tl.constexpr, VARLEN: tl.constexpr):
    """(value block, sequence, value head, key head, batch row, first token, end token)."""
    i_v = tl.program_id(0)
    pid = tl.program_id(1).to(tl.int64)
    i_n, i_h = pid // HV, pid % HV
    i_b, bos, eos = sequence_bounds(cu, i_n, T, VARLEN)
    return i_v, i_n, i_h, i_h // GROUP, i_b, bos, eos


@triton.jit
def fwd_kernel(
    q, k, v, g, beta, o, h0, hT, cu,
    sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, sg_b, sg_t, sg_h, sb_b, sb_t, sb_h,
    so_b, so_t, so_h,
    scale, T, HV, GROUP: tl.constexpr, K, V, BK: tl.constexpr, BV: tl.constexpr,
    HAS_H0: tl.constexpr, STORE_HT: tl.constexpr, VARLEN: tl.constexpr,
):
    i_v, i_n, i_h, i_hk, i_b, bos, eos = _program(cu, T, HV, GROUP, VARLEN)
    ck, cv = tl.arange(0, BK), i_v * BV + tl.arange(0, BV)
    mk, mv = ck < K, cv < V
    q += i_b * sq_b + i_hk * sq_h
    k += i_b * sk_b + i_hk * sk_h
    v += i_b * sv_b + i_h * sv_h
    g += i_b * sg_b + i_h * sg_h
    beta += i_b * sb_b + i_h * sb_h
    o += i_b * so_b + i_h * so_h
    state_at = (i_n * HV + i_h) * K * V + ck[:, None] * V + cv[None, :]
    mkv = mk[:, None] & mv[None, :]
    S = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_H0:
        S += tl.load(h0 + state_at, mask=mkv, other=0.0).to(tl.float32)
    for t in range(bos, eos):
        q_t = tl.load(q + t * sq_t + ck, mask=mk, other=0.0).to(tl.float32) * scale
        k_t = tl.load(k + t * sk_t + ck, mask=mk, other=0.0).to(tl.float32)
        v_t = tl.load(v + t * sv_t + cv, mask=mv, other=0.0).to(tl.float32)
        S = S * tl.exp(tl.load(g + t * sg_t).to(tl.float32))
        b_t = tl.load(beta + t * sb_t).to(tl.float32)
        e_t = v_t - tl.sum(S * k_t[:, None], axis=0)
        S = S + k_t[:, None] * (b_t * e_t)[None, :]
        o_t = tl.sum(S * q_t[:, None], axis=0)
        tl.store(o + t * so_t + cv, o_t.to(o.dtype.element_ty), mask=mv)
    if STORE_HT:
        tl.store(hT + state_at, S, mask=mkv)


@triton.jit
def bwd_prep_kernel(
    q, k, v, g, beta, do, h0, e_buf, dq_buf, ckpt, cu,
    sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, sg_b, sg_t, sg_h, sb_b, sb_t, sb_h,
    sd_b, sd_t, sd_h,
    scale, T, HV, NVB, GROUP: tl.constexpr, K, V, BK: tl.constexpr, BV: tl.constexpr,
    C: tl.constexpr, HAS_H0: tl.constexpr, VARLEN: tl.constexpr,
):
    """Sweep 1 (forward in time): e = v - S'^T k, dq (partials per value block), and the state
    before every C-th token of the sequence (checkpoints for sweep 2)."""
    i_v, i_n, i_h, i_hk, i_b, bos, eos = _program(cu, T, HV, GROUP, VARLEN)
    ck, cv = tl.arange(0, BK), i_v * BV + tl.arange(0, BV)
    mk, mv = ck < K, cv < V
    q += i_b * sq_b + i_hk * sq_h
    k += i_b * sk_b + i_hk * sk_h
    v += i_b * sv_b + i_h * sv_h
    g += i_b * sg_b + i_h * sg_h
    beta += i_b * sb_b + i_h * sb_h
    do += i_b * sd_b + i_h * sd_h
    tile = ck[:, None] * V + cv[None, :]
    mkv = mk[:, None] & mv[None, :]
    slot = chunk_slot(i_n, bos, 0, C, tl.cdiv(T, C), VARLEN)
    S = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_H0:
        S += tl.load(h0 + (i_n * HV + i_h) * K * V + tile, mask=mkv, other=0.0).to(tl.float32)
    for t in range(bos, eos):
        if (t - bos) % C == 0:
            tl.store(ckpt + ((slot + (t - bos) // C) * HV + i_h) * K * V + tile, S, mask=mkv)
        row = (i_b * T + t) * HV + i_h
        k_t = tl.load(k + t * sk_t + ck, mask=mk, other=0.0).to(tl.float32)
        v_t = tl.load(v + t * sv_t + cv, mask=mv, other=0.0).to(tl.float32)
        do_t = tl.load(do + t * sd_t + cv, mask=mv, other=0.0).to(tl.float32)
        S = S * tl.exp(tl.load(g + t * sg_t).to(tl.float32))
        b_t = tl.load(beta + t * sb_t).to(tl.float32)
        e_t = v_t - tl.sum(S * k_t[:, None], axis=0)
        tl.store(e_buf + row * V + cv, e_t, mask=mv)
        S = S + k_t[:, None] * (b_t * e_t)[None, :]
        dq_t = tl.sum(S * do_t[None, :], axis=1) * scale
        tl.store(dq_buf + (row * NVB + i_v) * K + ck, dq_t, mask=mk)


@triton.jit
def bwd_reverse_kernel(
    q, k, v, g, beta, do, dv, dhT, e_buf, ckpt, dk_buf, dbeta_buf, dg_buf, dh0, cu,
    sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, sg_b, sg_t, sg_h, sb_b, sb_t, sb_h,
    sd_b, sd_t, sd_h,
    sdv_b, sdv_t, sdv_h, scale, T, HV, NVB, GROUP: tl.constexpr, K, V, BK: tl.constexpr,
    BV: tl.constexpr, C: tl.constexpr, HAS_DHT: tl.constexpr, VARLEN: tl.constexpr,
):
    """Sweep 2 (backward in time): carry L = dLoss/dS_t; at each token rebuild the decayed state
    S'_t from the checkpoint of its block (at most C - 1 steps, from the kept e), then dv, and
    the partials of dk, dbeta and dg = <dS', S'> (direct: no running sum that would cancel when
    exp(g) is tiny); dh0 at the end."""
    i_v, i_n, i_h, i_hk, i_b, bos, eos = _program(cu, T, HV, GROUP, VARLEN)
    ck, cv = tl.arange(0, BK), i_v * BV + tl.arange(0, BV)
    mk, mv = ck < K, cv < V
    q += i_b * sq_b + i_hk * sq_h
    k += i_b * sk_b + i_hk * sk_h
    v += i_b * sv_b + i_h * sv_h
    g += i_b * sg_b + i_h * sg_h
    beta += i_b * sb_b + i_h * sb_h
    do += i_b * sd_b + i_h * sd_h
    dv += i_b * sdv_b + i_h * sdv_h
    tile = ck[:, None] * V + cv[None, :]
    mkv = mk[:, None] & mv[None, :]
    slot = chunk_slot(i_n, bos, 0, C, tl.cdiv(T, C), VARLEN)
    L = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_DHT:
        L += tl.load(dhT + (i_n * HV + i_h) * K * V + tile, mask=mkv, other=0.0).to(tl.float32)
    for i in range(0, eos - bos):
        t = eos - 1 - i
        row = (i_b * T + t) * HV + i_h
        block_start = bos + ((t - bos) // C) * C
        S = tl.load(ckpt + ((slot + (t - bos) // C) * HV + i_h) * K * V + tile, mask=mkv,
                    other=0.0)
        for s in range(block_start, t):
            k_s = tl.load(k + s * sk_t + ck, mask=mk, other=0.0).to(tl.float32)
            e_s = tl.load(e_buf + ((i_b * T + s) * HV + i_h) * V + cv, mask=mv, other=0.0)
            b_s = tl.load(beta + s * sb_t).to(tl.float32)
            S = S * tl.exp(tl.load(g + s * sg_t).to(tl.float32))
            S = S + k_s[:, None] * (b_s * e_s)[None, :]
        decay = tl.exp(tl.load(g + t * sg_t).to(tl.float32))
        S = S * decay  # S'_t
        q_t = tl.load(q + t * sq_t + ck, mask=mk, other=0.0).to(tl.float32) * scale
        k_t = tl.load(k + t * sk_t + ck, mask=mk, other=0.0).to(tl.float32)
        do_t = tl.load(do + t * sd_t + cv, mask=mv, other=0.0).to(tl.float32)
        b_t = tl.load(beta + t * sb_t).to(tl.float32)
        e_t = tl.load(e_buf + row * V + cv, mask=mv, other=0.0)
        L = L + q_t[:, None] * do_t[None, :]
        dd_t = tl.sum(L * k_t[:, None], axis=0)
        tl.store(dv + t * sdv_t + cv, (b_t * dd_t).to(dv.dtype.element_ty), mask=mv)
        tl.store(dbeta_buf + row * NVB + i_v, tl.sum(dd_t * e_t, axis=0))
        dk_t = tl.sum(L * (b_t * e_t)[None, :] - S * (b_t * dd_t)[None, :], axis=1)
        tl.store(dk_buf + (row * NVB + i_v) * K + ck, dk_t, mask=mk)
        L = L - k_t[:, None] * (b_t * dd_t)[None, :]  # dS'_t
        tl.store(dg_buf + row * NVB + i_v, tl.sum(tl.sum(L * S, axis=1), axis=0))
        L = L * decay
    tl.store(dh0 + (i_n * HV + i_h) * K * V + tile, L, mask=mkv)
