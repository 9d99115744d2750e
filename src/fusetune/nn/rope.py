"""Rotary embedding module: a cos/sin table plus :func:`fusetune.rope`."""

from __future__ import annotations

import torch

from fusetune.ops.rope import rope


class RotaryEmbedding(torch.nn.Module):
    """Rotates q and k by position: ``forward(q, k, position_ids=None)`` -> ``(q, k)``.

    Args:
        rotary_dim: dims of each head that rotate (even; the head_dim for full rotary).
        max_positions: rows of the cos/sin table (positions 0 .. max_positions - 1).
        base: the frequency base (theta): frequency p is base^(-2p / rotary_dim).
        layout: "BTHD" or "BHTD", the layout of q and k.
        interleaved: GPT-J pairs (2p, 2p + 1) instead of the half-split (p, p + R/2).

    The table is built in fp64 and kept in fp32 (a non-persistent buffer). Without
    ``position_ids`` token t gets position t. Frequency scaling (Llama 3, YaRN, ...) is the
    caller's: pass your own cos/sin to :func:`fusetune.rope` then.
    """

    def __init__(
        self,
        rotary_dim: int,
        max_positions: int,
        base: float = 10000.0,
        *,
        layout: str = "BTHD",
        interleaved: bool = False,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if rotary_dim <= 0 or rotary_dim % 2:
            raise ValueError(f"rotary_dim must be a positive even int, got {rotary_dim}")
        self.layout, self.interleaved = layout, interleaved
        inv_freq = base ** (
            -torch.arange(0, rotary_dim, 2, dtype=torch.float64, device=device) / rotary_dim
        )
        angles = torch.outer(
            torch.arange(max_positions, dtype=torch.float64, device=device), inv_freq
        )
        if interleaved:
            angles = angles.repeat_interleave(2, dim=-1)
        else:
            angles = torch.cat((angles, angles), dim=-1)
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, position_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if position_ids is None:
            seq_len = q.shape[1 if self.layout == "BTHD" else 2]
            cos, sin = self.cos[:seq_len], self.sin[:seq_len]
        else:
            cos, sin = self.cos, self.sin
        return rope(
            q,
            k,
            cos,
            sin,
            position_ids=position_ids,
            layout=self.layout,
            interleaved=self.interleaved,
        )

    def extra_repr(self) -> str:
        return (
            f"rotary_dim={self.cos.shape[-1]}, max_positions={self.cos.shape[0]}, "
            f"layout={self.layout!r}, interleaved={self.interleaved}"
        )
