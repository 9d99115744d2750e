"""Pure-PyTorch gated slot attention (Zhang et al., 2024): the semantics of
:func:`fusetune.gated_slot_attention`, its CPU path and the tests' oracle. Also here: the argument
checks the op shares (every message names the argument, what it got and what was expected).

The recurrence, token by token: slow, obviously right. Per sequence and head (fp32, or fp64 when
an input is fp64):
    pass 1: Hk = Hk * exp(g_t)[None, :] + outer(k_t, s_t);   a_t = (scale * q_t) @ Hk
            p_t = softmax(a_t) over the M slots
    pass 2: Hv = Hv * exp(g_t)[:, None] + outer(s_t, v_t);   o_t = p_t @ Hv
Differentiable by autograd.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fusetune import _utils
from fusetune.reference._linear_attention import check_one_dtype, check_options

LAYOUTS = ("BTHD", "BHTD")
MODES = ("chunk", "recurrent")


@dataclass(frozen=True)
class Shapes:
    """Sizes read off the inputs (in either layout). ``n_seq`` is the number of sequences: B, or
    len(cu_seqlens) - 1 with packed variable-length input."""

    batch: int
    seq_len: int
    q_heads: int
    heads: int
    key_dim: int
    value_dim: int
    slots: int
    n_seq: int

    @property
    def group(self) -> int:
        return self.q_heads // self.heads


def _bthd(name: str, tensor: torch.Tensor, layout: str) -> tuple[int, int, int, int]:
    """(B, T, H, D) of a 4-D input in ``layout``."""
    _utils.check_ndim(
        name,
        tensor,
        (4,),
        "[B, T, H, D] (layout BTHD)" if layout == "BTHD" else "[B, H, T, D] (layout BHTD)",
    )
    b, x, y, d = tensor.shape
    return (b, x, y, d) if layout == "BTHD" else (b, y, x, d)


def check_gsa_args(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    s: torch.Tensor,
    g: torch.Tensor,
    *,
    scale: float | None,
    initial_state: tuple[torch.Tensor, torch.Tensor] | None,
    output_final_state: bool,
    cu_seqlens: torch.Tensor | None,
    layout: str,
) -> Shapes:
    """Validate the inputs of :func:`fusetune.gated_slot_attention` and return their sizes."""
    tensors = {"q": q, "k": k, "v": v, "s": s, "g": g}
    for name, tensor in tensors.items():
        _utils.check_floating(name, tensor)
    _utils.check_choice("layout", layout, LAYOUTS)
    dims = {name: _bthd(name, tensor, layout) for name, tensor in tensors.items()}
    batch, seq_len, q_heads, key_dim = dims["q"]
    heads, value_dim, slots = dims["k"][2], dims["v"][3], dims["s"][3]
    hint = "[B, T, H, D]" if layout == "BTHD" else "[B, H, T, D]"
    for name in ("k", "v", "s", "g"):
        b, t, h, _ = dims[name]
        if (b, t) != (batch, seq_len) or h != heads:
            raise ValueError(
                f"{name} must have q's batch and time sizes and k's head count ({hint}, layout "
                f"{layout}): q is {tuple(q.shape)}, k is {tuple(k.shape)}, {name} is "
                f"{tuple(tensors[name].shape)}"
            )
    if dims["k"][3] != key_dim:
        raise ValueError(
            f"k's last dim must equal q's (the key dim): q is {tuple(q.shape)}, k is "
            f"{tuple(k.shape)}"
        )
    if tuple(g.shape) != tuple(s.shape):
        raise ValueError(f"g must be shaped like s, got g {tuple(g.shape)} and s {tuple(s.shape)}")
    if q_heads % heads:
        raise ValueError(
            f"q's head count ({q_heads}) must be a multiple of k/v/s/g's ({heads}) (grouped-query "
            f"attention)"
        )
    check_one_dtype({"q": q, "k": k, "v": v, "s": s}, "g and the initial states")
    n_seq = check_options(
        scale, {"output_final_state": output_final_state}, cu_seqlens, batch, seq_len
    )
    shapes = Shapes(batch, seq_len, q_heads, heads, key_dim, value_dim, slots, n_seq)
    if initial_state is not None:
        _check_initial_state(initial_state, shapes)
    _utils.check_same_device(
        q=q,
        k=k,
        v=v,
        s=s,
        g=g,
        cu_seqlens=cu_seqlens,
        **({} if initial_state is None else {"initial_state": initial_state[0]}),
    )
    if g.device.type == "cpu" and not torch.compiler.is_compiling() and bool((g > 0).any()):
        raise ValueError(
            "g holds log forget gates and must be <= 0 (e.g. logsigmoid(f) / normaliser); got "
            f"a maximum of {g.max().item():.4g}. (Checked on the CPU only: on the GPU it would "
            "cost a host sync; there positive gates make the states grow.)"
        )
    return shapes


def _check_initial_state(initial_state: object, shapes: Shapes) -> None:
    if not isinstance(initial_state, (tuple, list)) or len(initial_state) != 2:
        raise TypeError(
            "initial_state must be a pair (hk0 [N, H, K, M], hv0 [N, H, M, V]), got "
            f"{type(initial_state).__name__}"
        )
    n, h = shapes.n_seq, shapes.heads
    expected = {
        "initial_state[0]": (n, h, shapes.key_dim, shapes.slots),
        "initial_state[1]": (n, h, shapes.slots, shapes.value_dim),
    }
    for (name, want), tensor in zip(expected.items(), initial_state, strict=True):
        _utils.check_floating(name, tensor)
        if tuple(tensor.shape) != want:
            raise ValueError(
                f"{name} must be {list(want)} ([N, H, K, M] / [N, H, M, V]; N = number of "
                f"sequences, H = k's heads), got {tuple(tensor.shape)}"
            )


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
) -> torch.Tensor | tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Same arguments and results as :func:`fusetune.gated_slot_attention` (no ``mode``)."""
    shapes = check_gsa_args(
        q,
        k,
        v,
        s,
        g,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
        layout=layout,
    )
    out_dtype = q.dtype
    compute = torch.float64 if torch.float64 in (q.dtype, g.dtype) else torch.float32
    scale = shapes.key_dim**-0.5 if scale is None else scale
    group = shapes.group
    # To [B, H, T, D] in the compute dtype; k, v, s, g repeated for every query head of a group.
    q, k, v, s, g = (
        x.to(compute) if layout == "BHTD" else x.to(compute).transpose(1, 2)
        for x in (q, k, v, s, g)
    )
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
