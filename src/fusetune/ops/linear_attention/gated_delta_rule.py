"""``fusetune.gated_delta_rule``: argument checks, dispatch, custom ops and autograd.

Kernels: ``gdr_chunk`` (mode="chunk": WY form per chunk of 64 tokens; its backward's math is in
``bwd_pairs_kernel`` and ``bwd_chunk_kernel``) and ``gdr_recurrent`` (mode="recurrent", token
by token).
Math of the recurrent backward (per sequence and value head; S_t the state after token t,
a_t = exp(g_t), e_t = v_t - (a_t S_{t-1})^T k_t, L_t = dLoss/dS_t including scale q_t do_t^T):
    dd_t = L_t^T k_t                 dv_t = beta_t dd_t          dbeta_t = dd_t . e_t
    dk_t = beta_t L_t e_t - beta_t (a_t S_{t-1}) dd_t           dq_t = scale S_t do_t
    L_{t-1} = a_t (L_t - beta_t k_t dd_t^T) + scale q_{t-1} do_{t-1}^T
    dg_t = <dS'_t, S'_t>, with S'_t = a_t S_{t-1} and dS'_t = L_t - beta_t k_t dd_t^T
dg is formed directly, both factors at hand (S' rebuilt from a checkpoint). The shortcut
dg_t = sum_{s >= t} (o_s . do_s - v_s . dv_s) + <dS_T, S_T> needs no state in the backward
sweep, but its terms are O(1) where dg_t is O(a_t): with Qwen3.5's strong decays (a ~ 1e-7) it
lost 2.6e-4 relative on dg and 1.7e-2 on dt_bias's gradient, 6x transformers' own fp32 error.
"""

from __future__ import annotations

import math

import torch

from fusetune import _utils
from fusetune.ops.linear_attention import gdr_chunk, gdr_recurrent
from fusetune.ops.linear_attention._common import (
    bth_strides,
    explain_out_of_resources,
    slot_count,
    unit_last_stride,
)
from fusetune.reference.gated_delta_rule import Shapes, check_gated_delta_args, l2norm
from fusetune.reference.gated_delta_rule import gated_delta_rule as reference_gated_delta_rule

MAX_KEY_DIM = 256  # the kernels hold a [K, BV] state slice in registers

# ============================================================================ host launchers


class _Plan:
    """Sizes and launch constants of one call."""

    def __init__(self, q, v, cu_seqlens) -> None:
        self.batch, self.seq_len, self.key_heads, self.key_dim = q.shape
        self.value_heads, self.value_dim = v.shape[2], v.shape[3]
        self.n_seq = self.batch if cu_seqlens is None else cu_seqlens.shape[0] - 1
        self.group = self.value_heads // self.key_heads
        self.BK = max(16, _utils.next_power_of_2(self.key_dim))
        self.BV = gdr_recurrent.block_v(self.value_dim, self.key_dim, _utils.INTERPRET)
        self.n_vblocks = _utils.cdiv(self.value_dim, self.BV)
        self.grid = (self.n_vblocks, self.n_seq * self.value_heads)
        self.varlen = cu_seqlens is not None

    @property
    def state_shape(self) -> tuple[int, int, int, int]:
        return (self.n_seq, self.value_heads, self.key_dim, self.value_dim)

    def consts(self) -> dict:
        return dict(GROUP=self.group, K=self.key_dim, V=self.value_dim, BK=self.BK, BV=self.BV,
                    VARLEN=self.varlen, num_warps=4)

    def empty(self) -> bool:
        return self.n_seq * self.value_heads == 0 or self.seq_len == 0


def _prepare(q, k, v, h0, cu_seqlens):
    q, k, v = (unit_last_stride(x) for x in (q, k, v))
    h0 = None if h0 is None else h0.contiguous()
    cu = None if cu_seqlens is None else cu_seqlens.contiguous()
    return q, k, v, h0, cu


def _forward_impl(q, k, v, g, beta, h0, cu_seqlens, scale, output_final_state, chunked,
                  l2norm):
    q, k, v, h0, cu = _prepare(q, k, v, h0, cu_seqlens)
    plan = _Plan(q, v, cu)
    if chunked:
        return _forward_chunked(plan, q, k, v, g, beta, h0, cu, scale, output_final_state,
                                l2norm)
    o = _utils.empty(v.shape, v.dtype, v.device)
    hT = _utils.empty(plan.state_shape if output_final_state else (0,), torch.float32, v.device)
    t_kept = _utils.empty((0,), torch.float32, v.device)  # (the chunked backward's T)
    if plan.n_seq * plan.value_heads == 0:
        return o, hT, t_kept
    gdr_recurrent.fwd_kernel[plan.grid](
        q, k, v, g, beta, o, o if h0 is None else h0, hT, o if cu is None else cu,
        *bth_strides(q), *bth_strides(k), *bth_strides(v), *g.stride(), *beta.stride(),
        *bth_strides(o), scale, plan.seq_len, plan.value_heads,
        HAS_H0=h0 is not None, STORE_HT=output_final_state, **plan.consts(),
    )
    return o, hT, t_kept


class _ChunkRun:
    """Buffers and launch constants of the chunked kernels for one call."""

    def __init__(self, plan: _Plan, v: torch.Tensor, l2norm: bool, backward: bool,
                 t_kept: torch.Tensor | None = None) -> None:
        device, f32 = v.device, torch.float32
        self.bt = gdr_chunk.chunk_size(_utils.INTERPRET, plan.key_dim)
        self.max_chunks = _utils.cdiv(plan.seq_len, self.bt)
        slots = slot_count(self.max_chunks, plan.n_seq, plan.varlen)
        rows = (plan.batch, plan.seq_len, plan.value_heads)
        # (I + A)^-1 per chunk (inverse_kernel's), read by wy_kernel and the backward's
        # bwd_pairs_kernel. The forward's is kept for the backward (t_kept: no second
        # inverse_kernel call, 0.29 ms at B1 T32768 H16 on an H200). It costs 4 KiB a token
        # and layer with 16 value heads; FLA keeps A in bf16 and l2-normalised copies of q and
        # k, 10 KiB at K 128.
        self.t_buf = _utils.empty((*rows, self.bt), f32, device) if t_kept is None else t_kept
        self.invert = t_kept is None
        self.u_buf = _utils.empty((*rows, plan.value_dim), f32, device)  # U (wy_kernel's)
        self.gc_buf = _utils.empty(rows, f32, device)  # floored gates
        # the sequential kernels' per-token and per-chunk factors (wy_kernel's): a key's decay
        # to its chunk's end times 1 / ||k||, scale e^G / ||q|| (backward), e^G_last a chunk
        self.kd_buf = _utils.empty(rows, f32, device)
        self.qd_buf = _utils.empty(rows if backward else (0,), f32, device)
        # (1 / ||q_t||, 1 / ||k_t||) for bwd_pairs (gdr_chunk._load_norms); bwd_chunk forms its
        # own: loaded, its spill rose 576 -> 704 B and its time with it (H200, 2026-12-02)
        self.norm_buf = _utils.empty((*rows, 2) if backward else (0,), f32, device)
        self.decay_buf = _utils.empty((slots, plan.value_heads), f32, device)
        self.state_shape = (slots, plan.value_heads, plan.key_dim, plan.value_dim)
        shared_memory = _utils.shared_memory_per_block(device)  # (None: the interpreter)
        dot = gdr_chunk.dot_mode(v.dtype, shared_memory)
        # W = T (beta e^G K), bf16 for bf16 inputs, where the sequential kernels' products are
        # bf16 ones too (gdr_chunk.sequential_bf16; FUSETUNE_GDR_W=fp32: fp32 W, tf32)
        seq_bf16 = gdr_chunk.sequential_bf16(v.dtype, dot)
        self.w_buf = _utils.empty((*rows, plan.key_dim), gdr_chunk.w_dtype(seq_bf16), device)
        # The writes D = U - W S0: over U in place, or beside it in bf16 (FUSETUNE_GDR_W=d)
        d_dtype = gdr_chunk.d_dtype(seq_bf16)
        self.d_buf = (self.u_buf if d_dtype == f32
                      else _utils.empty(self.u_buf.shape, d_dtype, device))  # fmt: skip
        # Each chunk's start state (and in the backward the state gradient) as stored for the
        # per-chunk kernels: in bf16 for bf16 inputs (tf32 products), as FLA stores them; the
        # sequential kernels carry the states in fp32 and round each chunk's copy once.
        self.h_buf = _utils.empty(self.state_shape, gdr_chunk.state_dtype(v.dtype, dot), device)
        self.grad_dtype = gdr_chunk.state_dtype(v.dtype, dot, gradient=True)  # dS's copies
        smallest = gdr_chunk.min_block(dot)
        if self.bt < smallest and not _utils.INTERPRET:
            raise ValueError("FUSETUNE_GDR_CHUNK=16 needs FUSETUNE_GDR_DOT=ieee: tensor-core "
                             "products on 16-wide tiles fault under Triton 3.6 (see "
                             "gdr_chunk.min_block)")
        self.bk = max(smallest, plan.BK)
        self.bva = max(smallest, _utils.next_power_of_2(plan.value_dim))
        self.bv = max(smallest, plan.BV)
        self.wy_block = min(self.bva, 64)  # value columns a step of wy_kernel's U loop
        # Products by input dtype (gdr_chunk.dot_mode): about fp32's accuracy for fp32 and fp16
        # (tf32 alone on what feeds the states and dg cost GSA's chunk mode 1.5e-2 on dg in
        # fp16: issue 20, item 4), tf32 for bf16; FUSETUNE_GDR_DOT forces one.
        self.common = dict(GROUP=plan.group, K=plan.key_dim, BT=self.bt, BK=self.bk,
                           VARLEN=plan.varlen, DOT=dot, L2NORM=l2norm, num_warps=4,
                           num_stages=1)  # shared memory: see gdr_chunk's SHARED MEMORY
        # The per-chunk kernels hold many [BT, K] and [BT, V] tiles: more warps, fewer
        # registers a thread. With tf32 products wy and output run faster at 4 (H100, B4 T4096
        # H16 D128 bf16 fwd+bwd 13.28 -> 12.33 ms: tools/gdr_launch_sweep.py); bwd_chunk at 4
        # was slower (14.08).
        self.wide = dict(self.common, num_warps=8)
        tf32 = gdr_chunk.tf32_buffers(dot)  # (bf16 products too)
        self.per_chunk = self.common if tf32 else self.wide  # wy_kernel, output_kernel
        # wy_kernel's key columns go by in steps of at most 64 (its docstring)
        self.wy_launch = {**{n: x for n, x in self.per_chunk.items() if n != "BK"},
                          "BKW": min(self.bk, 64)}  # fmt: skip
        # The backward's two per-chunk kernels: with tf32 products bwd_pairs at 4 warps and
        # both prefetching the next value block (2 stages; same shared memory, no more spill
        # offline): H100, fwd+bwd B4 T4096 5.12 -> 4.98 (4 warps) and 4.86 ms (2 stages), B1
        # T32768 10.44 -> 9.57 and 10.02 (docs/bench/session-2026-11-28-nineteenth/call-04);
        # both: 5.16 -> 4.70 and 10.36 -> 9.53 (session-2026-11-28-twentieth/call-01).
        # split3 stays at 8 warps, 1 stage: at 4 warps its bwd_pairs collapses to 32 registers
        # on sm_80 (a 9.8-22 KB stack, offline). bwd_chunk's value loop waited on its loads:
        # at 3 stages, H200 bwd_chunk 0.983 -> 0.913 ms at B4 T4096, 1.983 -> 1.893 at B1
        # T32768 (4 stages: 0.906 / 1.908), same registers and spill; 110592 bytes of shared
        # memory on sm_90, 73760 on sm_80 (docs/bench/session-2026-12-02-thirtieth/call-04).
        self.bwd_pairs_launch = dict(self.per_chunk, num_stages=2 if tf32 else 1)
        self.bwd_chunk_launch = dict(self.wide, num_stages=3 if tf32 else 1)
        self.chunk_grid = (self.max_chunks, plan.n_seq * plan.value_heads)
        # one warp: the 16 x 16 forward substitution's row reductions stay inside it
        self.inverse_launch = {**{n: self.common[n] for n in ("GROUP", "K", "BT", "VARLEN",
                                                              "DOT", "L2NORM")},
                               "num_warps": 1, "num_stages": 1}  # fmt: skip
        self.column_grid = (_utils.cdiv(plan.value_dim, self.bv), plan.n_seq * plan.value_heads)
        # The sequential kernels are latency-bound. dstates_kernel runs faster at 8 warps at both
        # bench shapes; states_kernel only where its programs leave SMs idle (H200, fwd+bwd: B1
        # T32768 H16 D128 bf16 22.84 -> 20.58 ms with both at 8; H100, B4 T4096, states at 8
        # 7.97 -> 8.36, dstates at 8 7.82: tools/gdr_launch_sweep.py).
        few = self.column_grid[0] * self.column_grid[1] < _utils.num_programs_in_flight(device)
        # With bf16 products (W's tile bf16) the sequential kernels prefetch the next chunk's
        # loads (2 stages; they do not depend on the state): H100, fwd+bwd B4 T4096 6.43 ->
        # 6.17 ms, B1 T32768 13.67 -> 12.48 (docs/bench/session-2026-11-27-eighteenth/call-02,
        # -03). Shared memory 49 / 66 KB; fp32 / fp16 inputs' split3 products spill more at 2
        # (offline, sm_90, Triton 3.6: dstates 920 -> 1800 B) and stay at 1.
        self.sequential = dict(SEQ_BF16=seq_bf16)  # states_ and dstates_kernel
        stages = 2 if seq_bf16 else 1
        self.states_launch = dict(self.wide if few else self.common, num_stages=stages)
        self.dstates_launch = dict(self.wide, num_stages=stages)
        # The walks in key blocks (gdr_chunk.walks_in_key_blocks), at 4 warps (8 were slower:
        # B1 T32768 fwd+bwd 8.29 against 7.71 ms, docs/bench/session-2026-12-02-twentyeighth).
        # They prefetch two chunks ahead (3 stages) where that won on the H200
        # (docs/bench/session-2026-12-02-thirty-first/call-03, GPU ms at 2 -> 3 stages):
        # - where their programs leave SMs idle, both (B1 T32768: states 2.300 -> 1.717, dstates
        #   1.331 -> 0.990);
        # - elsewhere dstates alone, on Hopper-sized blocks (B4 T4096: 0.311 -> 0.262; sm_90
        #   holds one block a SM at 2 and 3 stages, 123392 and 185344 bytes, sm_80 two at 2 and
        #   one at 3: not measured); states lost there (0.343 -> 0.403: 86272 -> 127488 bytes).
        self.key_block_walks = gdr_chunk.walks_in_key_blocks(plan.key_dim, seq_bf16)
        walk = {**{n: self.common[n] for n in ("GROUP", "K", "BT", "VARLEN")}, "num_warps": 4}
        hopper_blocks = (shared_memory or 0) >= 200_000
        self.states_k64_launch = dict(walk, num_stages=3 if few else 2)
        self.dstates_k64_launch = dict(walk, num_stages=3 if few or hopper_blocks else 2)

    def wy(self, plan, k, v, g, beta, cu_arg, q=None, do=None, dd_buf=None, scale=1.0,
           chunks=None) -> None:
        """Per chunk T = (I + A)^-1 (unless kept), g, W, U and the sequential kernels' factors
        (and with ``do``, dD's local part P^T dO into ``dd_buf``), over the chunks [c0, c1)
        (all)."""
        local = do is not None
        q_arg, do_arg = (q, do) if local else (k, v)  # (unread without LOCAL_DD)
        c0, c1 = chunks or (0, self.max_chunks)
        grid = (c1 - c0, self.chunk_grid[1])
        if self.invert:
            gdr_chunk.inverse_kernel[grid](
                k, g, beta, self.t_buf, cu_arg, *bth_strides(k), *g.stride(), *beta.stride(),
                plan.seq_len, plan.value_heads, c0, **self.inverse_launch,
            )
        gdr_chunk.wy_kernel[grid](
            q_arg, k, v, g, beta, do_arg, self.gc_buf, self.t_buf, self.w_buf, self.u_buf,
            dd_buf if local else self.u_buf, self.kd_buf, self.qd_buf if local else self.kd_buf,
            self.norm_buf if local else self.kd_buf, self.decay_buf, cu_arg, *bth_strides(q_arg),
            *bth_strides(k), *bth_strides(v), *g.stride(), *beta.stride(), *bth_strides(do_arg),
            scale,
            plan.seq_len, plan.value_heads, c0, V=plan.value_dim, BV=self.wy_block,
            LOCAL_DD=local, **self.wy_launch,
        )

    def sequential_states(self, plan, k, h0, hT, cu_arg, chunks=None) -> None:
        """The start state of every chunk in [c0, c1) (all) into h_buf and its writes D into
        d_buf, from h0 (zeros if None); the state after them into hT (if given)."""
        c0, c1 = chunks or (0, self.max_chunks)
        if self.key_block_walks:  # (the same arguments; no SEQ_BF16: every product bf16)
            kernel, launch = gdr_chunk.states_k64_kernel, self.states_k64_launch
        else:
            kernel, launch = gdr_chunk.states_kernel, {**self.sequential, **self.states_launch}
        kernel[self.column_grid](
            k, self.kd_buf, self.decay_buf, self.w_buf, self.u_buf, self.d_buf, self.h_buf,
            self.u_buf if h0 is None else h0, self.u_buf if hT is None else hT, cu_arg,
            *bth_strides(k), plan.seq_len, plan.value_heads, c0, c1, V=plan.value_dim,
            BV=self.bv, HAS_H0=h0 is not None, STORE_HT=hT is not None, **launch,
        )

    def dstates(self, plan, q, k, do, dd_buf, dh_buf, dhT, dh0, scale, cu_arg) -> None:
        """dS per chunk into dh_buf and dD into dd_buf, walking the chunks in reverse from dhT
        (zeros if None) to dh0 (dstates_kernel or its key-block form, which takes no scale:
        wy_kernel's qd_buf carries it)."""
        args = (q, k, do, self.kd_buf, self.qd_buf, self.decay_buf, self.w_buf, dd_buf, dh_buf,
                dh_buf if dhT is None else dhT, dh0, cu_arg, *bth_strides(q), *bth_strides(k),
                *bth_strides(do))  # fmt: skip
        given = dict(V=plan.value_dim, BV=self.bv, HAS_DHT=dhT is not None)
        if self.key_block_walks:
            gdr_chunk.dstates_k64_kernel[self.column_grid](
                *args, plan.seq_len, plan.value_heads, **given, **self.dstates_k64_launch
            )
        else:
            gdr_chunk.dstates_kernel[self.column_grid](
                *args, scale, plan.seq_len, plan.value_heads, **given, **self.sequential,
                **self.dstates_launch,
            )

    def output(self, plan, q, k, o, scale, cu_arg, chunks) -> None:
        """O over the chunks [c0, c1)."""
        c0, c1 = chunks
        out_block = gdr_chunk.output_block(self.bva)
        grid = (c1 - c0, self.chunk_grid[1], _utils.cdiv(plan.value_dim, out_block))
        gdr_chunk.output_kernel[grid](
            q, k, self.gc_buf, self.d_buf, self.h_buf, o, cu_arg, *bth_strides(q),
            *bth_strides(k), *bth_strides(o), scale, plan.seq_len, plan.value_heads, c0,
            V=plan.value_dim, BVA=out_block, **self.per_chunk,
        )


def _forward_chunked(plan, q, k, v, g, beta, h0, cu, scale, output_final_state, l2norm):
    """The chunked forward (``gdr_chunk``): WY per chunk, states across chunks, outputs."""
    o = _utils.empty(v.shape, v.dtype, v.device)
    hT = _utils.empty(plan.state_shape if output_final_state else (0,), torch.float32, v.device)
    if plan.empty():
        if output_final_state:  # no tokens: the final state is the initial one
            hT.copy_(h0 if h0 is not None else torch.zeros_like(hT))
        return o, hT, _utils.empty(_kept_t_shape(q, v), torch.float32, v.device)
    run = _ChunkRun(plan, v, l2norm, backward=False)
    cu_arg = o if cu is None else cu
    parts = gdr_chunk.forward_parts(v.device, math.prod(run.column_grid), run.max_chunks)
    # the state from one part to the next (fp32, as the walk carries it)
    mid = _utils.empty(plan.state_shape if len(parts) > 1 else (0,), torch.float32, v.device)
    side = gdr_chunk.side_stream(v.device) if len(parts) > 1 and v.is_cuda else None
    walked = []  # each part's walk, done (events on the side stream)
    for p, chunks in enumerate(parts):
        run.wy(plan, k, v, g, beta, cu_arg, chunks=chunks)
        start = h0 if p == 0 else mid
        end = mid if p < len(parts) - 1 else hT if output_final_state else None
        if side is None:
            run.sequential_states(plan, k, start, end, cu_arg, chunks)
            continue
        side.wait_stream(torch.cuda.current_stream(v.device))  # (this part's wy)
        with torch.cuda.stream(side):
            run.sequential_states(plan, k, start, end, cu_arg, chunks)
            walked.append(torch.cuda.Event())
            walked[-1].record(side)
    for p, chunks in enumerate(parts):
        if side is not None:  # (the last wait also keeps every buffer alive past the walks)
            torch.cuda.current_stream(v.device).wait_event(walked[p])
        run.output(plan, q, k, o, scale, cu_arg, chunks)
    return o, hT, run.t_buf


def _kept_t_shape(q, v):
    """[B, T, HV, BT]: the forward's per-chunk T = (I + A)^-1 rows, kept for the backward."""
    return (*v.shape[:3], gdr_chunk.chunk_size(_utils.INTERPRET, q.shape[-1]))


def _backward_chunked(plan, do, dhT, q, k, v, g, beta, t_kept, h0, cu, scale, l2norm):
    """The chunked backward: recompute the forward's states (and dD's local part) from its
    kept T, reverse over chunks for the state gradients and dD, then every input gradient per
    chunk."""
    device, f32 = v.device, torch.float32
    dh0 = _utils.empty(plan.state_shape, f32, device)
    if plan.empty():
        dh0.copy_(dhT if dhT is not None else torch.zeros_like(dh0))
        return (*_input_grads(plan, q, k, v), dh0)
    run = _ChunkRun(plan, v, l2norm, backward=True, t_kept=t_kept)
    cu_arg = do if cu is None else cu
    dd_buf = _utils.empty(run.u_buf.shape, f32, device)
    run.wy(plan, k, v, g, beta, cu_arg, q=q, do=do, dd_buf=dd_buf, scale=scale)
    dh_buf = _utils.empty(run.state_shape, run.grad_dtype, device)
    # The states' recompute and dstates read only wy_kernel's outputs and the inputs (dstates
    # never reads a state): where both launches' programs fit the GPU at once, the recompute
    # runs on a side stream beside dstates (gdr_chunk.backward_side_stream).
    side = gdr_chunk.backward_side_stream(device, 2 * math.prod(run.column_grid))
    if side is None:
        run.sequential_states(plan, k, h0, None, cu_arg)
    else:
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            run.sequential_states(plan, k, h0, None, cu_arg)
    run.dstates(plan, q, k, do, dd_buf, dh_buf, dhT, dh0, scale, cu_arg)
    if side is not None:  # (before any buffer the side stream reads is freed)
        torch.cuda.current_stream(device).wait_stream(side)
    # freed before the gradients' buffers are allocated: no peak holds both (u_buf is d_buf
    # itself but with FUSETUNE_GDR_W=d)
    run.w_buf = run.u_buf = None
    dq_buf, dk_buf, dv, dg_buf, dbeta_buf = _input_grads(plan, q, k, v)
    block = gdr_chunk.bwd_block_v(plan.key_dim, plan.value_dim, run.common["DOT"])
    # the token-pair gradients dQK and dKK, packed in one tile a chunk (gdr_chunk._pack_pairs)
    pair_buf = _utils.empty(run.t_buf.shape, f32, device)
    gdr_chunk.bwd_pairs_kernel[run.chunk_grid](
        q, k, v, beta, do, run.gc_buf, run.norm_buf, run.t_buf, run.d_buf, dd_buf, pair_buf, dv,
        dbeta_buf, dg_buf, cu_arg, *bth_strides(q), *bth_strides(k), *bth_strides(v),
        *beta.stride(), *bth_strides(do), *bth_strides(dv), scale, plan.seq_len, plan.value_heads,
        V=plan.value_dim, BVA=block, **run.bwd_pairs_launch,
    )
    gdr_chunk.bwd_chunk_kernel[run.chunk_grid](
        q, k, beta, do, run.gc_buf, run.d_buf, dd_buf, pair_buf, run.h_buf, dh_buf,
        dq_buf, dk_buf, dbeta_buf, dg_buf, cu_arg, *bth_strides(q), *bth_strides(k),
        *beta.stride(), *bth_strides(do), scale, plan.seq_len, plan.value_heads,
        V=plan.value_dim, BVA=block, **run.bwd_chunk_launch,
    )
    return dq_buf, dk_buf, dv, dg_buf, dbeta_buf, dh0


def _input_grads(plan, q, k, v):
    """The chunked backward's outputs (dq, dk, dv, dg, dbeta), unfilled. Without groups the
    kernel writes dq, dk in their own dtypes; with groups fp32 per value head, summed over the
    group after."""
    rows = (plan.batch, plan.seq_len, plan.value_heads)
    dq_buf, dk_buf = (_utils.empty((*rows, plan.key_dim), torch.float32 if plan.group > 1
                                   else x.dtype, v.device) for x in (q, k))
    dbeta_buf, dg_buf = (_utils.empty(rows, torch.float32, v.device) for _ in range(2))
    return dq_buf, dk_buf, _utils.empty(v.shape, v.dtype, v.device), dg_buf, dbeta_buf


def _backward_impl(do, dhT, q, k, v, g, beta, t_kept, h0, cu_seqlens, scale,
                   output_final_state, chunked, l2norm):
    q, k, v, h0, cu = _prepare(q, k, v, h0, cu_seqlens)
    do = unit_last_stride(do)
    plan = _Plan(q, v, cu)
    device, f32 = v.device, torch.float32
    dhT = dhT.contiguous() if output_final_state and dhT is not None else None
    if chunked:
        dq, dk, dv, dg, dbeta, dh0 = _backward_chunked(plan, do, dhT, q, k, v, g, beta, t_kept,
                                                       h0, cu, scale, l2norm)
        dq, dk = (_sum_group(x, plan) for x in (dq, dk))
        return (dq.to(q.dtype), dk.to(k.dtype), dv, dg.to(g.dtype), dbeta.to(beta.dtype), dh0)
    rows = (plan.batch, plan.seq_len, plan.value_heads)
    nvb, key_dim, value_dim = plan.n_vblocks, plan.key_dim, plan.value_dim
    # fp32 per-token buffers between the sweeps, per-value-block partial sums, checkpoints.
    every = gdr_recurrent.CHECKPOINT_EVERY
    blocks = _utils.cdiv(plan.seq_len, every)
    slots = slot_count(blocks, plan.n_seq, plan.varlen)
    ckpt = _utils.empty((slots, plan.value_heads, key_dim, value_dim), f32, device)
    e_buf = _utils.empty((*rows, value_dim), f32, device)
    dbeta_buf, dg_buf = (_utils.empty((*rows, nvb), f32, device) for _ in range(2))
    dq_buf, dk_buf = (_utils.empty((*rows, nvb, key_dim), f32, device) for _ in range(2))
    dv = _utils.empty(v.shape, v.dtype, device)
    dh0 = _utils.empty(plan.state_shape, f32, device)
    if plan.n_seq * plan.value_heads:
        dummy = e_buf
        h0_arg, dhT_arg, cu_arg = (dummy if x is None else x for x in (h0, dhT, cu))
        io_strides = (*bth_strides(q), *bth_strides(k), *bth_strides(v), *g.stride(),
                      *beta.stride(), *bth_strides(do))
        sizes = (plan.seq_len, plan.value_heads, nvb)
        gdr_recurrent.bwd_prep_kernel[plan.grid](
            q, k, v, g, beta, do, h0_arg, e_buf, dq_buf, ckpt, cu_arg, *io_strides, scale,
            *sizes, C=every, HAS_H0=h0 is not None, **plan.consts(),
        )
        gdr_recurrent.bwd_reverse_kernel[plan.grid](
            q, k, v, g, beta, do, dv, dhT_arg, e_buf, ckpt, dk_buf, dbeta_buf, dg_buf, dh0,
            cu_arg, *io_strides, *bth_strides(dv), scale, *sizes, C=every,
            HAS_DHT=dhT is not None, **plan.consts(),
        )
    dq, dk = (_sum_group(x.sum(3), plan) for x in (dq_buf, dk_buf))
    return (dq.to(q.dtype), dk.to(k.dtype), dv, dg_buf.sum(-1).to(g.dtype),
            dbeta_buf.sum(-1).to(beta.dtype), dh0)


def _sum_group(grad: torch.Tensor, plan: _Plan) -> torch.Tensor:
    """[B, T, HV, K] per value head -> [B, T, HK, K]: a key head's gradient sums its group's."""
    if plan.group == 1:
        return grad
    return grad.unflatten(2, (plan.key_heads, plan.group)).sum(3)


# ============================================================================ custom ops


def _fake_state(q, v, cu_seqlens):
    n_seq = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    return q.new_empty((n_seq, v.shape[2], q.shape[3], v.shape[3]), dtype=torch.float32)


def _fake_forward(q, k, v, g, beta, h0, cu_seqlens, scale, output_final_state, chunked,
                  l2norm):
    o = v.new_empty(v.shape)
    t_kept = q.new_empty(_kept_t_shape(q, v) if chunked else (0,), dtype=torch.float32)
    if not output_final_state:
        return o, q.new_empty((0,), dtype=torch.float32), t_kept
    return o, _fake_state(q, v, cu_seqlens), t_kept


def _fake_backward(do, dhT, q, k, v, g, beta, t_kept, h0, cu_seqlens, scale,
                   output_final_state, chunked, l2norm):
    grads = tuple(x.new_empty(x.shape) for x in (q, k, v, g, beta))
    return (*grads, _fake_state(q, v, cu_seqlens))


def _heads(q, k, v) -> str:
    return f"K = {q.shape[-1]}, V = {v.shape[-1]}"


_ARGS = (
    "Tensor? h0, Tensor? cu_seqlens, float scale, bool output_final_state, bool chunked, "
    "bool l2norm"
)

_forward_op = _utils.register_op(
    f"gated_delta_rule_forward(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, {_ARGS}) "
    "-> (Tensor, Tensor, Tensor)",
    fake=_fake_forward,
)(explain_out_of_resources(_forward_impl, "gated_delta_rule", lambda a: _heads(*a[:3]), -2))

_backward_op = _utils.register_op(
    "gated_delta_rule_backward(Tensor do, Tensor? dhT, Tensor q, Tensor k, Tensor v, Tensor g, "
    f"Tensor beta, Tensor t_kept, {_ARGS}) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
    fake=_fake_backward,
)(explain_out_of_resources(_backward_impl, "gated_delta_rule", lambda a: _heads(*a[2:5]), -2))


# ============================================================================ autograd


class _GatedDeltaRuleFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, h0, cu_seqlens, scale, output_final_state, chunked,
                l2norm):
        o, hT, t_kept = _forward_op(q, k, v, g, beta, h0, cu_seqlens, scale,
                                    output_final_state, chunked, l2norm)
        ctx.save_for_backward(q, k, v, g, beta, t_kept, h0, cu_seqlens)
        ctx.options = (scale, output_final_state, chunked, l2norm)
        ctx.state_dtype = None if h0 is None else h0.dtype
        return o, hT

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do, dhT):
        q, k, v, g, beta, t_kept, h0, cu_seqlens = ctx.saved_tensors
        dq, dk, dv, dg, dbeta, dh0 = _backward_op(
            do, dhT, q, k, v, g, beta, t_kept, h0, cu_seqlens, *ctx.options
        )
        dh0 = None if h0 is None else dh0.to(ctx.state_dtype)
        return dq, dk, dv, dg, dbeta, dh0, None, None, None, None, None


# ============================================================================ public function


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    mode: str = "chunk",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated delta rule (Gated DeltaNet's token mixer, as in Qwen3.5 and Qwen3-Next);
    forward and backward fused. Argument names and layout are FLA's ``chunk_gated_delta_rule``
    and transformers' ``torch_chunk_gated_delta_rule``, so it drops in for either.

    Per sequence and value head, state S [K, V] in fp32:
        S = exp(g_t) S;  S = S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = scale S^T q_t

    Args:
        q, k: [B, T, HK, K]; fp32, fp16 or bf16 (one dtype with v).
        v: [B, T, HV, V]; HV a multiple of HK: value head h reads query/key head h // (HV/HK).
        g: [B, T, HV] log decays (<= 0 in these models; not checked), any float dtype, read
            as fp32.  beta: [B, T, HV] write strengths, any float dtype, read as fp32.
        scale: multiplies q; default K ** -0.5.
        initial_state: [N, HV, K, V], any float dtype; N = B, or the number of sequences with
            cu_seqlens. Zero when None. Gradients flow to it.
        output_final_state: also return the final state [N, HV, K, V] in fp32.
        cu_seqlens: [N + 1] int32/int64 offsets of packed sequences (B must be 1): 0 first,
            non-decreasing, T last (values checked for CPU tensors; clamped on the GPU).
        use_qk_l2norm_in_kernel: L2-normalise q and k over K first (x * rsqrt(sum x^2 + 1e-6),
            in fp32), as Qwen3.5 asks.
        mode: "chunk" (training: chunks of 64 tokens in the WY form, fp32 states passed between
            chunks, IEEE fp32 products; backward recomputes the chunk states, walks the chunks
            in reverse for the state gradients, then one program per chunk and value head) or
            "recurrent" (decoding, short T: token by token, one program per sequence, value
            head and block of value columns). Both compute the same function to rounding.

    Returns:
        (o [B, T, HV, V] in v's dtype, final state [N, HV, K, V] fp32 or None).
        Under torch.autocast q, k and v are cast to the autocast dtype first; gradients come
        back in each input's own dtype. Accumulation and carried states are fp32 throughout;
        chunk mode's products with a computed fp32 operand run on tensor cores at about fp32's
        accuracy for fp32 and fp16 inputs; for bf16 they round it to tf32 (4x finer than bf16),
        or to bf16 in the two kernels that carry the state across chunks (the state, fp32,
        rounded only as a product's operand).

    Raises:
        TypeError: a non-tensor or non-floating input; q, k, v of different dtypes; non-bool
            flags; cu_seqlens not integer.
        ValueError: inconsistent shapes (the message names them); HV not a multiple of HK;
            unknown mode; cu_seqlens with B != 1, not 1-D or (CPU) bad values; initial_state's
            shape; K above 256 on the kernel path; tensors on different devices; head sizes
            whose kernels need more shared memory than this GPU has (the message names them).
    """
    device_type = q.device.type if isinstance(q, torch.Tensor) else "cpu"
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        q, k, v = (x.to(dtype) if isinstance(x, torch.Tensor) else x for x in (q, k, v))
    shapes = check_gated_delta_args(
        q, k, v, g, beta, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, cu_seqlens=cu_seqlens,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, mode=mode,
    )
    if _utils.backend(q) == "reference":
        return reference_gated_delta_rule(
            q, k, v, g, beta, scale=scale, initial_state=initial_state,
            output_final_state=output_final_state, cu_seqlens=cu_seqlens,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, mode=mode,
        )
    _check_kernel_dims(shapes)
    scale = shapes.key_dim**-0.5 if scale is None else float(scale)
    chunked = mode == "chunk"
    with torch.autocast(device_type, enabled=False):
        # The chunk kernels normalise q and k rows themselves (folded into per-token factors:
        # the products keep the 16-bit inputs); the recurrent ones take fp32 normalised q, k
        # (no rounding before the kernel).
        if use_qk_l2norm_in_kernel and not chunked:
            q, k = l2norm(q.float()), l2norm(k.float())
        o, final = _GatedDeltaRuleFunction.apply(
            q, k, v, g, beta, initial_state, cu_seqlens, scale, output_final_state, chunked,
            use_qk_l2norm_in_kernel and chunked,
        )
    return o, (final if output_final_state else None)


def _check_kernel_dims(shapes: Shapes) -> None:
    if shapes.key_dim > MAX_KEY_DIM:
        raise ValueError(
            f"K (q/k last dim) = {shapes.key_dim} exceeds {MAX_KEY_DIM}, the largest the gated "
            "delta rule kernels keep in registers"
        )
