"""``fusetune.gated_slot_attention``: argument checks, dispatch, custom ops and autograd.

Math of the backward (per sequence and head; G = cumsum of g, both passes share it):
    dHk_t = scale q_t^T da_t + exp(g_{t+1}) * dHk_{t+1}
    dHv_t = p_t^T do_t + exp(g_{t+1}) * dHv_{t+1}
    dq_t = scale da_t @ Hk_t^T      dk_t = dHk_t @ s_t         dv_t = s_t @ dHv_t
    ds_t = k_t @ dHk_t + dHv_t @ v_t
    dp_t = do_t @ Hv_t^T, da_t = p_t * (dp_t - <p_t, dp_t>)     (softmax backward)
    dg_t = sum_{t' >= t} (a*da + p*dp - s*ds)_{t'} + sum_k dHk_T * Hk_T + sum_v dHv_T * Hv_T
The dg identity: a_t = exp(G_t) * (...), p_t enters pass 2 as p_t exp(G_t), and s_j enters both
passes as s_j exp(-G_j); so dL/dG_t = a_t da_t + p_t dp_t - s_t ds_t, and g_t reaches every G_t'
with t' >= t (the final states depend on G_T).
The kernels (``gsa_recurrent.py``, ``gsa_chunk.py``) run it as sweep A (forward in time: dq, and
p, da and r = a*da + p*dp kept in fp32) and sweep B (backward in time: dk, dv, ds, dg, dh0).
"""

from __future__ import annotations

import torch

from fusetune import _utils
from fusetune.ops.linear_attention import gsa_chunk, gsa_recurrent
from fusetune.ops.linear_attention._common import (
    MAX_DIM,
    UPCAST,
    Geometry,
    bthd_strides,
    dot_mode,
    explain_out_of_resources,
    slot_count,
    unit_last_stride,
)
from fusetune.reference.gsa import MODES, Shapes, check_gsa_args
from fusetune.reference.gsa import gated_slot_attention as reference_gated_slot_attention

# ============================================================================ host launchers


def _geometry(q, k, v, s, cu_seqlens, scale: float, layout: str) -> Geometry:
    batch, heads = q.shape[0], (k.shape[2] if layout == "BTHD" else k.shape[1])
    q_heads = q.shape[2] if layout == "BTHD" else q.shape[1]
    seq_len = q.shape[1] if layout == "BTHD" else q.shape[2]
    n_seq = batch if cu_seqlens is None else cu_seqlens.shape[0] - 1
    return Geometry(
        n_seq=n_seq, seq_len=seq_len, q_heads=q_heads, group=q_heads // heads,
        key_dim=q.shape[-1], value_dim=v.shape[-1], slots=s.shape[-1], scale=scale,
        dot=dot_mode(q.dtype), varlen=cu_seqlens is not None,
    )


def _with_heads(tensor: torch.Tensor, heads: int, layout: str) -> tuple[int, ...]:
    """``tensor``'s shape with its head count replaced by ``heads``."""
    shape = list(tensor.shape)
    shape[2 if layout == "BTHD" else 1] = heads
    return tuple(shape)


def _state_shapes(geom: Geometry, heads: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return ((geom.n_seq, heads, geom.key_dim, geom.slots),
            (geom.n_seq, heads, geom.slots, geom.value_dim))


def _launch(kernel, geom: Geometry, pointers, strided, flags: dict) -> None:
    """Launch the recurrent ``kernel`` over (sequence, query head) programs."""
    programs = geom.n_seq * geom.q_heads
    if programs == 0:
        return
    extra = gsa_recurrent.constants(geom.blocks)
    num_warps = extra.pop("num_warps")
    strides = [x for tensor, layout in strided for x in bthd_strides(tensor, layout)]
    kernel[(programs,)](
        *pointers, *strides, geom.scale, geom.seq_len, geom.q_heads, geom.group,
        geom.key_dim, geom.value_dim, geom.slots, **geom.blocks, **flags, VARLEN=geom.varlen,
        DOT=geom.dot, UPCAST=UPCAST, **extra, num_warps=num_warps,
    )


def _prepare(q, k, v, s, g, hk0, hv0, cu_seqlens, scale, layout):
    geom = _geometry(q, k, v, s, cu_seqlens, scale, layout)
    q, k, v, s, g = (unit_last_stride(x) for x in (q, k, v, s, g))
    states = tuple(None if x is None else x.contiguous() for x in (hk0, hv0))
    cu = None if cu_seqlens is None else cu_seqlens.contiguous()
    return geom, (q, k, v, s, g), states, cu


def _forward_impl(q, k, v, s, g, hk0, hv0, cu_seqlens, scale, layout, output_final_state,
                  chunked):
    if chunked:
        return _forward_chunked(q, k, v, s, g, hk0, hv0, cu_seqlens, scale, layout,
                                output_final_state)
    geom, (q, k, v, s, g), (hk0, hv0), cu = _prepare(q, k, v, s, g, hk0, hv0, cu_seqlens,
                                                     scale, layout)
    o = _utils.empty(q.shape[:3] + (geom.value_dim,), q.dtype, q.device)
    heads = geom.q_heads // geom.group
    hk_shape, hv_shape = _state_shapes(geom, heads) if output_final_state else ((0,), (0,))
    hkT = _utils.empty(hk_shape, torch.float32, q.device)
    hvT = _utils.empty(hv_shape, torch.float32, q.device)
    _launch(
        gsa_recurrent.fwd_kernel, geom,
        (q, k, v, s, g, o, o if hk0 is None else hk0, o if hv0 is None else hv0, hkT, hvT,
         o if cu is None else cu),
        [(q, layout), (k, layout), (v, layout), (s, layout), (g, layout), (o, layout)],
        dict(HAS_H0=hk0 is not None, STORE_HT=output_final_state),
    )
    return o, hkT, hvT


def _backward_impl(do, dhkT, dhvT, q, k, v, s, g, hk0, hv0, cu_seqlens, scale, layout,
                   output_final_state, chunked):
    if chunked:
        return _backward_chunked(do, dhkT, dhvT, q, k, v, s, g, hk0, hv0, cu_seqlens, scale,
                                 layout, output_final_state)
    geom, (q, k, v, s, g), (hk0, hv0), cu = _prepare(q, k, v, s, g, hk0, hv0, cu_seqlens,
                                                     scale, layout)
    device, hq, group = q.device, geom.q_heads, geom.group
    do = unit_last_stride(do)
    has_dht = output_final_state and (dhkT is not None or dhvT is not None)
    if has_dht:
        hk_shape, hv_shape = _state_shapes(geom, hq // group)
        dhkT = (torch.zeros(hk_shape, device=device) if dhkT is None else dhkT).contiguous()
        dhvT = (torch.zeros(hv_shape, device=device) if dhvT is None else dhvT).contiguous()
    batch = q.shape[0]
    # fp32 [B, T, HQ, M] buffers from sweep A to sweep B, and the final-state term of dg.
    p_buf, da_buf, r_buf = (
        _utils.empty((batch, geom.seq_len, hq, geom.slots), torch.float32, device)
        for _ in range(3)
    )
    f_buf = _utils.empty((geom.n_seq, hq, geom.slots), torch.float32, device)
    dq = _utils.empty(q.shape, q.dtype, device)
    dummy = dq
    _launch(
        gsa_recurrent.bwd_a_kernel, geom,
        (q, k, v, s, g, do, dq, p_buf, da_buf, r_buf, f_buf,
         dummy if hk0 is None else hk0, dummy if hv0 is None else hv0,
         dhkT if has_dht else dummy, dhvT if has_dht else dummy, dummy if cu is None else cu),
        [(q, layout), (k, layout), (v, layout), (s, layout), (g, layout), (do, layout),
         (dq, layout), (p_buf, "BTHD")],
        dict(HAS_H0=hk0 is not None, HAS_DHT=has_dht),
    )
    # With grouped queries each query head writes its own fp32 partial gradient; summed below.
    grads = [
        _utils.empty(_with_heads(x, hq, layout), torch.float32, device) if group > 1
        else _utils.empty(x.shape, x.dtype, device)
        for x in (k, v, s, g)
    ]
    dhk0, dhv0 = (_utils.empty(shape, torch.float32, device) for shape in _state_shapes(geom, hq))
    _launch(
        gsa_recurrent.bwd_b_kernel, geom,
        (q, k, v, s, g, do, p_buf, da_buf, r_buf, f_buf,
         dhkT if has_dht else dummy, dhvT if has_dht else dummy, *grads, dhk0, dhv0,
         dummy if cu is None else cu),
        [(q, layout), (k, layout), (v, layout), (s, layout), (g, layout), (do, layout),
         (p_buf, "BTHD"), *((x, layout) for x in grads)],
        dict(HAS_DHT=has_dht),
    )
    if group > 1:
        grads = [_sum_group(x, group, layout).to(ref.dtype) for x, ref in zip(grads, (k, v, s, g),
                                                                              strict=True)]
    dhk0, dhv0 = (x.unflatten(1, (hq // group, group)).sum(2) for x in (dhk0, dhv0))
    return (dq, *grads, dhk0, dhv0)


# ---------------------------------------------------------------------------- chunk mode
# Forward, two launches: states (sequential over chunks of S tokens, per block of slots and
# key/value head) stores every chunk's starting states and the chunk-local gate cumsums; then
# one program per (block of BT tokens, query head) computes o. Backward, six: states again
# (recomputed, not kept from the forward), sweep A per block, state gradients in reverse per
# block of slots and query head, sweep B per chunk (twice: the second pass redoes the chunks
# with a steep block exactly), and dg's cross-chunk sums.


class _ChunkPlan:
    """Chunk-mode sizes: S tokens per program, slots for per-chunk states, the 2-D grids."""

    def __init__(self, geom: Geometry) -> None:
        self.const = gsa_chunk.constants(geom.seq_len, _utils.INTERPRET)
        self.S = self.const["S"]
        self.max_chunks = _utils.cdiv(geom.seq_len, self.S)
        self.slots = slot_count(self.max_chunks, geom.n_seq, geom.varlen)  # per-chunk states
        self.grid = (self.max_chunks, geom.n_seq * geom.q_heads)  # per chunk
        blocks = self.max_chunks * (self.S // self.const["BT"])
        self.block_grid = (blocks, geom.n_seq * geom.q_heads)  # per block of BT tokens
        self.slot_block = min(gsa_chunk.SLOT_BLOCK, geom.blocks["BM"])
        self.slot_blocks = _utils.cdiv(geom.slots, self.slot_block)

    def common(self, geom: Geometry, kernel: str) -> dict:
        return dict(BK=geom.blocks["BK"], BV=geom.blocks["BV"], VARLEN=geom.varlen, DOT=geom.dot,
                    UPCAST=UPCAST, num_warps=gsa_chunk.NUM_WARPS[kernel])

    def sequential(self, geom: Geometry, kernel: str) -> dict:
        """Launch constants of the kernels that walk whole sequences (per block of slots)."""
        return dict(**self.common(geom, kernel), BMS=self.slot_block, S=self.S)

    def per_chunk(self, geom: Geometry, kernel: str) -> dict:
        return dict(**self.common(geom, kernel), BM=geom.blocks["BM"], **self.const)


def _strides(*pairs) -> list[int]:
    return [x for tensor, layout in pairs for x in bthd_strides(tensor, layout)]


def _run_states(geom, plan, k, v, s, g, hk0, hv0, cu, layout, final=None, dht=None):
    """Chunk-start states [slots, H, ...] (fp32) and the gate cumsums restarted every block
    [B, T, H, M] (fp32); fills ``final`` = (hkT, hvT) and, with ``dht`` = (dhkT, dhvT), returns
    the final-state term of dg [N, H, M]."""
    device, heads = k.device, geom.q_heads // geom.group
    hk_shape, hv_shape = _state_shapes(geom, heads)
    hk_buf = _utils.empty((plan.slots, *hk_shape[1:]), torch.float32, device)
    hv_buf = _utils.empty((plan.slots, *hv_shape[1:]), torch.float32, device)
    gc = _utils.empty((k.shape[0], geom.seq_len, heads, geom.slots), torch.float32, device)
    f_buf = _utils.empty((geom.n_seq, heads, geom.slots) if dht else (0,), torch.float32, device)
    dummy = hk_buf
    if geom.n_seq * heads:
        gsa_chunk.states_kernel[(plan.slot_blocks, geom.n_seq * heads)](
            k, v, s, g, gc, dummy if hk0 is None else hk0, dummy if hv0 is None else hv0,
            hk_buf, hv_buf, *(final or (dummy, dummy)), *(dht or (dummy, dummy)), f_buf,
            dummy if cu is None else cu,
            *_strides((k, layout), (v, layout), (s, layout), (g, layout), (gc, "BTHD")),
            geom.seq_len, heads, geom.key_dim, geom.value_dim, geom.slots, plan.max_chunks,
            HAS_H0=hk0 is not None, STORE_HT=final is not None,
            HAS_DHT=dht is not None, **plan.sequential(geom, "states"),
        )
    return hk_buf, hv_buf, gc, f_buf


def _forward_chunked(q, k, v, s, g, hk0, hv0, cu_seqlens, scale, layout, output_final_state):
    geom, (q, k, v, s, g), (hk0, hv0), cu = _prepare(q, k, v, s, g, hk0, hv0, cu_seqlens,
                                                     scale, layout)
    plan = _ChunkPlan(geom)
    heads = geom.q_heads // geom.group
    hk_shape, hv_shape = _state_shapes(geom, heads) if output_final_state else ((0,), (0,))
    hkT = _utils.empty(hk_shape, torch.float32, q.device)
    hvT = _utils.empty(hv_shape, torch.float32, q.device)
    hk_buf, hv_buf, gc, _ = _run_states(geom, plan, k, v, s, g, hk0, hv0, cu, layout,
                                        final=(hkT, hvT) if output_final_state else None)
    o = _utils.empty(q.shape[:3] + (geom.value_dim,), q.dtype, q.device)
    if plan.max_chunks and geom.n_seq * geom.q_heads:
        gsa_chunk.fwd_kernel[plan.block_grid](
            q, k, v, s, gc, o, hk_buf, hv_buf, o if cu is None else cu,
            *_strides((q, layout), (k, layout), (v, layout), (s, layout), (gc, "BTHD"),
                      (o, layout)),
            geom.scale, geom.seq_len, geom.q_heads, geom.group, geom.key_dim, geom.value_dim,
            geom.slots, plan.max_chunks, **plan.per_chunk(geom, "fwd"),
        )
    return o, hkT, hvT


def _backward_chunked(do, dhkT, dhvT, q, k, v, s, g, hk0, hv0, cu_seqlens, scale, layout,
                      output_final_state):
    geom, (q, k, v, s, g), (hk0, hv0), cu = _prepare(q, k, v, s, g, hk0, hv0, cu_seqlens,
                                                     scale, layout)
    plan = _ChunkPlan(geom)
    device, hq, group = q.device, geom.q_heads, geom.group
    do = unit_last_stride(do)
    dht = None
    if output_final_state and (dhkT is not None or dhvT is not None):
        hk_shape, hv_shape = _state_shapes(geom, hq // group)
        dht = ((torch.zeros(hk_shape, device=device) if dhkT is None else dhkT).contiguous(),
               (torch.zeros(hv_shape, device=device) if dhvT is None else dhvT).contiguous())
    hk_buf, hv_buf, gc, f_buf = _run_states(geom, plan, k, v, s, g, hk0, hv0, cu, layout,
                                            dht=dht)
    batch, parallel = q.shape[0], plan.max_chunks and geom.n_seq * hq
    w_shape = (batch, geom.seq_len, hq, geom.slots)  # fp32 per-token buffers, BTHD order
    p_buf, da_buf, r_buf = (_utils.empty(w_shape, torch.float32, device) for _ in range(3))
    dq = _utils.empty(q.shape, q.dtype, device)
    cu_arg = dq if cu is None else cu
    sizes = (geom.scale, geom.seq_len, hq, group, geom.key_dim, geom.value_dim, geom.slots,
             plan.max_chunks)
    io_strides = _strides((q, layout), (k, layout), (v, layout), (s, layout), (gc, "BTHD"),
                          (do, layout))
    if parallel:
        gsa_chunk.bwd_a_kernel[plan.block_grid](
            q, k, v, s, gc, do, dq, p_buf, da_buf, r_buf, hk_buf, hv_buf, cu_arg, *io_strides,
            *_strides((dq, layout), (p_buf, "BTHD")), *sizes, **plan.per_chunk(geom, "bwd_a"),
        )
    del hk_buf, hv_buf
    dhk_buf = _utils.empty((plan.slots, hq, geom.key_dim, geom.slots), torch.float32, device)
    dhv_buf = _utils.empty((plan.slots, hq, geom.slots, geom.value_dim), torch.float32, device)
    dhk0, dhv0 = (_utils.empty(shape, torch.float32, device) for shape in _state_shapes(geom, hq))
    if geom.n_seq * hq:
        gsa_chunk.dstates_kernel[(plan.slot_blocks, geom.n_seq * hq)](
            q, gc, do, p_buf, da_buf, *(dht or (dq, dq)), dhk_buf, dhv_buf, dhk0, dhv0, cu_arg,
            *_strides((q, layout), (gc, "BTHD"), (do, layout), (p_buf, "BTHD")), *sizes,
            HAS_DHT=dht is not None, **plan.sequential(geom, "dstates"),
        )
    grads = [
        _utils.empty(_with_heads(x, hq, layout), torch.float32, device) if group > 1
        else _utils.empty(x.shape, x.dtype, device)
        for x in (k, v, s)
    ]
    dg_local = _utils.empty(w_shape, torch.float32, device)
    totals = _utils.empty((plan.slots, hq, geom.slots), torch.float32, device)
    dg = (_utils.empty(_with_heads(g, hq, layout), torch.float32, device) if group > 1
          else _utils.empty(g.shape, g.dtype, device))
    if parallel:
        steep = _utils.empty((plan.slots, hq), torch.int32, device)  # per chunk
        for exact in (False, True):  # the second pass redoes the chunks with a steep block
            gsa_chunk.bwd_b_kernel[plan.grid](
                q, k, v, s, gc, do, p_buf, da_buf, r_buf, dhk_buf, dhv_buf, *grads, dg_local,
                totals, steep, cu_arg, *io_strides,
                *_strides((p_buf, "BTHD"), *((x, layout) for x in grads)), *sizes,
                EXACT=exact, **plan.per_chunk(geom, "bwd_b"),
            )
        gsa_chunk.dg_kernel[plan.grid](
            dg_local, totals, f_buf if dht else dq, dg, cu_arg,
            *_strides((dg_local, "BTHD"), (dg, layout)), geom.seq_len, hq, group, geom.slots,
            plan.max_chunks, BM=geom.blocks["BM"], S=plan.S, HAS_DHT=dht is not None,
            VARLEN=geom.varlen, num_warps=4,
        )
    grads.append(dg)
    if group > 1:
        grads = [_sum_group(x, group, layout).to(ref.dtype) for x, ref in zip(grads, (k, v, s, g),
                                                                              strict=True)]
    dhk0, dhv0 = (x.unflatten(1, (hq // group, group)).sum(2) for x in (dhk0, dhv0))
    return (dq, *grads, dhk0, dhv0)


def _sum_group(tensor: torch.Tensor, group: int, layout: str) -> torch.Tensor:
    dim = 2 if layout == "BTHD" else 1
    return tensor.unflatten(dim, (tensor.shape[dim] // group, group)).sum(dim + 1)


# ============================================================================ custom ops

_ARGS = "Tensor? hk0, Tensor? hv0, Tensor? cu_seqlens, float scale, str layout"


def _fake_states(q, k, v, s, cu_seqlens, layout):
    """Empty fp32 (hk [N, H, K, M], hv [N, H, M, V]) shaped like per-sequence states."""
    heads = k.shape[2] if layout == "BTHD" else k.shape[1]
    n_seq = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    key_dim, slots, value_dim = q.shape[-1], s.shape[-1], v.shape[-1]
    return (
        q.new_empty((n_seq, heads, key_dim, slots), dtype=torch.float32),
        q.new_empty((n_seq, heads, slots, value_dim), dtype=torch.float32),
    )


def _fake_forward(q, k, v, s, g, hk0, hv0, cu_seqlens, scale, layout, output_final_state,
                  chunked):
    o = q.new_empty(q.shape[:3] + (v.shape[-1],))
    if not output_final_state:
        return o, q.new_empty((0,), dtype=torch.float32), q.new_empty((0,), dtype=torch.float32)
    return (o, *_fake_states(q, k, v, s, cu_seqlens, layout))


def _fake_backward(do, dhkT, dhvT, q, k, v, s, g, hk0, hv0, cu_seqlens, scale, layout,
                   output_final_state, chunked):
    grads = tuple(x.new_empty(x.shape) for x in (q, k, v, s, g))
    return (*grads, *_fake_states(q, k, v, s, cu_seqlens, layout))


def _heads(q, k, v, s) -> str:
    return f"K = {q.shape[-1]}, V = {v.shape[-1]}, M = {s.shape[-1]}"


_forward_op = _utils.register_op(
    f"gsa_forward(Tensor q, Tensor k, Tensor v, Tensor s, Tensor g, {_ARGS}, "
    "bool output_final_state, bool chunked) -> (Tensor, Tensor, Tensor)",
    fake=_fake_forward,
)(explain_out_of_resources(_forward_impl, "gated_slot_attention", lambda a: _heads(*a[:4])))

_backward_op = _utils.register_op(
    "gsa_backward(Tensor do, Tensor? dhkT, Tensor? dhvT, Tensor q, Tensor k, Tensor v, "
    f"Tensor s, Tensor g, {_ARGS}, bool output_final_state, bool chunked) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
    fake=_fake_backward,
)(explain_out_of_resources(_backward_impl, "gated_slot_attention", lambda a: _heads(*a[3:7])))


# ============================================================================ autograd


class _GSAFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, s, g, hk0, hv0, cu_seqlens, scale, layout, output_final_state,
                chunked):
        o, hkT, hvT = _forward_op(q, k, v, s, g, hk0, hv0, cu_seqlens, scale, layout,
                                  output_final_state, chunked)
        ctx.save_for_backward(q, k, v, s, g, hk0, hv0, cu_seqlens)
        ctx.options = (scale, layout, output_final_state, chunked)
        ctx.state_dtypes = (None, None) if hk0 is None else (hk0.dtype, hv0.dtype)
        return o, hkT, hvT

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do, dhkT, dhvT):
        q, k, v, s, g, hk0, hv0, cu_seqlens = ctx.saved_tensors
        scale, layout, output_final_state, chunked = ctx.options
        dq, dk, dv, ds, dg, dhk0, dhv0 = _backward_op(
            do, dhkT, dhvT, q, k, v, s, g, hk0, hv0, cu_seqlens, scale, layout,
            output_final_state, chunked,
        )
        if hk0 is None:
            dhk0 = dhv0 = None
        else:
            dhk0, dhv0 = dhk0.to(ctx.state_dtypes[0]), dhv0.to(ctx.state_dtypes[1])
        return dq, dk, dv, ds, dg, dhk0, dhv0, None, None, None, None, None


# ============================================================================ public function


def gated_slot_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    s: torch.Tensor,
    g: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: tuple[torch.Tensor, torch.Tensor] | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    layout: str = "BTHD",
    mode: str = "chunk",
) -> torch.Tensor | tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Gated slot attention (Zhang et al., 2024): two gated linear-attention passes over M
    memory slots joined by a softmax over the slots; forward and backward fused.

    Per sequence and head, in fp32 (see ``fusetune.reference.gsa`` for the recurrence):
        Hk = Hk * exp(g_t)[None, :] + k_t^T s_t;  p_t = softmax(scale * q_t @ Hk)
        Hv = Hv * exp(g_t)[:, None] + s_t^T v_t;  o_t = p_t @ Hv

    Args:
        q: [B, T, HQ, K] (layout "BTHD") or [B, HQ, T, K] ("BHTD"); fp32, fp16 or bf16.
        k: [B, T, H, K] (or [B, H, T, K]); HQ must be a multiple of H (grouped queries: query
            head i reads key/value head i // (HQ / H)).
        v: [B, T, H, V].  s: [B, T, H, M] slot weights.  q, k, v and s share one dtype.
        g: [B, T, H, M] log forget gates, <= 0 (a layer uses logsigmoid(f) / normaliser); any
            float dtype, read as fp32. Positive gates raise ValueError for CPU tensors; on the GPU
            they are not checked (that would cost a host sync). Gates below -88 act as -88
            (exp(-88) is 0 to fp32).
        scale: multiplies q; default K ** -0.5.
        initial_state: (hk0 [N, H, K, M], hv0 [N, H, M, V]), any float dtype; N = B, or the
            number of sequences with cu_seqlens. Zero when None. Gradients flow to it.
        output_final_state: also return the final states (fp32, shaped like initial_state).
        cu_seqlens: [N + 1] int32/int64 offsets of packed sequences (B must be 1): 0 first, then
            non-decreasing, T last; no state crosses a boundary. Values are checked for CPU
            tensors; on the GPU they are clamped into [0, T] instead (no host sync).
        layout: "BTHD" or "BHTD" (any strides with a unit last stride are read in place).
        mode: "chunk" (for training: fp32 states every 64 tokens from a state-passing kernel,
            then one program per 16-token block and head: matmuls against the chunk-start states
            and the chunk's earlier blocks, the exact decay inside the block) or "recurrent"
            (token by token: decoding, short T).
            Both compute the same function to rounding.

    Returns:
        o: [B, T, HQ, V] (or [B, HQ, T, V]) in q's dtype; with output_final_state,
        ``(o, (hk [N, H, K, M], hv [N, H, M, V]))``.

    Under torch.autocast, q, k, v and s are cast to the autocast dtype (as attention's matmuls
    would be) and o comes back in it; gradients come back in each input's own dtype.
    Matmuls (chunk mode): products of two input tiles (q k^T, do v^T) run on bf16/fp16 tensor
    cores as they are (exact, fp32 accumulation); every product with a computed fp32 operand
    (states, decayed slot weights, probabilities) keeps fp32 operands: IEEE for fp32 inputs,
    3xTF32 for fp16 (about fp32's accuracy; tf32 rounded them to fp16's own mantissa), tf32 for
    bf16 (finer than bf16's rounding). Accumulation, gate cumsums, softmax and the carried
    states are fp32 always.

    Raises:
        TypeError: a non-tensor or non-floating input; q, k, v, s of different dtypes; a bad
            initial_state container; cu_seqlens not integer.
        ValueError: shapes inconsistent among q, k, v, s, g (message names them); not 4-D; HQ
            not a multiple of H; unknown layout or mode; cu_seqlens with B != 1, not 1-D, or (on
            the CPU) not starting at 0, decreasing, or not ending at T; initial_state shapes; a
            head dim above 256 on the kernel path; positive gates (CPU); tensors on different
            devices; head sizes whose kernels need more shared memory than this GPU has (chunk
            mode at K = V = M = 256 on an H100, for one: the message names the sizes).
    """
    _utils.check_choice("mode", mode, MODES)
    device_type = q.device.type if isinstance(q, torch.Tensor) else "cpu"
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        q, k, v, s = (x.to(dtype) if isinstance(x, torch.Tensor) else x for x in (q, k, v, s))
    shapes = check_gsa_args(
        q, k, v, s, g, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, cu_seqlens=cu_seqlens, layout=layout,
    )
    if _utils.backend(q) == "reference":
        return reference_gated_slot_attention(
            q, k, v, s, g, scale=scale, initial_state=initial_state,
            output_final_state=output_final_state, cu_seqlens=cu_seqlens, layout=layout,
        )
    _check_kernel_dims(shapes)
    scale = shapes.key_dim**-0.5 if scale is None else float(scale)
    hk0, hv0 = (None, None) if initial_state is None else initial_state
    with torch.autocast(device_type, enabled=False):
        o, hkT, hvT = _GSAFunction.apply(q, k, v, s, g, hk0, hv0, cu_seqlens, scale, layout,
                                         output_final_state, mode == "chunk")
    return (o, (hkT, hvT)) if output_final_state else o


def _check_kernel_dims(shapes: Shapes) -> None:
    for name, size in (("K (q/k last dim)", shapes.key_dim), ("V (v last dim)", shapes.value_dim),
                       ("M (s/g last dim)", shapes.slots)):
        if size > MAX_DIM:
            raise ValueError(
                f"{name} = {size} exceeds {MAX_DIM}, the largest the GSA kernels keep in "
                "registers; split the heads"
            )
