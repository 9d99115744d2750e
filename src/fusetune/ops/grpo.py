"""GRPO from hidden states: per-token log-probs and the policy loss without the [N, V] logits.

``selective_log_softmax`` is linear cross-entropy with reduction "none" (log p = -loss), the
temperature folded into the logit scale and softcap, which is exact:
    cap * tanh(s x / cap) / T  ==  (cap / T) * tanh((s / T) x / (cap / T)).

``grpo_loss`` at token level (the default) computes its gradients inside the forward, as linear
cross-entropy does with a scalar upstream gradient. A token's loss depends on its own log-prob
alone, so once a chunk's log-probs are known its dloss/dl is too: the cross-entropy gradient
kernel writes d(sum_t c_t l_t)/dlogits over the chunk's logits in place, and two matmuls give
the chunk's hidden gradient and its share of the weight gradient. Three matmuls in all; backward
only rescales. At sequence level a token's gradient needs its whole sequence's ratio (and VESPO's
its whole sequence's weight, whenever old log-probs are given), so the log-probs come first and
the gradient recomputes the logits (four matmuls).
"""

from __future__ import annotations

import torch

from fusetune import _utils
from fusetune.ops import cross_entropy as ce
from fusetune.ops import lm_head
from fusetune.ops.linear_cross_entropy import (
    _Grads,
    _logit_chunks,
    linear_cross_entropy,
    own_dtypes,
    scale_fused_grads,
)
from fusetune.ops.lm_head import HeadOutput
from fusetune.reference import grpo as reference
from fusetune.reference.cross_entropy import check_labels_in_range
from fusetune.reference.linear_cross_entropy import matmul_dtype

# The GRPO step may take 1.5 GiB above its inputs (issue 4), linear cross-entropy's 1.2: a
# chunk's logits take a quarter of the weight's bytes, not an eighth. At B=8, T=1024, H=4096,
# V=128256 on an H100 that is 1024 rows: 43.0 ms and 1.29 GiB, against 45.9 ms and 1.16 GiB
# with 512 (tools/tune_grpo.py; NOTES.md).
LOGITS_WEIGHT_FRACTION = 4

# ============================================================================ log-probs


def _fold_temperature(
    temperature: float, logit_scale: float | None, logit_softcap: float | None
) -> tuple[float | None, float | None]:
    """(scale, softcap) whose cross-entropy transform equals softcap(scale x) / temperature."""
    if temperature == 1.0:
        return logit_scale, logit_softcap
    scale = (1.0 if logit_scale is None else logit_scale) / temperature
    return scale, None if logit_softcap is None else logit_softcap / temperature


def _check_ids_on_cpu(token_ids: torch.Tensor, vocab: int) -> None:
    if token_ids.device.type == "cpu" and not torch.compiler.is_compiling():
        check_labels_in_range(token_ids, vocab, reference.IGNORED_TOKEN, name="token_ids")


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
) -> torch.Tensor | HeadOutput:
    """log softmax(z / temperature)[token_ids] with z = softcap(scale (hidden @ weight.T + bias)),
    without materialising the logits; optionally the entropy of softmax(z / temperature) and
    whether each token is its argmax (top-1 match, for token accuracy), from the same pass.

    Args:
        hidden: [B, T, H] or [N, H], float32 / float16 / bfloat16.
        weight: [V, H], the lm_head weight. bias: optional [V].
        token_ids: hidden's leading dims, int64 or int32, in [0, V); an id of -100 (HF's
            ignore label) gives a log-prob of 0 and no gradient.
        temperature: > 0, the sampling temperature the completions were drawn with.
        logit_softcap, logit_scale: the model's own logit transforms (Gemma 2, Cohere), applied
            before the temperature.
        chunk_size: rows per chunk, as in :func:`fusetune.linear_cross_entropy`.
        return_entropy, return_top1: also return the per-token entropy (fp32, differentiable:
            its gradient joins the log-probs') and the top-1 match (bool; the first maximum,
            as argmax: a tie with an earlier token does not count). Each costs one more read
            of each chunk's logits in the forward, nothing when not asked for.

    Returns:
        float32 log-probs shaped like token_ids; differentiable in hidden, weight and bias
        (backward recomputes the logits chunk by chunk). Use it under torch.no_grad for the
        reference and old policies. Matmul precision follows
        :func:`fusetune.linear_cross_entropy`. With return_entropy or return_top1: a
        :class:`fusetune.HeadOutput` (log_probs, entropy or None, is_top1 or None); an ignored
        token (-100) has log-prob 0, entropy 0 and is_top1 False.

    Raises:
        TypeError: non-floating hidden/weight/bias, non-integer token_ids, float16 mixed with
            bfloat16 outside autocast, a non-number option.
        ValueError: hidden's last dim not weight's in-features (with a hint when it is the
            vocabulary size: logits passed for hidden states); token_ids not hidden's leading
            dims; bias not [V]; temperature, logit_softcap or logit_scale <= 0; tensors on
            different devices; on the CPU, an id outside [0, V) other than -100. On the GPU such
            an id gives NaN (no host sync to check it).
    """
    logit_options = dict(
        temperature=temperature, logit_softcap=logit_softcap, logit_scale=logit_scale
    )
    reference.check_selective_log_softmax_args(hidden, weight, token_ids, bias, **logit_options)
    extras = dict(return_entropy=return_entropy, return_top1=return_top1)
    if _utils.backend(hidden) == "reference":
        return reference.selective_log_softmax(
            hidden, weight, token_ids, bias=bias, **logit_options, **extras
        )
    _check_ids_on_cpu(token_ids, weight.shape[0])
    scale, softcap = _fold_temperature(temperature, logit_scale, logit_softcap)
    if return_entropy or return_top1:
        return lm_head.head(hidden, weight, token_ids, bias, reference.IGNORED_TOKEN, scale,
                            softcap, int(chunk_size or 0), return_entropy, return_top1,
                            matmul_dtype(hidden, weight))  # fmt: skip
    negative = linear_cross_entropy(
        hidden, weight, token_ids, bias, ignore_index=reference.IGNORED_TOKEN, reduction="none",
        logit_scale=scale, logit_softcap=softcap, chunk_size=chunk_size,
    )
    return negative.neg()


# ============================================================================ token gradient


def _token_grad(logps, old_logps, ref_logps, advantages, weights, options):
    """dloss/dl per token (fp32) at token level: the derivative of the reference's per-token
    loss (``options``: a :class:`fusetune.reference.grpo.LossOptions`) times its aggregation
    weight. vespo comes here only without old log-probs, where its phi is exactly 1."""
    ratio = torch.ones_like(logps) if old_logps is None else torch.exp(logps - old_logps)
    grad = _policy_grad(ratio, advantages, options)
    if options.beta != 0.0:
        if options.use_bias_correction_kl:  # d(k3 r)/dl = r (k3 + dk3/dl) = r (l - ref)
            grad = grad + options.beta * ratio * (logps - ref_logps)
        else:
            grad = grad + options.beta * (1.0 - torch.exp(ref_logps - logps))
    return grad * weights


def _policy_grad(ratio, advantages, options):
    """d(policy term)/dl per token; dr/dl = r."""
    if options.loss_type == "cispo":  # -sg(min(r, eps_high)) A l
        return -ratio.clamp(max=options.epsilon_high) * advantages
    if options.loss_type == "vespo":  # -sg(phi) A l with phi = 1
        return -advantages
    if options.loss_type == "sapo":  # -sigmoid(tau (r - 1)) 4 / tau A
        tau = reference.sapo_temperatures(advantages, options)
        gate = tau * (ratio - 1.0)
        # sigmoid' = sigmoid(x) sigmoid(-x): no cancellation where the gate saturates
        return -4.0 * advantages * torch.sigmoid(gate) * torch.sigmoid(-gate) * ratio
    return _clipped_grad(ratio, advantages, options)


def _clipped_grad(ratio, advantages, options):
    """The PPO clipped surrogate's. A tie in the min splits the gradient evenly between its two
    sides, as torch.minimum's derivative does; clamp passes it at its bounds, as torch.clamp's
    does."""
    delta, epsilon_low, epsilon_high = options.delta, options.epsilon_low, options.epsilon_high
    unclipped = ratio if delta is None else ratio.clamp(max=delta)
    clipped = ratio.clamp(1.0 - epsilon_low, 1.0 + epsilon_high)
    unclipped_term, clipped_term = unclipped * advantages, clipped * advantages
    unclipped_grad = advantages * ratio
    if delta is not None:
        unclipped_grad = unclipped_grad * (ratio <= delta)
    in_clip_range = (ratio >= 1.0 - epsilon_low) & (ratio <= 1.0 + epsilon_high)
    clipped_grad = advantages * ratio * in_clip_range
    surrogate_grad = torch.where(
        unclipped_term < clipped_term,
        unclipped_grad,
        torch.where(
            unclipped_term > clipped_term, clipped_grad, 0.5 * (unclipped_grad + clipped_grad)
        ),
    )
    return -surrogate_grad


def _token_options(loss_args) -> reference.LossOptions:
    """The LossOptions of the fused (token-level) path from the op's loss arguments."""
    (beta, epsilon_low, epsilon_high, delta, loss_type, sapo_temperature_pos,
     sapo_temperature_neg, use_bias_correction_kl) = loss_args  # fmt: skip
    return reference.LossOptions(
        beta=beta, epsilon_low=epsilon_low, epsilon_high=epsilon_high, delta=delta,
        loss_type=loss_type, sapo_temperature_pos=sapo_temperature_pos,
        sapo_temperature_neg=sapo_temperature_neg, use_bias_correction_kl=use_bias_correction_kl,
    )  # fmt: skip


# ============================================================================ custom op


_LOSS_SCHEMA = (
    "float beta, float epsilon_low, float epsilon_high, float? delta, str loss_type, "
    "float sapo_temperature_pos, float sapo_temperature_neg, bool use_bias_correction_kl"
)
_GRAD_FLAGS = "bool grad_hidden, bool grad_weight, bool grad_bias"


def _fake_forward(hidden, weight, bias, token_ids, *rest):
    *_, grad_hidden, grad_weight, grad_bias = rest
    return (
        hidden.new_empty((hidden.shape[0],), dtype=torch.float32),
        hidden.new_empty(hidden.shape if grad_hidden else (0,)),
        weight.new_empty(weight.shape if grad_weight else (0,)),
        weight.new_empty((weight.shape[0],) if grad_bias else (0,), dtype=torch.float32),
    )


@_utils.register_op(
    "grpo_forward(Tensor hidden, Tensor weight, Tensor? bias, Tensor token_ids, "
    "Tensor advantages, Tensor weights, Tensor? old_logps, Tensor? ref_logps, "
    f"{_LOSS_SCHEMA}, float? logit_scale, float? logit_softcap, int chunk_override, "
    f"{_GRAD_FLAGS}) -> (Tensor, Tensor, Tensor, Tensor)",
    fake=_fake_forward,
)
def _forward_op(hidden, weight, bias, token_ids, advantages, weights, old_logps, ref_logps, beta,
                epsilon_low, epsilon_high, delta, loss_type, sapo_temperature_pos,
                sapo_temperature_neg, use_bias_correction_kl, logit_scale, logit_softcap,
                chunk_override, grad_hidden, grad_weight, grad_bias):
    """hidden [N, H], weight [V, H], bias [V] in the matmul dtype; token_ids [N]; per-token fp32
    advantages, aggregation weights and (optional) old and reference log-probs, all [N].

    Returns the log-probs (fp32 [N]) and, for each flag set, the gradient of the token-level
    GRPO loss sum_t weights_t L_t: hidden's and weight's in their dtype, bias's in fp32; an
    empty tensor for each flag not set."""
    loss_options = _token_options((beta, epsilon_low, epsilon_high, delta, loss_type,
                                   sapo_temperature_pos, sapo_temperature_neg,
                                   use_bias_correction_kl))  # fmt: skip
    options = ce._Options(reference.IGNORED_TOKEN, 0.0, 0.0, logit_scale, logit_softcap)
    n_rows, device = token_ids.numel(), hidden.device
    neg_logps = _utils.empty((n_rows,), torch.float32, device)
    lse = _utils.empty((n_rows,), torch.float32, device)
    grads = _Grads(hidden, weight, bias, grad_hidden, grad_weight, grad_bias)
    compute_grad = grad_hidden or grad_weight or grad_bias
    with torch.autocast(device.type, enabled=False):
        chunks = _logit_chunks(hidden, weight, bias, chunk_override, LOGITS_WEIGHT_FRACTION)
        for rows, logits3, plan in chunks:
            ce._forward_stats(logits3, token_ids[rows], options, plan, neg_logps[rows], lse[rows])
            if not compute_grad:
                continue
            grad_logps = _token_grad(
                -neg_logps[rows], _rows(old_logps, rows), _rows(ref_logps, rows),
                advantages[rows], weights[rows], loss_options,
            )
            # l = -cross-entropy: the kernel's per-row weight is -dloss/dl.
            ce._write_grad(
                logits3, token_ids[rows], lse[rows], grad_logps.neg_(), logits3, options, plan
            )
            grads.add_chunk(logits3[0], hidden, weight, rows)
    return (neg_logps.neg_(), *grads.outputs())


def _rows(tensor: torch.Tensor | None, rows: slice) -> torch.Tensor | None:
    return None if tensor is None else tensor[rows]


# ============================================================================ autograd


def _flat_fp32(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else tensor.reshape(-1).to(torch.float32).contiguous()


class _GRPOFunction(torch.autograd.Function):
    """Token-level GRPO for hidden [B * T, H]: returns (loss, logps [B, T]); logps is not
    differentiable."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, token_ids, completion_mask, advantages, old_logps,
                ref_logps, weights, loss_args, logit_args, chunk_override, dtype):
        flags = tuple(ctx.needs_input_grad[:3])
        batch, time = token_ids.shape
        token_advantages = advantages.to(torch.float32)[:, None].expand(batch, time)
        flat_logps, *grads = _forward_op(
            hidden.to(dtype), weight.to(dtype),
            None if bias is None else bias.to(dtype), token_ids.reshape(-1).contiguous(),
            _flat_fp32(token_advantages), _flat_fp32(weights), _flat_fp32(old_logps),
            _flat_fp32(ref_logps), *loss_args, *logit_args, chunk_override, *flags,
        )
        logps = flat_logps.view(batch, time)
        options = _token_options(loss_args)
        ratio = reference.log_ratio(logps, old_logps, completion_mask, "token").exp()
        # vespo comes here on-policy only, where its phi is exactly 1
        phi = ratio.new_ones((batch, 1)) if options.loss_type == "vespo" else None
        losses = reference.per_token_loss(logps, ratio, advantages, ref_logps, options, phi)
        ctx.save_for_backward(*own_dtypes(grads, flags, hidden, weight, bias))
        ctx.mark_non_differentiable(logps)
        return (losses * weights).sum(), logps

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss, grad_logps):
        grads = scale_fused_grads(ctx.saved_tensors, grad_loss)
        return (*grads, *(None,) * 10)


# ============================================================================ public function


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
    """The policy losses of TRL 1.16's GRPOTrainer (GRPO, BNPO, Dr. GRPO, DAPO, CISPO, SAPO,
    LUSPO, VESPO) straight from hidden states, never materialising the [B, T, V] logits.

    With l = :func:`selective_log_softmax` of the completion tokens, m the mask, A the
    advantages: r = exp(l - old_logps) per token, or at sequence level (GSPO) one ratio per
    sequence, exp(sum_t m (l - old) / sum_t m); when old_logps is None, old = l.detach() (r = 1).
    Per token, with sg() a stop-gradient (TRL's formulas, term for term):
      grpo, bnpo, dr_grpo, dapo, luspo: -min(min(r, delta) A, clip(r, 1 - epsilon_low,
        1 + epsilon_high) A);
      cispo: -sg(min(r, epsilon_high)) A l (epsilon_high is CISPO's eps_max, 5.0 in its paper);
      sapo: -sigmoid(tau (r - 1)) 4 / tau A, tau = sapo_temperature_pos if A > 0 else
        sapo_temperature_neg;
      vespo: -sg(phi) A l, phi = exp(lambda + k log w - lambda w) of each sequence's
        w = exp(sum_t m clamp(l - old, -20, 20)), log w clamped to [log 1e-8, 20],
        (k, lambda) = (vespo_k_pos, vespo_lambda_pos) if A >= 0 else the _neg pair;
    plus beta (exp(ref - l) - (ref - l) - 1), times r when use_bias_correction_kl (TRL's
    GRPOConfig default is True; here False). The loss aggregates m L: "grpo" and "sapo" the
    mean over sequences of each one's token mean; "bnpo" the mean over the batch's active
    tokens; "dr_grpo" the sum over B * max_completion_length; "dapo", "cispo" and "vespo" the
    sum over num_items_in_batch (the active tokens of the whole generation batch; TRL passes
    num_items_in_batch / processes * accumulation steps / steps_per_generation), else over the
    active tokens; "luspo" the mean over sequences of each one's sum.

    Token-level losses compute their gradient in the forward (three matmuls), but vespo with
    old_logps, whose phi needs each whole sequence's log-probs first: it and the sequence level
    take the log-probs, then recompute the logits in backward (four).

    Args:
        hidden: [B, T, H], the policy's final hidden states at the completion positions
            (position t predicts token_ids[:, t]); float32 / float16 / bfloat16.
        weight: [V, H], the lm_head weight; bias: optional [V].
        token_ids: [B, T] sampled tokens, int64 or int32.
        completion_mask: [B, T], bool, integer or floating (1 for completion tokens).
        advantages: [B], floating.
        old_logps, ref_logps: optional [B, T] log-probs of the sampling and reference policies
            (ref_logps is required when beta != 0).
        loss options: named as TRL's GRPOConfig names them, but epsilon_low for ``epsilon``.
            luspo at token level and vespo at sequence level warn, as TRL does, and compute
            what TRL computes.
        temperature, logit_softcap, logit_scale: as in :func:`selective_log_softmax`.
        chunk_size: rows per chunk, as in :func:`fusetune.linear_cross_entropy`.

    Returns:
        (loss, metrics): loss a 0-dim fp32 tensor, differentiable in hidden, weight and bias
        (each gradient in its own dtype; a frozen weight costs no weight-gradient matmul);
        metrics a dict of detached 0-dim fp32 tensors, computed on the device without a host
        sync, with the values TRL logs (see :func:`fusetune.reference.grpo.grpo_metrics`):
        "kl" when ref_logps is given; for the clipped types "clip_ratio_low", "clip_ratio_high",
        "clip_ratio", "clip_ratio_low_min", "clip_ratio_high_max"; "cispo_clip_ratio" for cispo;
        "vespo_phi_seq_mean" for vespo. Summing the losses of several calls (gradient
        accumulation) sums their gradients.

    Raises:
        TypeError: as :func:`selective_log_softmax`; non-floating advantages or log-probs; a
            non-number option; a non-bool use_bias_correction_kl.
        ValueError: the checks of :func:`selective_log_softmax` (a hidden that is really logits
            included); hidden not 3-D; completion_mask, old_logps or ref_logps not [B, T];
            advantages not [B]; an unknown loss_type or importance_sampling_level; "dr_grpo"
            without max_completion_length; beta != 0 without ref_logps; epsilon_low outside
            [0, 1]; epsilon_high < 0; delta < 1; a sapo temperature <= 0; num_items_in_batch
            <= 0 or not one element.
    """
    loss_options = dict(
        beta=beta, epsilon_low=epsilon_low, epsilon_high=epsilon_high, delta=delta,
        loss_type=loss_type, importance_sampling_level=importance_sampling_level,
        max_completion_length=max_completion_length, num_items_in_batch=num_items_in_batch,
        sapo_temperature_pos=sapo_temperature_pos, sapo_temperature_neg=sapo_temperature_neg,
        vespo_k_pos=vespo_k_pos, vespo_lambda_pos=vespo_lambda_pos, vespo_k_neg=vespo_k_neg,
        vespo_lambda_neg=vespo_lambda_neg, use_bias_correction_kl=use_bias_correction_kl,
    )  # fmt: skip
    logit_options = dict(
        temperature=temperature, logit_softcap=logit_softcap, logit_scale=logit_scale
    )
    reference.check_grpo_args(
        hidden, weight, token_ids, completion_mask, advantages, old_logps=old_logps,
        ref_logps=ref_logps, bias=bias, loss_options=loss_options, logit_options=logit_options,
    )
    _utils.check_number("chunk_size", chunk_size, low=1, optional=True)
    if _utils.backend(hidden) == "reference":
        return reference.grpo_loss(
            hidden, weight, token_ids, completion_mask, advantages, old_logps=old_logps,
            ref_logps=ref_logps, bias=bias, **loss_options, **logit_options,
        )
    needs_whole_sequences = importance_sampling_level == "sequence" or (
        loss_type == "vespo" and old_logps is not None
    )
    if needs_whole_sequences:
        logps = selective_log_softmax(
            hidden, weight, token_ids, bias=bias, chunk_size=chunk_size, **logit_options
        )
        return reference.grpo_loss_from_logps(
            logps, completion_mask, advantages, old_logps=old_logps, ref_logps=ref_logps,
            **loss_options,
        )
    _check_ids_on_cpu(token_ids, weight.shape[0])
    weights = reference.token_weights(
        completion_mask, loss_type, max_completion_length, num_items_in_batch
    )
    loss_args = (float(beta), float(epsilon_low), float(epsilon_high), _optional(delta),
                 loss_type, float(sapo_temperature_pos), float(sapo_temperature_neg),
                 bool(use_bias_correction_kl))  # fmt: skip
    loss, logps = _GRPOFunction.apply(
        hidden.reshape(-1, hidden.shape[-1]), weight, bias, token_ids, completion_mask, advantages,
        old_logps, ref_logps, weights, loss_args,
        _fold_temperature(float(temperature), _optional(logit_scale), _optional(logit_softcap)),
        int(chunk_size or 0), matmul_dtype(hidden, weight),
    )
    metrics = reference.metrics_from_logps(
        logps, completion_mask, advantages, old_logps, ref_logps,
        reference.LossOptions(**loss_options),
    )
    return loss, metrics


def _optional(value: float | None) -> float | None:
    return None if value is None else float(value)
