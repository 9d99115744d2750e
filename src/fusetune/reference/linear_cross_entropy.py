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
    check_same_device(hidden=hidden, weight=weight, labels=labels, bias=bias)
    chunk_size = loss_options.pop("chunk_size", None)
    check_number("chunk_size", chunk_size, low=1, optional=True)
    check_loss_options(**loss_options)


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
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Reference for :func:`fusetune.linear_cross_entropy` (same signature and semantics).

    ``chunk_size`` is accepted for signature parity and has no effect here."""
    options = dict(
        reduction=reduction,
        label_smoothing=label_smoothing,
        logit_softcap=logit_softcap,
        logit_scale=logit_scale,
        z_loss=z_loss,
        num_items=num_items,
    )
    check_linear_cross_entropy_args(hidden, weight, labels, bias, chunk_size=chunk_size, **options)
    dtype = matmul_dtype(hidden, weight)
    if shift:
        hidden, labels = hidden[..., :-1, :], labels[..., 1:]
    cast_bias = None if bias is None else bias.to(dtype)
    logits = F.linear(hidden.to(dtype), weight.to(dtype), cast_bias)
    return cross_entropy(
        logits, labels, ignore_index=ignore_index, return_z_loss=return_z_loss, **options
    )
