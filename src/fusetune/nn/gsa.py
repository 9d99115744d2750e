"""GatedSlotAttention: a drop-in token-mixing layer around fusetune.gated_slot_attention."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fusetune.ops.linear_attention import gated_slot_attention

FEATURE_MAPS = {
    "swish": F.silu,
    "relu": F.relu,
    "identity": lambda x: x,
}


class GatedSlotAttention(torch.nn.Module):
    """Gated slot attention layer (Zhang et al., 2024), shaped like a transformers attention
    module: ``forward(hidden_states, attention_mask=None, **kwargs) -> (output, None)``.

    Per token: q = φ(W_q x), k = φ(W_k x), v = silu(W_v x) (φ = ``feature_map``),
    f = W_f x with one logit per slot and key/value head, g = logsigmoid(f) /
    ``gate_logit_normalizer`` (log forget gates, fp32), s = 1 - exp(g) (what a slot forgets it
    writes); o = gated_slot_attention(q, k, v, s, g); output = W_o rmsnorm(silu(o)).

    Args:
        hidden_size: model width.
        num_heads: query heads; ``num_kv_heads`` (default: the same) key/value/slot heads, a
            divisor of num_heads.
        num_slots: M, memory slots per head.
        head_dim: default hidden_size // num_heads.
        gate_logit_normalizer: divides logsigmoid(f); larger means slower forgetting.
        feature_map: "swish", "relu" or "identity" on q and k.
        norm_eps: eps of the per-head output RMSNorm.
        mode: "chunk" (training) or "recurrent" (decoding), see gated_slot_attention.
        layer_idx: accepted for transformers compatibility.

    ``attention_mask``: a 2-D [B, T] padding mask (1 = token, 0 = padding) makes padded tokens
    neither write nor decay the memory; other masks are ignored (the op is causal by
    construction; pack sequences with ``cu_seqlens=`` in kwargs instead of padding them).
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int | None = None,
        num_slots: int = 64,
        head_dim: int | None = None,
        gate_logit_normalizer: float = 8.0,
        feature_map: str = "swish",
        norm_eps: float = 1e-5,
        mode: str = "chunk",
        layer_idx: int | None = None,
        bias: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        head_dim = hidden_size // num_heads if head_dim is None else head_dim
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
            )
        if feature_map not in FEATURE_MAPS:
            raise ValueError(
                f"feature_map must be one of {', '.join(map(repr, FEATURE_MAPS))}; got "
                f"{feature_map!r}"
            )
        if not gate_logit_normalizer > 0:
            raise ValueError(f"gate_logit_normalizer must be > 0, got {gate_logit_normalizer}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.num_slots, self.gate_logit_normalizer = num_slots, float(gate_logit_normalizer)
        self.feature_map, self.norm_eps, self.mode = feature_map, norm_eps, mode
        self.layer_idx = layer_idx
        factory = dict(device=device, dtype=dtype)

        def linear(n_in: int, n_out: int, with_bias: bool = bias) -> torch.nn.Linear:
            return torch.nn.Linear(n_in, n_out, bias=with_bias, **factory)

        self.q_proj = linear(hidden_size, num_heads * head_dim)
        self.k_proj = linear(hidden_size, num_kv_heads * head_dim)
        self.v_proj = linear(hidden_size, num_kv_heads * head_dim)
        self.f_proj = linear(hidden_size, num_kv_heads * num_slots)
        self.g_norm_weight = torch.nn.Parameter(torch.ones(head_dim, **factory))
        self.o_proj = linear(num_heads * head_dim, hidden_size)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *args: object,
        cu_seqlens: torch.Tensor | None = None,
        **kwargs: object,
    ) -> tuple[torch.Tensor, None]:
        batch, seq_len, _ = hidden_states.shape
        phi = FEATURE_MAPS[self.feature_map]
        q = phi(self.q_proj(hidden_states)).view(batch, seq_len, self.num_heads, self.head_dim)
        k = phi(self.k_proj(hidden_states)).view(batch, seq_len, self.num_kv_heads, -1)
        v = F.silu(self.v_proj(hidden_states)).view(batch, seq_len, self.num_kv_heads, -1)
        f = self.f_proj(hidden_states).view(batch, seq_len, self.num_kv_heads, -1)
        g = F.logsigmoid(f.float()) / self.gate_logit_normalizer
        s = 1 - g.exp()
        if attention_mask is not None and attention_mask.dim() == 2:
            keep = attention_mask[:, -seq_len:, None, None].to(g.dtype)
            g, s = g * keep, s * keep  # padding: no decay, nothing written
        o = gated_slot_attention(q, k, v, s.to(q.dtype), g, cu_seqlens=cu_seqlens, mode=self.mode)
        o = F.rms_norm(F.silu(o), (self.head_dim,), self.g_norm_weight.to(o.dtype), self.norm_eps)
        return self.o_proj(o.reshape(batch, seq_len, -1)), None

    def extra_repr(self) -> str:
        return (
            f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"slots={self.num_slots}, feature_map={self.feature_map!r}, "
            f"gate_logit_normalizer={self.gate_logit_normalizer:g}, mode={self.mode!r}"
        )
