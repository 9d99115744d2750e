"""Pure-PyTorch gated delta rule (Yang, Kautz & Hatamizadeh, "Gated Delta Networks", 2024): the
semantics of :func:`fusetune.gated_delta_rule`, its CPU path and the tests' oracle.

Per sequence and value head, with a state S [K, V] (fp32, or fp64 when an input is fp64):
    S = exp(g_t) * S                      # forget
    u_t = S^T k_t                         # what the state predicts for k_t
    S = S + k_t (beta_t * (v_t - u_t))^T  # delta rule: write the correction only
    o_t = scale * S^T q_t
The token loop is slow and obviously right. Also here: the argument checks the op shares.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fusetune import _utils
from fusetune.reference._linear_attention import check_one_dtype, check_options

MODES = ("chunk", "recurrent")
L2NORM_EPS = 1e-6  # FLA's and transformers' eps: x * rsqrt(sum(x^2) + eps)


@dataclass(frozen=True)
class Shapes:
    """Sizes read off the inputs. ``n_seq``: B, or len(cu_seqlens) - 1 for packed input."""

    batch: int
    seq_len: int
    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    n_seq: int

    @property
    def group(self) -> int:
        """Value heads per query/key head (grouped value attention, as Qwen3.5 uses it)."""
        return self.value_heads // self.key_heads


def check_gated_delta_args(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    cu_seqlens: torch.Tensor | None,
    use_qk_l2norm_in_kernel: bool,
    mode: str,
) -> Shapes:
    """Validate the inputs of :func:`fusetune.gated_delta_rule`; return their sizes. Every
    message names the argument, what it got and what was expected."""
    for name, tensor in {"q": q, "k": k, "v": v, "g": g, "beta": beta}.items():
        _utils.check_floating(name, tensor)
    _utils.check_choice("mode", mode, MODES)
    _utils.check_ndim("q", q, (4,), "[B, T, HK, K]")
    _utils.check_ndim("k", k, (4,), "[B, T, HK, K]")
    _utils.check_ndim("v", v, (4,), "[B, T, HV, V]")
    _utils.check_ndim("g", g, (3,), "[B, T, HV]")
    _utils.check_ndim("beta", beta, (3,), "[B, T, HV] (one beta per token and value head)")
    batch, seq_len, key_heads, key_dim = q.shape
    value_heads, value_dim = v.shape[2], v.shape[3]
    if tuple(k.shape) != tuple(q.shape):
        raise ValueError(
            f"k must be shaped like q [B, T, HK, K], got q {tuple(q.shape)}, k {tuple(k.shape)}"
        )
    if tuple(v.shape[:2]) != (batch, seq_len):
        raise ValueError(
            f"v must have q's batch and time sizes [B, T, HV, V], got q {tuple(q.shape)}, "
            f"v {tuple(v.shape)}"
        )
    if value_heads % key_heads:
        raise ValueError(
            f"v's head count ({value_heads}) must be a multiple of q/k's ({key_heads}) (each "
            "query/key head serves HV / HK consecutive value heads)"
        )
    for name, tensor in (("g", g), ("beta", beta)):
        if tuple(tensor.shape) != (batch, seq_len, value_heads):
            raise ValueError(
                f"{name} must be [B, T, HV] = {[batch, seq_len, value_heads]} (HV = v's heads), "
                f"got {tuple(tensor.shape)}"
            )
    check_one_dtype({"q": q, "k": k, "v": v}, "g, beta and initial_state")
    flags = {
        "output_final_state": output_final_state,
        "use_qk_l2norm_in_kernel": use_qk_l2norm_in_kernel,
    }
    n_seq = check_options(scale, flags, cu_seqlens, batch, seq_len)
    shapes = Shapes(batch, seq_len, key_heads, value_heads, key_dim, value_dim, n_seq)
    if initial_state is not None:
        _utils.check_floating("initial_state", initial_state)
        want = (n_seq, value_heads, key_dim, value_dim)
        if tuple(initial_state.shape) != want:
            raise ValueError(
                f"initial_state must be [N, HV, K, V] = {list(want)} (N = number of sequences), "
                f"got {tuple(initial_state.shape)}"
            )
    _utils.check_same_device(
        q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state, cu_seqlens=cu_seqlens
    )
    return shapes


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """x * rsqrt(sum(x^2) + 1e-6) over the last dim, as FLA and transformers normalise q and k."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


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
    """Same arguments and results as :func:`fusetune.gated_delta_rule` (``mode`` is accepted
    and ignored: both modes are this one recurrence). Differentiable by autograd."""
    shapes = check_gated_delta_args(
        q,
        k,
        v,
        g,
        beta,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        mode=mode,
    )
    work, out_dtype = torch.promote_types(q.dtype, torch.float32), v.dtype
    q, k, v, g, beta = (x.to(work) for x in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    scale = shapes.key_dim**-0.5 if scale is None else float(scale)
    q, k = (x.repeat_interleave(shapes.group, dim=2) for x in (q, k))
    if cu_seqlens is None:
        bounds = [(b, 0, shapes.seq_len) for b in range(shapes.batch)]
    else:
        offsets = cu_seqlens.tolist()
        bounds = [(0, offsets[n], offsets[n + 1]) for n in range(shapes.n_seq)]
    outputs, finals = [], []
    for n, (b, start, end) in enumerate(bounds):
        state = (
            torch.zeros(
                shapes.value_heads, shapes.key_dim, shapes.value_dim, dtype=work, device=q.device
            )
            if initial_state is None
            else initial_state[n].to(work)
        )
        piece = (x[b, start:end] for x in (q, k, v, g, beta))
        o, state = _recurrence(*piece, state, scale)
        outputs.append(o)
        finals.append(state)
    o = torch.stack(outputs) if cu_seqlens is None else torch.cat(outputs)[None]
    final = torch.stack(finals).float() if output_final_state else None
    if work == torch.float64:
        final = None if final is None else final.double()
    return o.to(out_dtype), final


def _recurrence(q, k, v, g, beta, state, scale):
    """One sequence: q, k [T, H, K], v [T, H, V], g, beta [T, H], state [H, K, V]."""
    outputs = []
    for t in range(q.shape[0]):
        state = state * g[t].exp()[:, None, None]
        predicted = torch.einsum("hkv,hk->hv", state, k[t])
        correction = beta[t][:, None] * (v[t] - predicted)
        state = state + k[t][:, :, None] * correction[:, None, :]
        outputs.append(scale * torch.einsum("hkv,hk->hv", state, q[t]))
    if not outputs:
        return q.new_zeros(0, v.shape[1], v.shape[2]), state
    return torch.stack(outputs), state
