"""Pure-PyTorch mixture-of-experts expert MLP: the semantics of :func:`fusetune.moe_mlp`, its
CPU path and the tests' oracle (a per-expert loop, float64-able).

For every token n and each of its K routed experts e = topk_ids[n, k] with weight
w = topk_weights[n, k]:

    gu   = x[n] Wgu[e]^T + bgu[e] + s_gu (x[n] Agu[e]^T) Bgu[e]^T       [2I]
    h    = act(gate(gu), up(gu))                                         [I]
    y    = h Wd[e]^T + bd[e] + s_d (h Ad[e]^T) Bd[e]^T                   [H]
    out[n] += w y

Expert weights are stored as transformers 5.x stores them (no copy needed):

- ``transposed=False`` (Qwen3-MoE, Qwen3.5-MoE, Mixtral): gate_up [E, 2I, H], down [E, H, I]
  (out, in); ``transposed=True`` (gpt-oss): gate_up [E, H, 2I], down [E, I, H] (in, out).
- ``interleaved=False``: gate is gu[:I], up is gu[I:] (concatenated); ``interleaved=True``
  (gpt-oss): gate is gu[0::2], up is gu[1::2].

Activations: ``"swiglu"``: silu(gate) * up. ``"gpt_oss"``: gate clamped above at ``limit``, up
clamped to [-limit, limit], (up + 1) * gate * sigmoid(alpha * gate) (gpt-oss's clamped SwiGLU).

LoRA (:class:`MoeLora`) always has PEFT's (out, in) orientation whatever the storage:
gate_up_a [E, r, H], gate_up_b [E, 2I, r] (rows in gate_up's gate/up order), down_a [E, r, I],
down_b [E, H, r]. These are exactly PEFT 0.21's ``target_parameters`` factors for the 3-D
``gate_up_proj`` / ``down_proj`` (``ParamWrapper.get_delta_factors`` reshaped per expert).

Precision (the ops follow the same rule): the matmuls run in one compute dtype, accumulating in
fp32: the autocast dtype under torch.autocast; else the dtype of x and gate_up when they agree,
the 16-bit one when float32 meets a 16-bit dtype. gu and h are rounded to it (as transformers
does); y times the routing weight is summed over the K experts in fp32 and returned in the
compute dtype. Gradients come back in each input's dtype; an expert weight or bias that does not
require grad gets none.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from fusetune import _utils
from fusetune._utils import check_choice, check_floating, check_integer, check_number

ACTIVATIONS = ("swiglu", "gpt_oss")


class MoeLora(NamedTuple):
    """LoRA on the experts, per expert. Either pair may be None (that projection has none).

    gate_up_a [E, r, H], gate_up_b [E, 2I, r]; down_a [E, r_d, I], down_b [E, H, r_d];
    ``scaling`` for gate_up, ``down_scaling`` for down (None: the same as ``scaling``).
    Float32 or the expert weights' dtype."""

    gate_up_a: torch.Tensor | None
    gate_up_b: torch.Tensor | None
    down_a: torch.Tensor | None
    down_b: torch.Tensor | None
    scaling: float = 1.0
    down_scaling: float | None = None

    @property
    def scalings(self) -> tuple[float, float]:
        down = self.scaling if self.down_scaling is None else self.down_scaling
        return float(self.scaling), float(down)


class Layout(NamedTuple):
    """The checked problem: sizes, compute dtype and storage layout."""

    experts: int
    top_k: int
    hidden: int
    intermediate: int
    dtype: torch.dtype
    transposed: bool
    interleaved: bool


# ----------------------------------------------------------------------------- checks


def _expect_shape(name: str, t: torch.Tensor | None, shape: tuple, what: str) -> None:
    if t is not None and tuple(t.shape) != shape:
        raise ValueError(f"{name} must be {what} {shape}, got shape {tuple(t.shape)}")


def check_moe_args(
    x,
    topk_ids,
    topk_weights,
    gate_up,
    down,
    activation,
    gate_up_bias,
    down_bias,
    lora,
    transposed,
    interleaved,
    alpha,
    limit,
) -> Layout:
    """Check every argument (no device sync) and return the Layout. Raises TypeError for wrong
    kinds and dtypes, ValueError for shapes, devices, choices and numbers; the message names the
    argument."""
    for name, t in (("x", x), ("topk_weights", topk_weights), ("gate_up", gate_up), ("down", down)):
        check_floating(name, t)
    check_integer("topk_ids", topk_ids)
    check_choice("activation", activation, ACTIVATIONS)
    check_number("alpha", alpha)
    check_number("limit", limit, low=0.0, low_inclusive=False)
    _utils.check_ndim("x", x, (2,), "[tokens, hidden]")
    _utils.check_ndim("topk_ids", topk_ids, (2,), "[tokens, top_k]")
    _utils.check_ndim("gate_up", gate_up, (3,), "[experts, 2*intermediate, hidden]")
    _utils.check_ndim("down", down, (3,), "[experts, hidden, intermediate]")
    n, hidden = x.shape
    experts = gate_up.shape[0]
    two_i, h_in = (gate_up.shape[2], gate_up.shape[1]) if transposed else gate_up.shape[1:]
    if h_in != hidden:
        dims = "hidden, 2*intermediate" if transposed else "2*intermediate, hidden"
        raise ValueError(
            f"gate_up must be [experts, {dims}]"
            f" with hidden = x's last dim {hidden}, got shape {tuple(gate_up.shape)}"
        )
    if two_i % 2:
        raise ValueError(f"gate_up's 2*intermediate dim must be even, got {two_i}")
    inter = two_i // 2
    _expect_shape(
        "down",
        down,
        (experts, inter, hidden) if transposed else (experts, hidden, inter),
        "[experts, ...] fitting gate_up:",
    )
    if topk_ids.shape[0] != n:
        raise ValueError(
            f"topk_ids must be [tokens, top_k] with x's {n} tokens, got shape "
            f"{tuple(topk_ids.shape)}"
        )
    _expect_shape("topk_weights", topk_weights, tuple(topk_ids.shape), "topk_ids' shape")
    _expect_shape("gate_up_bias", gate_up_bias, (experts, two_i), "[experts, 2*intermediate]")
    _expect_shape("down_bias", down_bias, (experts, hidden), "[experts, hidden]")
    for name, bias in (("gate_up_bias", gate_up_bias), ("down_bias", down_bias)):
        if bias is not None:
            check_floating(name, bias)
    if lora is not None:
        _check_lora(lora, experts, hidden, inter)
    tensors = {
        "x": x,
        "topk_ids": topk_ids,
        "topk_weights": topk_weights,
        "gate_up": gate_up,
        "down": down,
        "gate_up_bias": gate_up_bias,
        "down_bias": down_bias,
    }
    if lora is not None:
        tensors.update(
            {f"lora.{k}": v for k, v in lora._asdict().items() if isinstance(v, torch.Tensor)}
        )
    _utils.check_same_device(**tensors)
    dtype = _utils.matmul_dtype(x, gate_up, ("x", "gate_up"))
    if down.dtype != gate_up.dtype:
        raise TypeError(f"down must have gate_up's dtype {gate_up.dtype}, got {down.dtype}")
    return Layout(experts, topk_ids.shape[1], hidden, inter, dtype, transposed, interleaved)


def _check_lora(lora, experts, hidden, inter) -> None:
    if not isinstance(lora, MoeLora):
        raise TypeError(f"lora must be a fusetune MoeLora, got {type(lora).__name__}")
    check_number("lora.scaling", lora.scaling)
    check_number("lora.down_scaling", lora.down_scaling, optional=True)
    for prefix, fan_in, fan_out in (("gate_up", hidden, 2 * inter), ("down", inter, hidden)):
        a, b = getattr(lora, f"{prefix}_a"), getattr(lora, f"{prefix}_b")
        if (a is None) != (b is None):
            raise ValueError(f"lora.{prefix}_a and lora.{prefix}_b must both be given or both None")
        if a is None:
            continue
        check_floating(f"lora.{prefix}_a", a)
        check_floating(f"lora.{prefix}_b", b)
        _utils.check_ndim(f"lora.{prefix}_a", a, (3,), "[experts, r, in]")
        rank = a.shape[1]
        _expect_shape(f"lora.{prefix}_a", a, (experts, rank, fan_in), "[experts, r, in]")
        _expect_shape(f"lora.{prefix}_b", b, (experts, fan_out, rank), "[experts, out, r]")


# ----------------------------------------------------------------------------- the op


def moe_mlp(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    *,
    activation: str = "swiglu",
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    lora: MoeLora | None = None,
    transposed: bool = False,
    interleaved: bool = False,
    alpha: float = 1.702,
    limit: float = 7.0,
) -> torch.Tensor:
    """The expert MLP (module docstring) as a loop over experts; see :func:`fusetune.moe_mlp`."""
    layout = check_moe_args(
        x,
        topk_ids,
        topk_weights,
        gate_up,
        down,
        activation,
        gate_up_bias,
        down_bias,
        lora,
        transposed,
        interleaved,
        alpha,
        limit,
    )
    return moe_mlp_checked(
        x,
        topk_ids,
        topk_weights,
        gate_up,
        down,
        layout,
        activation,
        gate_up_bias,
        down_bias,
        lora,
        alpha,
        limit,
    )


def glu(gu: torch.Tensor, activation: str, interleaved: bool, alpha: float, limit: float):
    """act(gate, up) of gu [..., 2I] (either gate/up order)."""
    if interleaved:
        gate, up = gu[..., 0::2], gu[..., 1::2]
    else:
        gate, up = gu.chunk(2, dim=-1)
    if activation == "swiglu":
        return torch.nn.functional.silu(gate) * up
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def _lora_term(t, a, b, scaling, e, dtype):
    return scaling * ((t @ a[e].to(dtype).t()) @ b[e].to(dtype).t())


def moe_mlp_checked(
    x,
    topk_ids,
    topk_weights,
    gate_up,
    down,
    layout,
    activation,
    gate_up_bias=None,
    down_bias=None,
    lora=None,
    alpha=1.702,
    limit=7.0,
):
    """:func:`moe_mlp` after its argument checks."""
    dtype = layout.dtype
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    xc = x.to(dtype)
    out = torch.zeros(x.shape, dtype=acc, device=x.device)
    s_gu, s_d = lora.scalings if lora is not None else (0.0, 0.0)
    for e in range(layout.experts):
        tokens, slots = torch.where(topk_ids == e)
        if tokens.numel() == 0:
            continue
        w_gu = gate_up[e].t() if layout.transposed else gate_up[e]
        w_d = down[e].t() if layout.transposed else down[e]
        xe = xc[tokens]
        gu = xe @ w_gu.to(dtype).t()
        if gate_up_bias is not None:
            gu = gu + gate_up_bias[e].to(dtype)
        if lora is not None and lora.gate_up_a is not None:
            gu = gu + _lora_term(xe, lora.gate_up_a, lora.gate_up_b, s_gu, e, dtype)
        h = glu(gu, activation, layout.interleaved, alpha, limit)
        y = h @ w_d.to(dtype).t()
        if down_bias is not None:
            y = y + down_bias[e].to(dtype)
        if lora is not None and lora.down_a is not None:
            y = y + _lora_term(h, lora.down_a, lora.down_b, s_d, e, dtype)
        weight = topk_weights[tokens, slots].to(acc)
        out = out.index_add(0, tokens, y.to(acc) * weight[:, None])
    return out.to(dtype)
