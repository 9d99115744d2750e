"""Gated MLP block: gate/up/down projections around the fused SwiGLU or GeGLU activation."""

from __future__ import annotations

import torch

from fusetune.ops.activation import geglu, swiglu

ACTIVATIONS = ("silu", "gelu", "gelu_tanh")


class GatedMLP(torch.nn.Module):
    """``down_proj(act(gate_proj(x)) * up_proj(x))`` with the activation and the product fused.

    Parameter names match transformers' LlamaMLP / GemmaMLP, so their state dicts load as they
    are. ``activation``: "silu" (SwiGLU: Llama, Mistral, Qwen), "gelu" (exact GeGLU) or
    "gelu_tanh" (Gemma's gelu_pytorch_tanh). Under autocast the projections run in the autocast
    dtype and the fused activation keeps theirs.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        activation: str = "silu",
        *,
        bias: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(
                f"activation must be one of {', '.join(map(repr, ACTIVATIONS))}; got {activation!r}"
            )
        self.activation = activation
        factory = dict(bias=bias, device=device, dtype=dtype)
        self.gate_proj = torch.nn.Linear(hidden_size, intermediate_size, **factory)
        self.up_proj = torch.nn.Linear(hidden_size, intermediate_size, **factory)
        self.down_proj = torch.nn.Linear(intermediate_size, hidden_size, **factory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        if self.activation == "silu":
            hidden = swiglu(gate, up)
        else:
            hidden = geglu(gate, up, "tanh" if self.activation == "gelu_tanh" else "none")
        return self.down_proj(hidden)

    def extra_repr(self) -> str:
        return f"activation={self.activation!r}"


class SwiGLUMLP(GatedMLP):
    """:class:`GatedMLP` with SwiGLU (LlamaMLP)."""

    def __init__(self, hidden_size: int, intermediate_size: int, **kwargs) -> None:
        super().__init__(hidden_size, intermediate_size, "silu", **kwargs)


class GeGLUMLP(GatedMLP):
    """:class:`GatedMLP` with GeGLU, tanh-approximated by default (GemmaMLP)."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, approximate: str = "tanh", **kwargs
    ) -> None:
        if approximate not in ("none", "tanh"):
            raise ValueError(f"approximate must be one of 'none', 'tanh'; got {approximate!r}")
        activation = "gelu_tanh" if approximate == "tanh" else "gelu"
        super().__init__(hidden_size, intermediate_size, activation, **kwargs)
