"""fusetune.nn loss modules: each passes its op every option the op has, class weights live in
buffers as in torch.nn.CrossEntropyLoss, and the module's result is the op's."""

from __future__ import annotations

import pytest
import torch

import fusetune
from fusetune.reference import grpo as reference_grpo
from harness import DEVICE, assert_close, tolerance
from test_grpo import make_inputs as grpo_inputs

IGNORE = -100


def class_weights(vocab: int) -> torch.Tensor:
    weight = torch.rand(vocab, device=DEVICE) * 2 + 0.1
    weight[1] = 0.0
    return weight


def labels_for(shape, vocab):
    labels = torch.randint(0, vocab, shape, device=DEVICE)
    labels.view(-1)[0], labels.view(-1)[1] = 1, IGNORE
    return labels


@pytest.mark.parametrize("label_smoothing", [0.0, 0.2])
def test_cross_entropy_loss_weight_is_torchs(label_smoothing):
    """CrossEntropyLoss(weight=w) gives torch.nn.CrossEntropyLoss(weight=w)'s loss."""
    weight = class_weights(50)
    logits = torch.randn(9, 50, device=DEVICE)
    labels = labels_for((9,), 50)
    got = fusetune.nn.CrossEntropyLoss(weight=weight, label_smoothing=label_smoothing)
    want = torch.nn.CrossEntropyLoss(weight=weight, label_smoothing=label_smoothing)
    assert_close("loss", got(logits, labels), want(logits, labels), tolerance(torch.float32))


@pytest.mark.parametrize(
    "module,name",
    [
        (fusetune.nn.CrossEntropyLoss, "weight"),
        (fusetune.nn.LinearCrossEntropyLoss, "class_weight"),
    ],
)
def test_class_weight_is_a_buffer(module, name):
    """In the state dict, moved by .to(), None when not given (as torch's)."""
    weight = torch.rand(7, dtype=torch.float64)
    loss_fn = module(**{name: weight})
    assert dict(loss_fn.named_buffers()).keys() == {name}
    assert torch.equal(loss_fn.state_dict()[name], weight)
    assert getattr(loss_fn.to(torch.float32), name).dtype == torch.float32
    assert getattr(module(), name) is None and not module().state_dict()


def test_linear_cross_entropy_loss_weights():
    """LinearCrossEntropyLoss(class_weight=) with forward(token_weight=) is the op's call."""
    hidden = torch.randn(2, 6, 16, device=DEVICE, requires_grad=True)
    weight = torch.randn(40, 16, device=DEVICE) / 4
    labels = labels_for((2, 6), 40)
    class_weight, token_weight = class_weights(40), torch.rand(2, 6, device=DEVICE)
    options = dict(shift=True, label_smoothing=0.1, chunk_size=5)
    loss_fn = fusetune.nn.LinearCrossEntropyLoss(class_weight=class_weight, **options)
    got = loss_fn(hidden, weight, labels, token_weight=token_weight)
    want = fusetune.linear_cross_entropy(hidden, weight, labels, class_weight=class_weight,
                                         token_weight=token_weight, **options)  # fmt: skip
    assert torch.equal(got, want)
    reference = fusetune.reference.linear_cross_entropy(
        hidden.double(), weight.double(), labels, class_weight=class_weight.double(),
        token_weight=token_weight.double(), **options,
    )  # fmt: skip
    assert_close("loss", got, reference, tolerance(torch.float32))


GRPO_OPTIONS = {
    "cispo": dict(loss_type="cispo", epsilon_high=5.0),
    "sapo": dict(loss_type="sapo", sapo_temperature_pos=0.8, sapo_temperature_neg=1.3),
    "luspo-sequence": dict(loss_type="luspo", importance_sampling_level="sequence"),
    "vespo": dict(
        loss_type="vespo",
        vespo_k_pos=1.5,
        vespo_lambda_pos=2.5,
        vespo_k_neg=2.5,
        vespo_lambda_neg=1.5,
    ),  # fmt: skip
    "grpo-bias-corrected-kl": dict(loss_type="grpo", beta=0.1, use_bias_correction_kl=True),
}


@pytest.mark.parametrize("case", list(GRPO_OPTIONS))
def test_grpo_loss_module_options(case):
    """Each loss type and its options, through the module: the op's loss and metrics, and the
    float64 reference's."""
    options = GRPO_OPTIONS[case]
    inputs = grpo_inputs(3, 5, 8, 40)
    args = {k: (v.float() if v.is_floating_point() else v).to(DEVICE) for k, v in inputs.items()}
    loss_fn = fusetune.nn.GRPOLoss(**options)
    loss, metrics = loss_fn(**args)
    want, want_metrics = fusetune.grpo_loss(**args, **options)
    assert torch.equal(loss, want) and metrics.keys() == want_metrics.keys()
    ref_loss, ref_metrics = reference_grpo.grpo_loss(**args, **options)
    assert_close("loss", loss, ref_loss, tolerance(torch.float32))
    for name, value in ref_metrics.items():
        assert_close(name, metrics[name], value, tolerance(torch.float32), atol=1e-6)
    for key, value in options.items():
        assert f"{key}={value!r}" in repr(loss_fn)
