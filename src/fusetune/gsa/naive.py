"""Gated slot attention as its recurrence, token by token: slow, obviously right, the oracle.

Per sequence and head (fp32, or fp64 when an input is fp64):
    pass 1: Hk = Hk * exp(g_t)[None, :] + outer(k_t, s_t);   a_t = (scale * q_t) @ Hk
            p_t = softmax(a_t) over the M slots
    pass 2: Hv = Hv * exp(g_t)[:, None] + outer(s_t, v_t);   o_t = p_t @ Hv
Differentiable by autograd; this is also the CPU path of :func:`fusetune.gated_slot_attention`.
"""

from __future__ import annotations

import torch

from fusetune.gsa.checks import check_gsa_args


def naive(
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
) -> torch.Tensor | tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Same arguments and results as :func:`fusetune.gated_slot_attention` (no ``mode``)."""
    shapes = check_gsa_args(
        q, k, v, s, g, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, cu_seqlens=cu_seqlens, layout=layout,
    )
    out_dtype = q.dtype
    compute = torch.float64 if torch.float64 in (q.dtype, g.dtype) else torch.float32
    scale = shapes.key_dim**-0.5 if scale is None else scale
    group = shapes.group
    # To [B, H, T, D] in the compute dtype; k, v, s, g repeated for every query head of a group.
    q, k, v, s, g = (x.to(compute) if layout == "BHTD" else x.to(compute).transpose(1, 2)
                     for x in (q, k, v, s, g))
    k, v, s, g = (x.repeat_interleave(group, dim=1) for x in (k, v, s, g))
    hk0 = hv0 = None
    if initial_state is not None:
        hk0, hv0 = (x.to(compute).repeat_interleave(group, dim=1) for x in initial_state)

    if cu_seqlens is None:
        spans = [(slice(None), 0, shapes.seq_len)]  # the whole batch at once
    else:
        offsets = cu_seqlens.tolist()
        spans = [(slice(n, n + 1), offsets[n], offsets[n + 1]) for n in range(shapes.n_seq)]

    outputs, final_k, final_v = [], [], []
    for seqs, start, end in spans:
        batch_index = slice(None) if cu_seqlens is None else slice(0, 1)
        part = [x[batch_index, :, start:end] for x in (q, k, v, s, g)]
        states = (None, None) if hk0 is None else (hk0[seqs], hv0[seqs])
        o, hk, hv = _recurrence(*part, *states, scale)
        outputs.append(o)
        final_k.append(hk[:, ::group])  # one state per key/value head
        final_v.append(hv[:, ::group])
    o = torch.cat(outputs, dim=2)
    o = (o if layout == "BHTD" else o.transpose(1, 2)).to(out_dtype)
    if not output_final_state:
        return o
    return o, (torch.cat(final_k), torch.cat(final_v))  # fp32 (fp64 for fp64 inputs)


def _recurrence(q, k, v, s, g, hk0, hv0, scale):
    """One sequence per batch row: q, k [B, H, T, K], v [B, H, T, V], s, g [B, H, T, M]."""
    batch, heads, steps, key_dim = q.shape
    slots, value_dim = s.shape[-1], v.shape[-1]
    hk = q.new_zeros(batch, heads, key_dim, slots) if hk0 is None else hk0
    hv = q.new_zeros(batch, heads, slots, value_dim) if hv0 is None else hv0
    decay = g.exp()

    scores = []  # pass 1
    for t in range(steps):
        hk = hk * decay[:, :, t, None, :] + k[:, :, t, :, None] * s[:, :, t, None, :]
        scores.append(torch.einsum("bhk,bhkm->bhm", scale * q[:, :, t], hk))
    p = torch.stack(scores, dim=2).softmax(dim=-1) if steps else scores

    outputs = []  # pass 2
    for t in range(steps):
        hv = hv * decay[:, :, t, :, None] + s[:, :, t, :, None] * v[:, :, t, None, :]
        outputs.append(torch.einsum("bhm,bhmv->bhv", p[:, :, t], hv))
    o = torch.stack(outputs, dim=2) if steps else q.new_zeros(batch, heads, 0, value_dim)
    return o, hk, hv
