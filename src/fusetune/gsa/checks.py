"""Argument checks of gated slot attention, shared by the kernels' entry point and the naive oracle.

Every message names the argument, what it got and what was expected."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fusetune import _utils

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
    _utils.check_ndim(name, tensor, (4,), "[B, T, H, D] (layout BTHD)" if layout == "BTHD"
                      else "[B, H, T, D] (layout BHTD)")
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
    if not (q.dtype == k.dtype == v.dtype == s.dtype):
        raise TypeError(
            "q, k, v and s must share one dtype (g and the initial states may differ; they are "
            f"read as fp32), got q {q.dtype}, k {k.dtype}, v {v.dtype}, s {s.dtype}"
        )
    _utils.check_number("scale", scale, optional=True)
    if not isinstance(output_final_state, bool):
        got = type(output_final_state).__name__
        raise TypeError(f"output_final_state must be a bool, got {got}")
    n_seq = batch if cu_seqlens is None else _utils.check_cu_seqlens(cu_seqlens, batch, seq_len)
    shapes = Shapes(batch, seq_len, q_heads, heads, key_dim, value_dim, slots, n_seq)
    if initial_state is not None:
        _check_initial_state(initial_state, shapes)
    _utils.check_same_device(
        q=q, k=k, v=v, s=s, g=g, cu_seqlens=cu_seqlens,
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
