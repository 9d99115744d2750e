"""Pure-PyTorch cross-entropy: the semantics of :func:`fusetune.cross_entropy`, the CPU path
and the tests' oracle. Computes in float32 (float64 for float64 logits)."""

from __future__ import annotations

import torch

from fusetune._utils import (
    check_choice,
    check_floating,
    check_integer,
    check_ndim,
    check_number,
    check_same_device,
)

REDUCTIONS = ("mean", "sum", "none")


def check_cross_entropy_args(
    logits: torch.Tensor,
    labels: torch.Tensor,
    weight: torch.Tensor | None = None,
    **loss_options: object,
) -> None:
    """The argument checks :func:`fusetune.cross_entropy` and this reference share;
    ``loss_options`` are :func:`check_loss_options`' keywords."""
    check_floating("logits", logits)
    check_ndim("logits", logits, (2, 3), "[N, V] or [B, T, V]")
    check_integer("labels", labels)
    if tuple(labels.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"labels must have shape {tuple(logits.shape[:-1])} (logits' leading dims; logits "
            f"are {tuple(logits.shape)}), got {tuple(labels.shape)}"
        )
    if logits.shape[-1] == 0:
        raise ValueError(
            f"logits must have a vocabulary of at least 1, got shape {tuple(logits.shape)}"
        )
    check_class_weight(weight, logits.shape[-1])
    check_same_device(logits=logits, labels=labels, weight=weight)
    check_loss_options(**loss_options)


def check_class_weight(weight: torch.Tensor | None, vocab: int) -> None:
    """Class weights: None, or a floating [V] tensor."""
    if weight is None:
        return
    check_floating("weight", weight)
    if tuple(weight.shape) != (vocab,):
        raise ValueError(
            f"weight must have shape ({vocab},) (one weight per class), got {tuple(weight.shape)}"
        )


def check_loss_options(
    *,
    reduction: str,
    label_smoothing: float,
    logit_softcap: float | None,
    logit_scale: float | None,
    z_loss: float,
    num_items: float | torch.Tensor | None,
    inplace_backward: bool = False,
) -> None:
    """The loss options every cross-entropy op shares (fused with a linear layer or not)."""
    check_choice("reduction", reduction, REDUCTIONS)
    check_number("label_smoothing", label_smoothing, low=0.0, high=1.0)
    check_number("logit_softcap", logit_softcap, low=0.0, low_inclusive=False, optional=True)
    check_number("logit_scale", logit_scale, low=0.0, low_inclusive=False, optional=True)
    check_number("z_loss", z_loss, low=0.0)
    if num_items is not None and reduction == "none":
        raise ValueError("num_items divides a summed loss; it needs reduction 'mean' or 'sum'")
    check_item_count("num_items", num_items)
    if inplace_backward and reduction == "none":
        raise ValueError("inplace_backward needs reduction 'mean' or 'sum' (got 'none')")


def check_item_count(name: str, value: float | torch.Tensor | None) -> None:
    """A loss denominator: None, a positive number, or a 1-element tensor (read on the device,
    so its value is not checked)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"{name} must be a number or a 1-element tensor, got shape {tuple(value.shape)}"
            )
    else:
        check_number(name, value, low=0.0, low_inclusive=False, optional=True)


def check_labels_in_range(
    labels: torch.Tensor, vocab: int, ignore_index: int, name: str = "labels"
) -> None:
    """Raise if a label is neither ignore_index nor in [0, vocab). Reads values: CPU only."""
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= vocab))
    if bool(bad.any()):
        first = labels[bad].flatten()[0].item()
        raise ValueError(
            f"{name} must be in [0, {vocab}) or equal ignore_index={ignore_index}; found {first}"
        )


def transform_logits(
    logits: torch.Tensor, logit_scale: float | None, logit_softcap: float | None
) -> torch.Tensor:
    """scale, then softcap: z = c * tanh(s * x / c)."""
    z = logits.float() if logits.dtype != torch.float64 else logits
    if logit_scale is not None:
        z = z * logit_scale
    if logit_softcap is not None:
        z = logit_softcap * torch.tanh(z / logit_softcap)
    return z


def cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    logit_softcap: float | None = None,
    logit_scale: float | None = None,
    z_loss: float = 0.0,
    num_items: float | torch.Tensor | None = None,
    return_z_loss: bool = False,
    inplace_backward: bool = False,
    weight: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Reference for :func:`fusetune.cross_entropy` (same signature and semantics).

    Per token with label y (z the scaled, softcapped logits, ε the smoothing):
    ``loss = lse(z) - (1 - ε) z_y - ε mean(z) + z_loss * lse(z)^2``; ignored tokens give 0.
    With class weights w, torch's weighting of the cross-entropy terms:
    ``loss = (1 - ε) w_y (lse - z_y) + ε / V sum_c w_c (lse - z_c) + z_loss * lse^2``, and
    "mean" divides by the non-ignored tokens' sum of w_y (by 1 where that is 0).
    ``inplace_backward`` is accepted for signature parity and has no effect here.
    """
    check_cross_entropy_args(
        logits,
        labels,
        weight,
        reduction=reduction,
        label_smoothing=label_smoothing,
        logit_softcap=logit_softcap,
        logit_scale=logit_scale,
        z_loss=z_loss,
        num_items=num_items,
        inplace_backward=inplace_backward,
    )
    vocab = logits.shape[-1]
    if not labels.is_cuda and not torch.compiler.is_compiling():
        check_labels_in_range(labels, vocab, ignore_index)  # on CUDA this would sync the host
    z = transform_logits(logits, logit_scale, logit_softcap)
    lse = torch.logsumexp(z, dim=-1)
    valid = labels != ignore_index
    target = z.gather(-1, torch.where(valid, labels, 0).long().unsqueeze(-1)).squeeze(-1)
    eps = label_smoothing
    label_weight = None
    if weight is None:
        per_token = lse - (1.0 - eps) * target + z_loss * lse.square()
        if eps > 0:  # skipped at 0 so that -inf logits (a masked vocabulary) give no 0 * inf
            per_token = per_token - eps * z.mean(dim=-1)
    else:
        class_weight = weight.detach().to(z.dtype)
        label_weight = class_weight[torch.where(valid, labels, 0).long()]
        per_token = (1.0 - eps) * label_weight * (lse - target) + z_loss * lse.square()
        if eps > 0:
            smoothed = lse * class_weight.sum() - (z * class_weight).sum(dim=-1)
            per_token = per_token + eps / vocab * smoothed
    zero = torch.zeros((), dtype=z.dtype, device=z.device)
    per_token = torch.where(valid, per_token, zero)
    z_term = torch.where(valid, z_loss * lse.detach().square(), zero)

    if reduction == "none":
        loss, z_value = per_token, z_term
    else:
        if num_items is not None:
            denominator = torch.as_tensor(num_items, dtype=z.dtype, device=z.device).reshape(())
        elif reduction == "mean" and label_weight is not None:
            total = torch.where(valid, label_weight, zero).sum()
            denominator = torch.where(total == 0, 1.0, total)
        elif reduction == "mean":
            denominator = valid.sum().clamp_min(1).to(z.dtype)
        else:
            denominator = torch.ones((), dtype=z.dtype, device=z.device)
        loss = per_token.sum() / denominator
        z_value = z_term.sum() / denominator
    return (loss, z_value.detach()) if return_z_loss else loss
