"""RMSNorm modules: hold the weight and options of :func:`fusetune.rms_norm` and
:func:`fusetune.rms_norm_gated`."""

from __future__ import annotations

import torch

from fusetune.ops.rms_norm import add_rms_norm, rms_norm, rms_norm_gated
from fusetune.reference.rms_norm import resolve_offset


class RMSNorm(torch.nn.Module):
    """``x / sqrt(mean(x^2) + eps) * (offset + weight)`` over the last dim.

    A drop-in for transformers' LlamaRMSNorm (defaults; the parameter is ``weight``, so state
    dicts load as they are) and, with ``casting="gemma"``, Gemma's RMSNorm (offset 1, weight
    initialised to zeros). ``forward(x)`` returns the normed x; ``forward(x, residual)``
    returns ``(rms_norm(x + residual), x + residual)`` through the fused residual-add kernel.
    See :func:`fusetune.rms_norm` for dtypes and errors.
    """

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        *,
        offset: float | None = None,
        casting: str = "llama",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.eps, self.casting = eps, casting
        self.offset = resolve_offset(offset, casting)
        # Gemma stores w with y = x * (1 + w): zeros make both forms the identity at init.
        init = torch.zeros if self.offset == 1.0 else torch.ones
        self.weight = torch.nn.Parameter(init(hidden_size, device=device, dtype=dtype))

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        options = dict(offset=self.offset, casting=self.casting)
        if residual is None:
            return rms_norm(x, self.weight, self.eps, **options)
        return add_rms_norm(x, residual, self.weight, self.eps, **options)

    def extra_repr(self) -> str:
        return (
            f"{tuple(self.weight.shape)}, eps={self.eps}, offset={self.offset}, "
            f"casting={self.casting!r}"
        )


class RMSNormGated(torch.nn.Module):
    """``rms_norm(x) * silu(gate)`` over the last dim (:func:`fusetune.rms_norm_gated`).

    A drop-in for transformers' Qwen3_5RMSNormGated / Qwen3NextRMSNormGated (the output norm
    of their Gated DeltaNet layers): ``forward(x, gate)``, the parameter ``weight`` initialised
    to ones, casting "llama". See :func:`fusetune.rms_norm_gated` for dtypes and errors.
    """

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return rms_norm_gated(x, gate, self.weight, self.eps, offset=0.0, casting="llama")

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"
