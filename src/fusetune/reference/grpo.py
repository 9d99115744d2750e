"""Pure-PyTorch GRPO: per-token log-probs from hidden states, and the policy losses of TRL 1.16's
GRPOTrainer (grpo, bnpo, dr_grpo, dapo, cispo, sapo, luspo, vespo). The semantics of
:func:`fusetune.selective_log_softmax` and :func:`fusetune.grpo_loss`, their CPU path and the
tests' oracle. It materialises the logits; the fused ops never do.

With l the policy log-probs of the sampled tokens, m the completion mask, A the advantages [B],
sg() a stop-gradient:
    r = exp(l - old)                       (token level; old = l.detach() when not given)
    r_i = exp(sum_t m (l - old) / sum_t m) (sequence level: one ratio per sequence)
and per token (TRL's ``per_token_loss``)
    clipped (grpo, bnpo, dr_grpo, dapo, luspo): -min(min(r, delta) A, clip(r, 1 - eps_low,
        1 + eps_high) A)
    cispo: -sg(min(r, eps_high)) A l
    sapo:  -sigmoid(tau (r - 1)) 4 / tau A, tau = sapo_temperature_pos if A > 0 else _neg
    vespo: -sg(phi) A l, phi = exp(lambda + k log w - lambda w) per sequence, w the clamped
        sequence ratio exp(sum_t m clamp(l - old, -20, 20)) (``vespo_weights``)
plus beta k3(ref, l) (times r with ``use_bias_correction_kl``), k3 = exp(ref - l) - (ref - l) - 1.
The loss is sum_t w_t L_t with the aggregation weights w of ``token_weights``.
"""

from __future__ import annotations

import math
import warnings
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

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
# The PPO clipped surrogate (and its clip-ratio metrics); the others are TRL's alternatives.
CLIPPED_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
# The metrics of grpo_loss under the names TRL 1.16's GRPOTrainer logs them (same values).
TRL_METRIC_NAMES = {
    "kl": "kl",
    "clip_ratio_low": "clip_ratio/low_mean",
    "clip_ratio_high": "clip_ratio/high_mean",
    "clip_ratio": "clip_ratio/region_mean",
    "clip_ratio_low_min": "clip_ratio/low_min",
    "clip_ratio_high_max": "clip_ratio/high_max",
    "cispo_clip_ratio": "cispo_clip_ratio",
    "vespo_phi_seq_mean": "vespo/phi_seq_mean",
}
IGNORED_TOKEN = -100  # HF's ignore label: such a token's log-prob is 0, with no gradient


class LossOptions(NamedTuple):
    """The loss options of :func:`fusetune.grpo_loss`, with its defaults (TRL's GRPOConfig names,
    but ``epsilon_low`` for TRL's ``epsilon``; TRL defaults ``use_bias_correction_kl`` to True)."""

    beta: float = 0.0
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    delta: float | None = None
    loss_type: str = "grpo"
    importance_sampling_level: str = "token"
    max_completion_length: int | None = None
    num_items_in_batch: float | torch.Tensor | None = None
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    use_bias_correction_kl: bool = False


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


def check_grpo_options(*, ref_logps: torch.Tensor | None, **loss_options: object) -> None:
    """Check :class:`LossOptions` given as keywords. Warns, as TRL's GRPOTrainer does, for luspo
    at token level and vespo at sequence level (both well defined, neither the paper's setup)."""
    options = LossOptions(**loss_options)
    (beta, epsilon_low, epsilon_high, delta, loss_type, importance_sampling_level,
     max_completion_length, num_items_in_batch) = options[:8]  # fmt: skip
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
    for name in ("sapo_temperature_pos", "sapo_temperature_neg"):  # sapo divides by them
        check_number(name, getattr(options, name), low=0.0, low_inclusive=False)
    for name in ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"):
        check_number(name, getattr(options, name))
    if not isinstance(options.use_bias_correction_kl, bool):
        got = options.use_bias_correction_kl
        raise TypeError(f"use_bias_correction_kl must be a bool, got {got!r}")
    _warn_level(loss_type, importance_sampling_level)


def _warn_level(loss_type: str, level: str) -> None:
    if torch.compiler.is_compiling():  # a warning would break the graph; eager warned already
        return
    if loss_type == "luspo" and level != "sequence":
        warnings.warn(
            "loss_type 'luspo' is meant for importance_sampling_level='sequence' (the paper's "
            "setup); computing it at token level, as TRL does",
            stacklevel=5,
        )
    if loss_type == "vespo" and level != "token":
        warnings.warn(
            "loss_type 'vespo' computes its sequence weights from the token log-ratios itself: "
            "importance_sampling_level should be 'token' (it only changes the KL's bias "
            "correction)",
            stacklevel=5,
        )


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

    grpo, sapo: per-sequence mean, then mean over sequences; bnpo: mean over the batch's active
    tokens; dr_grpo: over B * max_completion_length; dapo, cispo, vespo: over num_items_in_batch
    (the active tokens of the whole generation batch, for gradient accumulation), else the
    active tokens; luspo: each sequence's sum (its loss times its length), mean over sequences."""
    mask = completion_mask.to(dtype)
    batch = mask.shape[0]
    if loss_type in ("grpo", "sapo"):
        return mask / (mask.sum(dim=-1, keepdim=True).clamp(min=1.0) * batch)
    if loss_type == "dr_grpo":
        return mask / (batch * max_completion_length)
    if loss_type == "luspo":
        return mask / batch
    if loss_type in ("dapo", "cispo", "vespo") and num_items_in_batch is not None:
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


# VESPO's clamps (TRL's, after the paper's code): log w in [log 1e-8, 20], each token's log-ratio
# in [-20, 20], lambda >= 1e-4.
VESPO_LOG_W_MIN = math.log(1e-8)
VESPO_LOG_RATIO_MAX = 20.0
VESPO_LAMBDA_MIN = 1e-4


def vespo_weights(
    token_log_ratio: torch.Tensor,
    completion_mask: torch.Tensor,
    advantages: torch.Tensor,
    options: LossOptions,
) -> torch.Tensor:
    """phi [B, 1], detached: VESPO's Gamma weight exp(lambda + k log w - lambda w) of each
    sequence's ratio w = exp(sum_t m clamp(l - old, -20, 20)) (a sum, not GSPO's mean), log w
    clamped to [log 1e-8, 20]; (k, lambda) = (vespo_k_pos, vespo_lambda_pos) when A >= 0, else
    the _neg pair; lambda at least 1e-4; a non-finite phi becomes 0 (TRL's get_gamma_weights,
    without its vLLM correction)."""
    mask = completion_mask.to(token_log_ratio.dtype)
    clamped = token_log_ratio.detach().clamp(-VESPO_LOG_RATIO_MAX, VESPO_LOG_RATIO_MAX)
    log_w = (clamped * mask).sum(-1, keepdim=True).clamp(VESPO_LOG_W_MIN, VESPO_LOG_RATIO_MAX)
    nonnegative = advantages.unsqueeze(-1) >= 0
    k = _pick(nonnegative, options.vespo_k_pos, options.vespo_k_neg, log_w)
    lam = _pick(nonnegative, options.vespo_lambda_pos, options.vespo_lambda_neg, log_w)
    lam = lam.clamp(min=VESPO_LAMBDA_MIN)
    phi = torch.exp(lam + k * log_w - lam * log_w.exp())
    return phi.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def _pick(condition: torch.Tensor, if_true: float, if_false: float, like: torch.Tensor):
    """torch.where of two numbers in ``like``'s dtype and shape (TRL's torch.where of Python
    scalars gives the default dtype, float32, whatever the log-probs' dtype), filled on the
    device: no host-to-device copy."""
    return torch.full_like(like, if_false).masked_fill(condition, if_true)


def sapo_temperatures(advantage: torch.Tensor, options: LossOptions) -> torch.Tensor:
    """tau per sequence: sapo_temperature_pos where A > 0, sapo_temperature_neg elsewhere."""
    pos, neg = options.sapo_temperature_pos, options.sapo_temperature_neg
    return _pick(advantage > 0, pos, neg, advantage)


def policy_loss(
    logps: torch.Tensor,
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    options: LossOptions,
    phi: torch.Tensor | None = None,
) -> torch.Tensor:
    """The policy term of each token's loss, [B, T] or [B, 1] (see the module docstring);
    ``phi`` is vespo's :func:`vespo_weights`."""
    advantage = advantages.to(logps.dtype).unsqueeze(-1)
    if options.loss_type == "cispo":
        return -ratio.clamp(max=options.epsilon_high).detach() * advantage * logps
    if options.loss_type == "sapo":
        tau = sapo_temperatures(advantage, options)
        return -(torch.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau) * advantage
    if options.loss_type == "vespo":
        return -phi * advantage * logps
    unclipped = ratio if options.delta is None else ratio.clamp(max=options.delta)
    clipped = ratio.clamp(1.0 - options.epsilon_low, 1.0 + options.epsilon_high)
    return -torch.minimum(unclipped * advantage, clipped * advantage)


def kl_term(
    logps: torch.Tensor, ratio: torch.Tensor, ref_logps: torch.Tensor, options: LossOptions
) -> torch.Tensor:
    """k3(ref, l), times the ratio r (differentiable) with ``use_bias_correction_kl``."""
    kl = k3_kl(logps, ref_logps)
    return kl * ratio if options.use_bias_correction_kl else kl


def per_token_loss(
    logps: torch.Tensor,
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    ref_logps: torch.Tensor | None,
    options: LossOptions,
    phi: torch.Tensor | None = None,
) -> torch.Tensor:
    """L [B, T]: the policy term plus beta times the KL term when beta != 0."""
    loss = policy_loss(logps, ratio, advantages, options, phi)
    if options.beta != 0:
        loss = loss + options.beta * kl_term(logps, ratio, ref_logps, options)
    return loss.expand(logps.shape)


def k3_kl(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """exp(ref - l) - (ref - l) - 1: an unbiased, non-negative estimate of KL(policy || ref)."""
    diff = ref_logps.to(logps.dtype) - logps
    return diff.exp() - diff - 1.0


def loss_terms(
    logps: torch.Tensor,
    completion_mask: torch.Tensor,
    advantages: torch.Tensor,
    old_logps: torch.Tensor | None,
    ref_logps: torch.Tensor | None,
    options: LossOptions,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(L [B, T], the ratio r ([B, T] or [B, 1]), vespo's phi [B, 1] or None)."""
    ratio, phi = ratio_and_phi(logps, completion_mask, advantages, old_logps, options)
    losses = per_token_loss(logps, ratio, advantages, ref_logps, options, phi)
    return losses, ratio, phi


def ratio_and_phi(
    logps: torch.Tensor,
    completion_mask: torch.Tensor,
    advantages: torch.Tensor,
    old_logps: torch.Tensor | None,
    options: LossOptions,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The ratio r at the options' level, and vespo's phi (None for the other loss types)."""
    level = options.importance_sampling_level
    ratio = log_ratio(logps, old_logps, completion_mask, level).exp()
    if options.loss_type != "vespo":
        return ratio, None
    token_log_ratio = log_ratio(logps, old_logps, completion_mask, "token")
    return ratio, vespo_weights(token_log_ratio, completion_mask, advantages, options)


def grpo_metrics(
    logps: torch.Tensor,
    ratio: torch.Tensor,
    completion_mask: torch.Tensor,
    advantages: torch.Tensor,
    ref_logps: torch.Tensor | None,
    options: LossOptions,
    phi: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Detached 0-dim metrics with TRL's meaning (its log names in brackets):
    "kl" [kl], when ref_logps is given: the mean KL term over active tokens (times r with
    use_bias_correction_kl, as TRL logs it).
    Clipped loss types: "clip_ratio_low" [clip_ratio/low_mean] (r < 1 - eps_low with A < 0),
    "clip_ratio_high" [clip_ratio/high_mean] (r > 1 + eps_high with A > 0), "clip_ratio"
    [clip_ratio/region_mean] (either), "clip_ratio_low_min" [clip_ratio/low_min] and
    "clip_ratio_high_max" [clip_ratio/high_max] (the extremes over sequences of each one's
    fraction; empty sequences skipped, NaN when all are empty).
    cispo: "cispo_clip_ratio" [cispo_clip_ratio] (r > eps_high with A > 0).
    vespo: "vespo_phi_seq_mean" [vespo/phi_seq_mean], the mean of phi over sequences.
    sapo: none beyond kl.
    A clip fraction is over active tokens at token level, over sequences (all of them, as TRL
    counts) at sequence level."""
    with torch.no_grad():
        mask = completion_mask.to(logps.dtype)
        advantage = advantages.to(logps.dtype).unsqueeze(-1)
        per_sequence = options.importance_sampling_level == "sequence"

        def mean(flags: torch.Tensor) -> torch.Tensor:
            values = flags.to(logps.dtype)
            if per_sequence:
                return values.sum() / values.shape[0]
            return (values * mask).sum() / mask.sum().clamp(min=1.0)

        metrics = {}
        if ref_logps is not None:
            kl = kl_term(logps, ratio, ref_logps, options)
            metrics["kl"] = (kl * mask).sum() / mask.sum().clamp(min=1.0)
        if options.loss_type in CLIPPED_LOSS_TYPES:
            low = (ratio < 1.0 - options.epsilon_low) & (advantage < 0)
            high = (ratio > 1.0 + options.epsilon_high) & (advantage > 0)
            metrics["clip_ratio_low"] = mean(low)
            metrics["clip_ratio_high"] = mean(high)
            metrics["clip_ratio"] = mean(low | high)
            low_by_sequence = _sequence_means(low.to(logps.dtype), mask, per_sequence)
            high_by_sequence = _sequence_means(high.to(logps.dtype), mask, per_sequence)
            metrics["clip_ratio_low_min"] = _nan_extreme(low_by_sequence, largest=False)
            metrics["clip_ratio_high_max"] = _nan_extreme(high_by_sequence, largest=True)
        elif options.loss_type == "cispo":
            metrics["cispo_clip_ratio"] = mean((ratio > options.epsilon_high) & (advantage > 0))
        elif options.loss_type == "vespo":
            metrics["vespo_phi_seq_mean"] = phi.sum() / phi.shape[0]
    return metrics


def _sequence_means(flags: torch.Tensor, mask: torch.Tensor, per_sequence: bool) -> torch.Tensor:
    """Each sequence's fraction of active tokens (NaN for an empty one), as TRL's
    masked_seq_mean; at sequence level the flags are already one per sequence."""
    if per_sequence:
        return flags.squeeze(-1)
    return (flags.expand(mask.shape) * mask).sum(-1) / mask.sum(-1)


def _nan_extreme(values: torch.Tensor, largest: bool) -> torch.Tensor:
    """The max (or min) over the non-NaN values, NaN if none (TRL's nanmax / nanmin)."""
    nan = values.isnan()
    filled = values.masked_fill(nan, -math.inf if largest else math.inf)
    extreme = filled.max() if largest else filled.min()
    return torch.where(nan.all(), math.nan, extreme)


def metrics_from_logps(
    logps: torch.Tensor,
    completion_mask: torch.Tensor,
    advantages: torch.Tensor,
    old_logps: torch.Tensor | None,
    ref_logps: torch.Tensor | None,
    options: LossOptions,
) -> dict[str, torch.Tensor]:
    """:func:`grpo_metrics` from detached log-probs (for the fused path, which computes its loss
    without these intermediates)."""
    ratio, phi = ratio_and_phi(logps, completion_mask, advantages, old_logps, options)
    return grpo_metrics(logps, ratio, completion_mask, advantages, ref_logps, options, phi)


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
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    vespo_k_pos: float = 2.0,
    vespo_lambda_pos: float = 3.0,
    vespo_k_neg: float = 3.0,
    vespo_lambda_neg: float = 2.0,
    use_bias_correction_kl: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(loss, metrics) from per-token log-probs [B, T]; differentiable in ``logps``. The options
    as in :func:`fusetune.grpo_loss` (not checked here)."""
    options = LossOptions(
        beta, epsilon_low, epsilon_high, delta, loss_type, importance_sampling_level,
        max_completion_length, num_items_in_batch, sapo_temperature_pos, sapo_temperature_neg,
        vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg, use_bias_correction_kl,
    )  # fmt: skip
    losses, ratio, phi = loss_terms(
        logps, completion_mask, advantages, old_logps, ref_logps, options
    )
    weights = token_weights(
        completion_mask, loss_type, max_completion_length, num_items_in_batch, logps.dtype
    )
    loss = (losses * weights).sum()
    metrics = grpo_metrics(logps, ratio, completion_mask, advantages, ref_logps, options, phi)
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
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    vespo_k_pos: float = 2.0,
    vespo_lambda_pos: float = 3.0,
    vespo_k_neg: float = 3.0,
    vespo_lambda_neg: float = 2.0,
    use_bias_correction_kl: bool = False,
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
        sapo_temperature_pos=sapo_temperature_pos,
        sapo_temperature_neg=sapo_temperature_neg,
        vespo_k_pos=vespo_k_pos,
        vespo_lambda_pos=vespo_lambda_pos,
        vespo_k_neg=vespo_k_neg,
        vespo_lambda_neg=vespo_lambda_neg,
        use_bias_correction_kl=use_bias_correction_kl,
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
