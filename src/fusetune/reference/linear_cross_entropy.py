"""Pure-PyTorch linear cross-entropy: ``cross_entropy(hidden @ weight.T + bias, labels)``.

The semantics of :func:`fusetune.linear_cross_entropy`, its CPU path and the tests' oracle. It
materialises the logits; the fused op never does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fusetune._utils import (
    check_floating,
    check_integer,
    check_ndim,
    check_number,
    check_same_device,
    matmul_dtype,  # the one mixed-precision matmul rule; re-exported for the ops
)
from fusetune.reference.cross_entropy import check_loss_options, cross_entropy


def check_lm_head(
    hidden: torch.Tensor, weight: torch.Tensor, ndims: tuple[int, ...], layout: str
) -> None:
    """hidden ``layout`` and an lm_head weight [V, H] that fit each other; every op that takes
    hidden states instead of logits shares this check."""
    check_floating("hidden", hidden)
    check_floating("weight", weight)
    check_ndim("hidden", hidden, ndims, layout)
    check_ndim("weight", weight, (2,), "[V, H] (the lm_head weight: vocab x hidden size)")
    vocab, in_features = weight.shape
    if hidden.shape[-1] != in_features:
        # One f-string: Dynamo cannot concatenate strings while tracing.
        hint = (
            ". hidden's last dim equals the vocabulary size: this looks like logits were passed "
            "instead of hidden states"
            if hidden.shape[-1] == vocab
            else ""
        )
        raise ValueError(
            f"hidden's last dim must equal weight's in-features (weight is [V, H]); got hidden "
            f"{tuple(hidden.shape)} and weight {tuple(weight.shape)}{hint}"
        )
    if vocab == 0:
        raise ValueError(f"weight must have at least one row (vocab), got {tuple(weight.shape)}")


def check_linear_cross_entropy_args(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None,
    **loss_options: object,
) -> None:
    """The argument checks :func:`fusetune.linear_cross_entropy` and this reference share."""
    check_lm_head(hidden, weight, (2, 3), "[N, H] or [B, T, H]")
    vocab = weight.shape[0]
    check_integer("labels", labels)
    if tuple(labels.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(
            f"labels must have shape {tuple(hidden.shape[:-1])} (hidden's leading dims; hidden "
            f"is {tuple(hidden.shape)}), got {tuple(labels.shape)}"
        )
    if bias is not None:
        check_floating("bias", bias)
        if tuple(bias.shape) != (vocab,):
            raise ValueError(
                f"bias must have shape ({vocab},) (weight's rows), got {tuple(bias.shape)}"
            )
    class_weight = loss_options.pop("class_weight", None)
    token_weight = loss_options.pop("token_weight", None)
    check_loss_weights(class_weight, token_weight, vocab, labels.shape)
    check_same_device(
        hidden=hidden,
        weight=weight,
        labels=labels,
        bias=bias,
        class_weight=class_weight,
        token_weight=token_weight,
    )
    chunk_size = loss_options.pop("chunk_size", None)
    check_number("chunk_size", chunk_size, low=1, optional=True)
    check_loss_options(**loss_options)


def check_loss_weights(
    class_weight: torch.Tensor | None,
    token_weight: torch.Tensor | None,
    vocab: int,
    labels_shape: torch.Size,
) -> None:
    """Class weights: None or floating [V]; token weights: None or floating, labels' shape."""
    for name, tensor, shape, meaning in (
        ("class_weight", class_weight, (vocab,), "one weight per class"),
        ("token_weight", token_weight, tuple(labels_shape), "labels' shape"),
    ):
        if tensor is None:
            continue
        check_floating(name, tensor)
        if tuple(tensor.shape) != shape:
            raise ValueError(
                f"{name} must have shape {shape} ({meaning}), got {tuple(tensor.shape)}"
            )


def shift_labels(labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """labels moved one token left, the last position of each sequence ignored: position t is
    scored against token t + 1, so hidden needs no slicing (and no copy)."""
    tail = labels.new_full((*labels.shape[:-1], 1), ignore_index)
    return torch.cat([labels[..., 1:], tail], dim=-1)


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    shift: bool = False,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    logit_softcap: float | None = None,
    logit_scale: float | None = None,
    z_loss: float = 0.0,
    num_items: float | torch.Tensor | None = None,
    return_z_loss: bool = False,
    chunk_size: int | None = None,
    class_weight: torch.Tensor | None = None,
    token_weight: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Reference for :func:`fusetune.linear_cross_entropy` (same signature and semantics).

    ``class_weight`` is the reference cross-entropy's ``weight``. With ``token_weight`` t the
    per-token losses (the z-loss term included) are multiplied by t; "mean" divides by the sum,
    over non-ignored tokens, of t times the label's class weight (1 without class weights), by
    1 where that sum is 0. ``chunk_size`` is accepted for signature parity and has no effect
    here."""
    options = dict(
        reduction=reduction,
        label_smoothing=label_smoothing,
        logit_softcap=logit_softcap,
        logit_scale=logit_scale,
        z_loss=z_loss,
        num_items=num_items,
    )
    check_linear_cross_entropy_args(
        hidden,
        weight,
        labels,
        bias,
        chunk_size=chunk_size,
        class_weight=class_weight,
        token_weight=token_weight,
        **options,
    )
    dtype = matmul_dtype(hidden, weight)
    if shift:
        hidden, labels = hidden[..., :-1, :], labels[..., 1:]
        token_weight = None if token_weight is None else token_weight[..., 1:]
    cast_bias = None if bias is None else bias.to(dtype)
    logits = F.linear(hidden.to(dtype), weight.to(dtype), cast_bias)
    if token_weight is None:
        return cross_entropy(
            logits,
            labels,
            ignore_index=ignore_index,
            return_z_loss=return_z_loss,
            weight=class_weight,
            **options,
        )
    return _token_weighted(logits, labels, ignore_index, class_weight, token_weight,
                           return_z_loss, options)  # fmt: skip


def _token_weighted(logits, labels, ignore_index, class_weight, token_weight, return_z_loss,
                    options):  # fmt: skip
    """The cross-entropy of each token times its token weight, reduced as documented."""
    reduction, num_items = options.pop("reduction"), options.pop("num_items")
    per_token, z_term = cross_entropy(
        logits,
        labels,
        ignore_index=ignore_index,
        weight=class_weight,
        reduction="none",
        return_z_loss=True,
        **options,
    )
    scale = token_weight.detach().to(per_token.dtype)
    per_token, z_term = per_token * scale, z_term * scale
    if reduction != "none":
        valid = labels != ignore_index
        if num_items is not None:
            denominator = torch.as_tensor(num_items, dtype=scale.dtype, device=scale.device)
            denominator = denominator.reshape(())
        elif reduction == "mean":
            if class_weight is not None:
                safe_labels = torch.where(valid, labels, 0).long()
                scale = scale * class_weight.detach().to(scale.dtype)[safe_labels]
            total = torch.where(valid, scale, 0.0).sum()
            denominator = torch.where(total == 0, 1.0, total)
        else:
            denominator = torch.ones((), dtype=scale.dtype, device=scale.device)
        per_token, z_term = per_token.sum() / denominator, z_term.sum() / denominator
    return (per_token, z_term) if return_z_loss else per_token
