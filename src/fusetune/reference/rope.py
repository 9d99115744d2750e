"""Pure-PyTorch rotary position embedding: the semantics of :func:`fusetune.rope`, its CPU path
and the tests' oracle.

For each rotated pair (i, j) of a head (half-split / GPT-NeoX / Llama: j = i + R/2 for
i < R/2; interleaved / GPT-J: i = 2p, j = 2p + 1), with R = rotary_dim:
    out_i = x_i cos_i - x_j sin_i
    out_j = x_j cos_j + x_i sin_j
which is transformers' ``q * cos + rotate_half(q) * sin``. Dims R..D pass through unchanged.
Computed in fp32 (float64 for float64 inputs), rounded once to the input dtype.
"""

from __future__ import annotations

import torch

from fusetune._utils import (
    _got,
    check_choice,
    check_floating,
    check_integer,
    check_same_device,
)

LAYOUTS = ("BTHD", "BHTD")


def _shape(t: torch.Tensor) -> str:
    """A shape for a message; under torch.compile sizes are symbolic and Dynamo (torch 2.11)
    cannot build a message from them, so the message says what was expected without it."""
    return "(symbolic)" if torch.compiler.is_compiling() else str(tuple(t.shape))


def _sizes(*sizes: int) -> str:
    return "(symbolic)" if torch.compiler.is_compiling() else str(sizes)


def _check_qk(q: torch.Tensor, k: torch.Tensor, layout: str) -> tuple[int, int, int]:
    """(batch, seq_len, head_dim) of q and k."""
    check_floating("q", q)
    check_floating("k", k)
    check_choice("layout", layout, LAYOUTS)
    for name, t in (("q", q), ("k", k)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D [{', '.join(layout)}], got shape {_shape(t)}")
    seq_dim = 1 if layout == "BTHD" else 2
    batch, seq_len, head_dim = q.shape[0], q.shape[seq_dim], q.shape[3]
    if (k.shape[0], k.shape[seq_dim], k.shape[3]) != (batch, seq_len, head_dim):
        raise ValueError(
            f"k must match q in batch, sequence and head_dim (layout {layout}); q is "
            f"{_shape(q)}, k is {_shape(k)}"
        )
    return batch, seq_len, head_dim


def _check_cos_sin(cos, sin, position_ids, batch, seq_len) -> None:
    check_floating("cos", cos)
    check_floating("sin", sin)
    if tuple(cos.shape) != tuple(sin.shape):
        raise ValueError(f"cos and sin must have one shape, got {_shape(cos)} and {_shape(sin)}")
    if position_ids is None:
        leading_ok = cos.dim() == 2 or (cos.dim() == 3 and cos.shape[0] in (1, batch))
        if not leading_ok or cos.shape[-2] != seq_len:
            raise ValueError(
                f"cos and sin must be [T, R], [1, T, R] or [B, T, R] with (B, T) = "
                f"{_sizes(batch, seq_len)} from q, got {_shape(cos)}"
            )
        return
    if cos.dim() != 2:
        raise ValueError(
            f"with position_ids, cos and sin must be a [max_positions, R] table, got {_shape(cos)}"
        )
    check_integer("position_ids", position_ids)
    leading_ok = position_ids.dim() == 1 or (
        position_ids.dim() == 2 and position_ids.shape[0] in (1, batch)
    )
    if not leading_ok or position_ids.shape[-1] != seq_len:
        raise ValueError(
            f"position_ids must be [T], [1, T] or [B, T] with (B, T) = "
            f"{_sizes(batch, seq_len)} from q, got {_shape(position_ids)}"
        )


def check_rope_args(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position_ids: torch.Tensor | None,
    layout: str,
    rotary_dim: int | None,
) -> int:
    """The argument checks the op and this reference share; returns the rotary dim R."""
    batch, seq_len, head_dim = _check_qk(q, k, layout)
    _check_cos_sin(cos, sin, position_ids, batch, seq_len)
    check_same_device(q=q, k=k, cos=cos, sin=sin, position_ids=position_ids)
    table_dim = cos.shape[-1]
    if rotary_dim is None:
        rotary_dim = table_dim
    elif isinstance(rotary_dim, bool) or not isinstance(rotary_dim, int):
        raise TypeError(f"rotary_dim must be an int or None, got {type(rotary_dim).__name__}")
    elif rotary_dim != table_dim:
        raise ValueError(
            f"rotary_dim must equal the last dim of cos and sin (shape {_shape(cos)})"
            f"{_got(rotary_dim)}"
        )
    # Shapes, not bare sizes, in messages: under dynamic torch.compile a size is symbolic and
    # Dynamo cannot format it alone.
    if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(
            f"rotary_dim (the last dim of cos and sin, shape {_shape(cos)}) must be even and "
            f"at most head_dim (the last dim of q, shape {_shape(q)})"
        )
    return rotary_dim


def gather_cos_sin(
    cos: torch.Tensor, sin: torch.Tensor, position_ids: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin as [B or 1, T, R]: rows picked by position_ids when given."""
    if position_ids is not None:
        ids = position_ids if position_ids.dim() == 2 else position_ids.unsqueeze(0)
        return cos[ids], sin[ids]
    if cos.dim() == 2:
        return cos.unsqueeze(0), sin.unsqueeze(0)
    return cos, sin


def rotate(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int, interleaved: bool
) -> torch.Tensor:
    """Rotate the first ``rotary_dim`` dims of ``x`` (cos/sin broadcast against x[..., :R])."""
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    rot = x[..., :rotary_dim].to(compute)
    if interleaved:
        partner = torch.stack((-rot[..., 1::2], rot[..., 0::2]), dim=-1).flatten(-2)
    else:
        half = rotary_dim // 2
        partner = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    rotated = rot * cos.to(compute) + partner * sin.to(compute)
    return torch.cat((rotated.to(x.dtype), x[..., rotary_dim:]), dim=-1)


def rope(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    position_ids: torch.Tensor | None = None,
    layout: str = "BTHD",
    rotary_dim: int | None = None,
    interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of :func:`fusetune.rope` (same signature and semantics)."""
    rotary_dim = check_rope_args(q, k, cos, sin, position_ids, layout, rotary_dim)
    cos, sin = gather_cos_sin(cos, sin, position_ids)
    # [B|1, T, R] -> broadcastable against [B, T, H, R] or [B, H, T, R]
    head_axis = 2 if layout == "BTHD" else 1
    cos, sin = cos.unsqueeze(head_axis), sin.unsqueeze(head_axis)
    return (
        rotate(q, cos, sin, rotary_dim, interleaved),
        rotate(k, cos, sin, rotary_dim, interleaved),
    )
