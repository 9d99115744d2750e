"""Pure-PyTorch GRPO: per-token log-probs from hidden states, and the GRPO / DAPO / Dr. GRPO
policy loss. The semantics of :func:`fusetune.selective_log_softmax` and
:func:`fusetune.grpo_loss`, their CPU path and the tests' oracle. It materialises the logits;
the fused ops never do.

With l the policy log-probs of the sampled tokens, m the completion mask, A the advantages [B]:
    r = exp(l - old)                       (token level; old = l.detach() when not given)
    r_i = exp(sum_t m (l - old) / sum_t m) (sequence level: one ratio per sequence)
    L = -min(min(r, delta) A, clip(r, 1 - eps_low, 1 + eps_high) A) + beta k3(ref, l)
    k3(ref, l) = exp(ref - l) - (ref - l) - 1
and the loss is sum_t w_t L_t with the aggregation weights w of ``token_weights``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from fusetune._utils import (
    check_choice,
    check_floating,
    check_integer,
    check_number,
    check_same_device,
)
from fusetune.reference.cross_entropy import check_item_count, check_labels_in_range
from fusetune.reference.linear_cross_entropy import check_lm_head, matmul_dtype

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
IGNORED_TOKEN = -100  # HF's ignore label: such a token's log-prob is 0, with no gradient


class HeadOutput(NamedTuple):
    """Per-token outputs of :func:`fusetune.selective_log_softmax` with ``return_entropy`` or
    ``return_top1``: fp32 log-probs, fp32 entropy (or None), bool top-1 match (or None)."""

    log_probs: torch.Tensor
    entropy: torch.Tensor | None
    is_top1: torch.Tensor | None


# ============================================================================ argument checks


def check_logit_options(
    temperature: float, logit_softcap: float | None, logit_scale: float | None
) -> None:
    check_number("temperature", temperature, low=0.0, low_inclusive=False)
    check_number("logit_softcap", logit_softcap, low=0.0, low_inclusive=False, optional=True)
    check_number("logit_scale", logit_scale, low=0.0, low_inclusive=False, optional=True)


def check_selective_log_softmax_args(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    token_ids: torch.Tensor,
    bias: torch.Tensor | None,
    hidden_ndims: tuple[int, ...] = (2, 3),
    hidden_layout: str = "[N, H] or [B, T, H]",
    **logit_options: float | None,
) -> None:
    check_lm_head(hidden, weight, hidden_ndims, hidden_layout)
    check_integer("token_ids", token_ids)
    _check_shape("token_ids", token_ids, hidden.shape[:-1], "hidden's leading dims")
    if bias is not None:
        check_floating("bias", bias)
        _check_shape("bias", bias, weight.shape[:1], "weight's rows")
    check_same_device(hidden=hidden, weight=weight, token_ids=token_ids, bias=bias)
    check_logit_options(**logit_options)


def check_grpo_args(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    token_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    advantages: torch.Tensor,
    *,
    old_logps: torch.Tensor | None,
    ref_logps: torch.Tensor | None,
    bias: torch.Tensor | None,
    loss_options: dict,
    logit_options: dict,
) -> None:
    """The checks :func:`fusetune.grpo_loss` and this reference share."""
    check_selective_log_softmax_args(
        hidden,
        weight,
        token_ids,
        bias,
        hidden_ndims=(3,),
        hidden_layout="[B, T, H] (one row of completion tokens per sequence)",
        **logit_options,
    )
    batch_and_time = hidden.shape[:-1]
    _check_shape("completion_mask", completion_mask, batch_and_time, "hidden's [B, T]")
    check_floating("advantages", advantages)
    _check_shape("advantages", advantages, batch_and_time[:1], "one per sequence, [B]")
    for name, logps in (("old_logps", old_logps), ("ref_logps", ref_logps)):
        if logps is not None:
            check_floating(name, logps)
            _check_shape(name, logps, batch_and_time, "hidden's [B, T]")
    check_same_device(
        hidden=hidden,
        completion_mask=completion_mask,
        advantages=advantages,
        old_logps=old_logps,
        ref_logps=ref_logps,
    )
    check_grpo_options(ref_logps=ref_logps, **loss_options)


def check_grpo_options(
    *,
    beta: float,
    epsilon_low: float,
    epsilon_high: float,
    delta: float | None,
    loss_type: str,
    importance_sampling_level: str,
    max_completion_length: int | None,
    num_items_in_batch: float | torch.Tensor | None,
    ref_logps: torch.Tensor | None,
) -> None:
    check_choice("loss_type", loss_type, LOSS_TYPES)
    check_choice("importance_sampling_level", importance_sampling_level, IMPORTANCE_SAMPLING_LEVELS)
    check_number("beta", beta)
    if beta != 0 and ref_logps is None:
        raise ValueError("beta != 0 adds a KL penalty to the reference policy: pass ref_logps")
    check_number("epsilon_low", epsilon_low, low=0.0, high=1.0)
    check_number("epsilon_high", epsilon_high, low=0.0)
    check_number("delta", delta, low=1.0, optional=True)
    if loss_type == "dr_grpo" and max_completion_length is None:
        raise ValueError("loss_type 'dr_grpo' divides by B * max_completion_length: pass it")
    check_number("max_completion_length", max_completion_length, low=1, optional=True)
    check_item_count("num_items_in_batch", num_items_in_batch)


def _check_shape(name: str, tensor: torch.Tensor, shape: torch.Size, meaning: str) -> None:
    if tuple(tensor.shape) != tuple(shape):
        raise ValueError(
            f"{name} must have shape {tuple(shape)} ({meaning}), got {tuple(tensor.shape)}"
        )


# ============================================================================ log-probs


def selective_log_softmax(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    token_ids: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    logit_softcap: float | None = None,
    logit_scale: float | None = None,
    chunk_size: int | None = None,
    return_entropy: bool = False,
    return_top1: bool = False,
):
    """Reference for :func:`fusetune.selective_log_softmax` (same signature and semantics;
    ``chunk_size`` has no effect here)."""
    check_selective_log_softmax_args(
        hidden,
        weight,
        token_ids,
        bias,
        temperature=temperature,
        logit_softcap=logit_softcap,
        logit_scale=logit_scale,
    )
    if token_ids.device.type == "cpu":  # on CUDA this check would sync the host
        check_labels_in_range(token_ids, weight.shape[0], IGNORED_TOKEN, name="token_ids")
    dtype = matmul_dtype(hidden, weight)
    logits = F.linear(hidden.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype))
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if logit_scale is not None:
        logits = logits * logit_scale
    if logit_softcap is not None:
        logits = logit_softcap * torch.tanh(logits / logit_softcap)
    logits = logits / temperature
    log_probs = logits.log_softmax(dim=-1)
    ignored = token_ids == IGNORED_TOKEN
    safe_ids = token_ids.masked_fill(ignored, 0).long()
    picked = log_probs.gather(-1, safe_ids.unsqueeze(-1)).squeeze(-1).masked_fill(ignored, 0.0)
    if not (return_entropy or return_top1):
        return picked
    entropy = None
    if return_entropy:
        probs = log_probs.exp()
        entropy = -(probs * log_probs.masked_fill(probs == 0, 0.0)).sum(-1).masked_fill(ignored, 0)
    is_top1 = None
    if return_top1:  # argmax picks the first maximum
        is_top1 = (logits.argmax(dim=-1) == safe_ids) & ~ignored
    return HeadOutput(picked, entropy, is_top1)


# ============================================================================ the loss


def token_weights(
    completion_mask: torch.Tensor,
    loss_type: str,
    max_completion_length: int | None,
    num_items_in_batch: float | torch.Tensor | None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """w [B, T] with loss = sum_t w_t L_t: the mask over each loss type's denominator.

    grpo: per-sequence mean, then mean over sequences; bnpo: mean over the batch's active
    tokens; dr_grpo: over B * max_completion_length; dapo: over num_items_in_batch (the active
    tokens of the whole generation batch, for gradient accumulation), else the active tokens."""
    mask = completion_mask.to(dtype)
    batch = mask.shape[0]
    if loss_type == "grpo":
        return mask / (mask.sum(dim=-1, keepdim=True).clamp(min=1.0) * batch)
    if loss_type == "dr_grpo":
        return mask / (batch * max_completion_length)
    if loss_type == "dapo" and num_items_in_batch is not None:
        if isinstance(num_items_in_batch, torch.Tensor):
            return mask / num_items_in_batch.to(device=mask.device, dtype=dtype).reshape(())
        return mask / num_items_in_batch
    return mask / mask.sum().clamp(min=1.0)


def log_ratio(
    logps: torch.Tensor,
    old_logps: torch.Tensor | None,
    completion_mask: torch.Tensor,
    importance_sampling_level: str,
) -> torch.Tensor:
    """log r: [B, T] at token level, [B, 1] at sequence level (the mask-mean of the token's)."""
    old = logps.detach() if old_logps is None else old_logps.to(logps.dtype)
    per_token = logps - old
    if importance_sampling_level == "token":
        return per_token
    mask = completion_mask.to(logps.dtype)
    return (per_token * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)


def per_token_loss(
    logps: torch.Tensor,
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    ref_logps: torch.Tensor | None,
    *,
    beta: float,
    epsilon_low: float,
    epsilon_high: float,
    delta: float | None,
) -> torch.Tensor:
    """L [B, T]: the clipped surrogate, plus beta times the k3 KL estimate when beta != 0."""
    advantage = advantages.to(logps.dtype).unsqueeze(-1)
    unclipped = ratio if delta is None else ratio.clamp(max=delta)
    clipped = ratio.clamp(1.0 - epsilon_low, 1.0 + epsilon_high)
    loss = -torch.minimum(unclipped * advantage, clipped * advantage)
    if beta != 0:
        loss = loss + beta * k3_kl(logps, ref_logps)
    return loss.expand(logps.shape)


def k3_kl(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """exp(ref - l) - (ref - l) - 1: an unbiased, non-negative estimate of KL(policy || ref)."""
    diff = ref_logps.to(logps.dtype) - logps
    return diff.exp() - diff - 1.0


def grpo_metrics(
    logps: torch.Tensor,
    ratio: torch.Tensor,
    completion_mask: torch.Tensor,
    advantages: torch.Tensor,
    ref_logps: torch.Tensor | None,
    epsilon_low: float,
    epsilon_high: float,
) -> dict[str, torch.Tensor]:
    """Detached means over active tokens: "kl" (when ref_logps is given), and the fraction of
    tokens whose objective is clipped: "clip_ratio_low" (r < 1 - eps_low with A < 0),
    "clip_ratio_high" (r > 1 + eps_high with A > 0) and "clip_ratio" (either), as TRL logs."""
    with torch.no_grad():
        mask = completion_mask.to(logps.dtype)
        active = mask.sum().clamp(min=1.0)
        advantage = advantages.to(logps.dtype).unsqueeze(-1)
        low = ((ratio < 1.0 - epsilon_low) & (advantage < 0)).expand(logps.shape)
        high = ((ratio > 1.0 + epsilon_high) & (advantage > 0)).expand(logps.shape)
        metrics = {}
        if ref_logps is not None:
            metrics["kl"] = (k3_kl(logps, ref_logps) * mask).sum() / active
        metrics["clip_ratio_low"] = (low * mask).sum() / active
        metrics["clip_ratio_high"] = (high * mask).sum() / active
        metrics["clip_ratio"] = ((low | high) * mask).sum() / active
    return metrics


def grpo_loss_from_logps(
    logps: torch.Tensor,
    completion_mask: torch.Tensor,
    advantages: torch.Tensor,
    *,
    old_logps: torch.Tensor | None = None,
    ref_logps: torch.Tensor | None = None,
    beta: float = 0.0,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    delta: float | None = None,
    loss_type: str = "grpo",
    importance_sampling_level: str = "token",
    max_completion_length: int | None = None,
    num_items_in_batch: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(loss, metrics) from per-token log-probs [B, T]; differentiable in ``logps``."""
    ratio = log_ratio(logps, old_logps, completion_mask, importance_sampling_level).exp()
    losses = per_token_loss(
        logps,
        ratio,
        advantages,
        ref_logps,
        beta=beta,
        epsilon_low=epsilon_low,
        epsilon_high=epsilon_high,
        delta=delta,
    )
    weights = token_weights(
        completion_mask, loss_type, max_completion_length, num_items_in_batch, logps.dtype
    )
    loss = (losses * weights).sum()
    metrics = grpo_metrics(
        logps, ratio, completion_mask, advantages, ref_logps, epsilon_low, epsilon_high
    )
    return loss, metrics


def grpo_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    token_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    advantages: torch.Tensor,
    *,
    old_logps: torch.Tensor | None = None,
    ref_logps: torch.Tensor | None = None,
    beta: float = 0.0,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    delta: float | None = None,
    temperature: float = 1.0,
    loss_type: str = "grpo",
    importance_sampling_level: str = "token",
    max_completion_length: int | None = None,
    num_items_in_batch: float | torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    logit_softcap: float | None = None,
    logit_scale: float | None = None,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Reference for :func:`fusetune.grpo_loss` (same signature and semantics; ``chunk_size``
    has no effect here)."""
    loss_options = dict(
        beta=beta,
        epsilon_low=epsilon_low,
        epsilon_high=epsilon_high,
        delta=delta,
        loss_type=loss_type,
        importance_sampling_level=importance_sampling_level,
        max_completion_length=max_completion_length,
        num_items_in_batch=num_items_in_batch,
    )
    logit_options = dict(
        temperature=temperature, logit_softcap=logit_softcap, logit_scale=logit_scale
    )
    check_grpo_args(
        hidden,
        weight,
        token_ids,
        completion_mask,
        advantages,
        old_logps=old_logps,
        ref_logps=ref_logps,
        bias=bias,
        loss_options=loss_options,
        logit_options=logit_options,
    )
    logps = selective_log_softmax(hidden, weight, token_ids, bias=bias, **logit_options)
    return grpo_loss_from_logps(
        logps,
        completion_mask,
        advantages,
        old_logps=old_logps,
        ref_logps=ref_logps,
        **loss_options,
    )
