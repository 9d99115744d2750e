"""fusetune.cross_entropy against its float64 reference, across the dtype-contract matrix."""

from __future__ import annotations

import pytest
import torch

import fusetune
from fusetune._utils import cdiv
from fusetune.ops import cross_entropy as ce_module
from fusetune.reference import cross_entropy as reference_ce
from harness import (
    DEVICE,
    ON_GPU,
    assert_close,
    assert_raises,
    check_op,
    matrix,
    tolerance,
    uses_kernels,
)

IGNORE = -100


def make_inputs(shape: tuple[int, ...], *, ignore_fraction: float = 0.2, spread: float = 4.0):
    """Random logits (float64) with a spread like a trained lm_head's, and labels with some
    positions ignored."""
    vocab = shape[-1]
    logits = torch.randn(shape, dtype=torch.float64) * spread
    labels = torch.randint(0, vocab, shape[:-1])
    labels[torch.rand(shape[:-1]) < ignore_fraction] = IGNORE
    return {"logits": logits, "labels": labels}


def run(inputs, dtype, **kw):
    outputs = 2 if kw.get("kwargs", {}).get("return_z_loss") else 1
    return check_op(
        fusetune.cross_entropy,
        reference_ce,
        inputs,
        dtype=dtype,
        cast=["logits"],
        grad=["logits"],
        compute_dtype=torch.float32,
        output_dtypes=[torch.float32] * outputs,
        **kw,
    )


# Two variants, each forced onto one launch shape so that the CPU and the GPU pass test the
# same paths: one program per row (fused forward+backward), and rows split over programs
# whose partial logsumexps are merged.
VARIANTS = {
    "rows-3d-mean-all-options": (
        (2, 5, 777),
        1,
        dict(
            reduction="mean",
            label_smoothing=0.1,
            logit_softcap=3.0,
            logit_scale=0.7,
            z_loss=1e-3,
            return_z_loss=True,
        ),
    ),
    "split-2d-none-softcap": (
        (3, 1531),
        3,
        dict(
            reduction="none",
            label_smoothing=0.05,
            logit_softcap=30.0,
            return_z_loss=True,
            z_loss=2e-4,
        ),
    ),
}


def force_launch(monkeypatch, chunks: int, block: int = 128) -> None:
    """Make every launch use ``chunks`` programs per row and ``block`` columns per step."""

    def plan(n_rows, vocab, device):
        chunk = cdiv(cdiv(vocab, chunks), block) * block
        return ce_module._LaunchPlan(
            block=block, chunks=cdiv(vocab, chunk), chunk=chunk, num_warps=4
        )

    monkeypatch.setattr(ce_module, "_launch_plan", plan)


@pytest.mark.parametrize("variant", list(VARIANTS))
@matrix()
def test_matrix(variant, dtype, autocast, mode, layout, monkeypatch):
    shape, chunks, kwargs = VARIANTS[variant]
    force_launch(monkeypatch, chunks)
    assert ce_module._launch_plan(shape[0], shape[-1], DEVICE).chunks == chunks
    assert uses_kernels(torch.empty(0, dtype=dtype, device=DEVICE))
    run(make_inputs(shape), dtype, kwargs=kwargs, mode=mode, autocast=autocast, layout=layout)


@pytest.mark.parametrize("chunks,block", [(1, 128), (1, 1024), (2, 64), (5, 32)])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_launch_shapes(chunks, block, reduction, monkeypatch):
    """Every launch shape, the single-block one (block >= V) included, gives the same result."""
    force_launch(monkeypatch, chunks, block)
    kwargs = dict(reduction=reduction, label_smoothing=0.1, logit_softcap=5.0, z_loss=1e-3)
    run(make_inputs((7, 1000)), torch.bfloat16, kwargs=kwargs)


def test_default_launch_plan(monkeypatch):
    monkeypatch.setattr(ce_module._utils, "num_programs_in_flight", lambda device: 132)  # H100
    plan = ce_module._launch_plan(10_000, 128_256, torch.device("cuda"))
    assert plan.chunks == 1 and plan.chunk >= 128_256
    plan = ce_module._launch_plan(2, 262_144, torch.device("cuda"))
    assert plan.chunks > 1 and plan.chunk % plan.block == 0
    assert (plan.chunks - 1) * plan.chunk < 262_144 <= plan.chunks * plan.chunk


OPTIONS = {
    "plain": {},
    "softcap": dict(logit_softcap=2.5),
    "scale": dict(logit_scale=1.9),
    "scale+softcap": dict(logit_scale=0.3, logit_softcap=1.5),
    "smoothing": dict(label_smoothing=0.2),
    "full-smoothing": dict(label_smoothing=1.0),
    "z_loss": dict(z_loss=1e-2),
    "num_items-number": dict(num_items=7),
    "num_items-tensor": dict(num_items=torch.tensor(11.0)),
    "ignore-index-0": dict(ignore_index=0),
}


OPTION_CASES = [  # num_items with reduction "none" is an error (test_bad_input)
    (option, reduction)
    for option in OPTIONS
    for reduction in ("mean", "sum", "none")
    if not (option.startswith("num_items") and reduction == "none")
]


@pytest.mark.parametrize("option,reduction", OPTION_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_options(option, reduction, dtype):
    kwargs = dict(OPTIONS[option], reduction=reduction)
    if "num_items" in kwargs:
        if isinstance(kwargs["num_items"], torch.Tensor):
            kwargs["num_items"] = kwargs["num_items"].to(DEVICE)
    shape = (12, 300) if reduction != "sum" else (2, 900)
    inputs = make_inputs(shape)
    if "ignore_index" in kwargs:
        inputs["labels"][inputs["labels"] == IGNORE] = 0
    run(inputs, dtype, kwargs=kwargs)


@pytest.mark.parametrize("shape", [(1, 1), (1, 5), (4, 1), (1, 4099), (2, 3, 1)], ids=str)
def test_odd_shapes(shape):
    # V = 1 makes every loss exactly 0: allow fp32 rounding in absolute terms.
    run(
        make_inputs(shape, ignore_fraction=0.0),
        torch.float32,
        kwargs=dict(label_smoothing=0.1),
        atol=1e-6,
    )


@pytest.mark.parametrize("rows", [2, 40])
def test_upstream_gradient_one_and_not_one(rows):
    """backward() with an upstream gradient of exactly 1 takes the no-rescale branch; 2.5
    does not."""
    inputs = make_inputs((rows, 333))
    for factor in (1.0, 2.5):
        logits = inputs["logits"].float().to(DEVICE).requires_grad_()
        expected = inputs["logits"].clone().requires_grad_()
        (fusetune.cross_entropy(logits, inputs["labels"].to(DEVICE)) * factor).backward()
        (reference_ce(expected, inputs["labels"]) * factor).backward()
        assert_close(f"grad x{factor}", logits.grad, expected.grad, tolerance(torch.float32))


def test_gradient_accumulates_across_calls():
    """Two losses summed (gradient accumulation) give the sum of the two gradients."""
    inputs = make_inputs((16, 257))
    logits = inputs["logits"].float().to(DEVICE).requires_grad_()
    labels = inputs["labels"].to(DEVICE)
    fusetune.cross_entropy(logits, labels, num_items=30).backward()
    fusetune.cross_entropy(logits, labels, num_items=30, reduction="sum").backward()
    expected = inputs["logits"].clone().requires_grad_()
    (2 * reference_ce(expected, inputs["labels"], num_items=30)).backward()
    assert_close("accumulated grad", logits.grad, expected.grad, tolerance(torch.float32))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("rows", [3, 20])
def test_all_ignored_gives_zero_loss_and_gradient(reduction, rows):
    logits = (torch.randn(rows, 100, device=DEVICE) * 3).requires_grad_()
    labels = torch.full((rows,), IGNORE, device=DEVICE)
    loss = fusetune.cross_entropy(logits, labels, reduction=reduction, z_loss=1e-3)
    assert torch.equal(loss.detach().cpu(), torch.zeros_like(loss).cpu())
    loss.sum().backward()
    assert torch.equal(logits.grad.cpu(), torch.zeros(rows, 100))


@pytest.mark.parametrize("rows", [3, 24])
def test_masked_vocabulary_with_minus_inf(rows):
    """-inf logits (a masked vocabulary) give the reference's finite loss and a zero gradient
    there."""
    inputs = make_inputs((rows, 260), ignore_fraction=0.0)
    inputs["logits"][:, 200:] = float("-inf")
    inputs["labels"] = inputs["labels"] % 200
    run(inputs, torch.float32, kwargs=dict(logit_scale=2.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows", [3, 24])
def test_inplace_backward(dtype, rows):
    inputs = make_inputs((rows, 515))
    logits = inputs["logits"].to(dtype).to(DEVICE)
    leaf = logits.clone().requires_grad_()
    inner = leaf * 1.0  # a non-leaf buffer, as an lm_head output is
    storage = inner.data_ptr()
    labels = inputs["labels"].to(DEVICE)
    loss = fusetune.cross_entropy(inner, labels, inplace_backward=True, logit_softcap=4.0)
    expected = logits.double().cpu().requires_grad_()
    reference_ce(expected, inputs["labels"], logit_softcap=4.0).backward()
    loss.backward()
    assert_close(
        "loss",
        loss,
        reference_ce(expected.detach(), inputs["labels"], logit_softcap=4.0),
        tolerance(torch.float32),
    )
    assert_close("grad", leaf.grad, expected.grad, tolerance(dtype))
    # the gradient was written over the logits' own storage
    assert_close("buffer", inner.detach(), expected.grad, tolerance(dtype))
    assert inner.data_ptr() == storage


def test_inplace_backward_refuses_when_logits_are_saved_elsewhere():
    """Another autograd node that saved the logits sees them overwritten: autograd must raise."""
    logits = torch.randn(4, 64, device=DEVICE).requires_grad_()
    inner = logits * 1.0
    scale = torch.randn(64, device=DEVICE, requires_grad=True)
    other = (inner * scale).sum()  # saves inner for scale's gradient
    loss = fusetune.cross_entropy(
        inner, torch.randint(0, 64, (4,), device=DEVICE), inplace_backward=True
    )
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (loss + other).backward()


def test_no_grad_forward_matches():
    inputs = make_inputs((9, 400))
    with torch.no_grad():
        loss = fusetune.cross_entropy(
            inputs["logits"].to(torch.float16).to(DEVICE),
            inputs["labels"].to(DEVICE),
            label_smoothing=0.1,
        )
    expected = reference_ce(
        inputs["logits"].to(torch.float16).double(), inputs["labels"], label_smoothing=0.1
    )
    assert_close("loss", loss, expected, tolerance(torch.float32))


def test_empty_batch():
    logits = torch.randn(0, 50, device=DEVICE, requires_grad=True)
    labels = torch.empty(0, dtype=torch.long, device=DEVICE)
    loss = fusetune.cross_entropy(logits, labels)
    loss.backward()
    assert loss.item() == 0.0 and logits.grad.shape == (0, 50)


def test_transposed_logits_are_copied_not_misread():
    """A last dim with stride != 1 is valid input (it is copied into a row-major buffer)."""
    inputs = make_inputs((30, 200))
    logits = inputs["logits"].float().t().contiguous().t().to(DEVICE).requires_grad_()
    assert logits.stride(-1) != 1
    loss = fusetune.cross_entropy(logits, inputs["labels"].to(DEVICE))
    loss.backward()
    expected = inputs["logits"].float().double().requires_grad_()
    reference_ce(expected, inputs["labels"]).backward()
    assert_close("grad", logits.grad, expected.grad, tolerance(torch.float32))


def test_int32_labels():
    inputs = make_inputs((6, 90))
    inputs["labels"] = inputs["labels"].int()
    run(inputs, torch.float32)


def test_out_of_range_label_in_kernel_is_nan_not_out_of_bounds():
    """On the GPU no host check runs: the kernel must not read out of bounds and must flag the
    token by a NaN loss and NaN gradient row, leaving the other rows exact."""
    for rows in (3, 24):  # both launch shapes
        logits = torch.randn(rows, 70, device=DEVICE)
        labels = torch.randint(0, 70, (rows,), device=DEVICE)
        labels[1], labels[2] = 70, -5
        loss, lse, grad = torch.ops.fusetune.cross_entropy_forward(
            logits, labels, torch.ones((), device=DEVICE), IGNORE, 0.0, 0.0, None, None, True
        )
        assert loss[1].isnan() and loss[2].isnan()
        assert grad[1].isnan().all() and grad[2].isnan().all()
        good = torch.ones(rows, dtype=torch.bool)
        good[1:3] = False
        expected = reference_ce(logits.double().cpu()[good], labels.cpu()[good], reduction="none")
        assert_close("other rows", loss.cpu()[good], expected, tolerance(torch.float32))


def test_out_of_range_label_on_cpu_raises():
    logits = torch.randn(3, 10)
    for bad in (10, -1):
        labels = torch.tensor([1, bad, IGNORE])
        assert_raises(ValueError, "labels|[0, 10)", fusetune.cross_entropy, logits, labels)


@pytest.mark.parametrize("mode", ["eager", "compile"])
def test_bad_input(mode):
    call = fusetune.cross_entropy
    if mode == "compile":
        call = torch.compile(
            fusetune.cross_entropy, backend="aot_eager", fullgraph=True, dynamic=True
        )
    logits = torch.randn(4, 10, device=DEVICE)
    labels = torch.randint(0, 10, (4,), device=DEVICE)
    # Under compile the sizes print symbolically (s0): match the words, not the numbers.
    assert_raises(
        ValueError,
        "labels must have shape|logits' leading dims",
        call,
        logits,
        torch.zeros(5, dtype=torch.long, device=DEVICE),
    )
    assert_raises(TypeError, "labels|integer|torch.float32", call, logits, labels.float())
    assert_raises(TypeError, "logits|floating-point", call, labels[:, None].repeat(1, 10), labels)
    assert_raises(ValueError, "logits|[N, V] or [B, T, V]", call, logits[0], labels[0])
    assert_raises(ValueError, "reduction|'avg'", call, logits, labels, reduction="avg")
    assert_raises(
        ValueError,
        "label_smoothing must be in [0.0, 1.0]",
        call,
        logits,
        labels,
        label_smoothing=-0.1,
    )
    assert_raises(
        ValueError, "logit_softcap must be in (0.0, inf]", call, logits, labels, logit_softcap=0.0
    )
    assert_raises(ValueError, "logit_softcap", call, logits, labels, logit_softcap=-30.0)
    assert_raises(ValueError, "logit_scale", call, logits, labels, logit_scale=0.0)
    assert_raises(ValueError, "z_loss", call, logits, labels, z_loss=-1.0)
    assert_raises(
        ValueError, "num_items|reduction", call, logits, labels, num_items=3, reduction="none"
    )
    assert_raises(
        ValueError,
        "inplace_backward",
        call,
        logits,
        labels,
        reduction="none",
        inplace_backward=True,
    )
    assert_raises(TypeError, "labels must be a torch.Tensor", call, logits, [1, 2, 3, 4])


def test_module_matches_function():
    module = fusetune.nn.CrossEntropyLoss(label_smoothing=0.1, logit_softcap=5.0)
    assert "logit_softcap=5.0" in repr(module)
    inputs = make_inputs((5, 120))
    logits, labels = inputs["logits"].float().to(DEVICE), inputs["labels"].to(DEVICE)
    expected = fusetune.cross_entropy(
        logits, labels, label_smoothing=0.1, logit_softcap=5.0, num_items=4
    )
    assert torch.equal(module(logits, labels, num_items=4), expected)


def test_inductor_compile():
    """One case through Inductor itself (the matrix uses aot_eager on the CPU for speed)."""
    run(
        make_inputs((2, 6, 300)),
        torch.bfloat16,
        mode="compile",
        backend="inductor",
        kwargs=dict(logit_softcap=10.0, z_loss=1e-4),
    )


@pytest.mark.skipif(not ON_GPU, reason="needs > 2^31 logits (8.6 GB with the gradient); GPU pass")
def test_more_than_2_to_the_31_elements():
    rows, vocab = 16800, 128256  # 2.15e9 elements
    assert rows * vocab > 2**31
    logits = torch.randn(rows, vocab, device="cuda", dtype=torch.bfloat16).requires_grad_()
    labels = torch.randint(0, vocab, (rows,), device="cuda")
    loss = fusetune.cross_entropy(logits, labels, reduction="none")
    loss.sum().backward()
    tail = slice(rows - 4, rows)  # the rows whose offsets pass 2^31
    expected = logits.detach()[tail].double().requires_grad_()
    reference_ce(expected, labels[tail], reduction="none").sum().backward()
    expected_loss = reference_ce(expected.detach(), labels[tail], reduction="none")
    assert_close("tail loss", loss[tail], expected_loss, tolerance(torch.float32))
    assert_close("tail grad", logits.grad[tail], expected.grad, tolerance(torch.bfloat16))


# ============================================================================ class weights


def class_weighted_inputs(shape, *, zero_class=True):
    """make_inputs plus class weights in [0.1, 2.1) (float64), one of them 0 as a user masking a
    class would set it, with a label of that class present."""
    inputs = make_inputs(shape)
    weight = torch.rand(shape[-1], dtype=torch.float64) * 2 + 0.1
    if zero_class:
        weight[3] = 0.0
        inputs["labels"].view(-1)[0] = 3
    inputs["weight"] = weight
    return inputs


WEIGHT_OPTIONS = {
    "plain": {},
    "smoothing-softcap-zloss": dict(label_smoothing=0.15, logit_softcap=4.0, z_loss=1e-3),
    "num_items": dict(num_items=9),
}
WEIGHT_CASES = [
    (option, reduction, chunks)
    for option in WEIGHT_OPTIONS
    for reduction in ("mean", "sum", "none")
    for chunks in (1, 3)
    if not (option == "num_items" and reduction == "none")
]


@pytest.mark.parametrize("option,reduction,chunks", WEIGHT_CASES)
def test_class_weights(option, reduction, chunks, monkeypatch):
    """Every launch shape and reduction, with smoothing (each class's share weighted) and
    z-loss (not weighted), in bf16 logits."""
    force_launch(monkeypatch, chunks, block=64)
    kwargs = dict(WEIGHT_OPTIONS[option], reduction=reduction)
    run(class_weighted_inputs((7, 300)), torch.bfloat16, kwargs=kwargs)


@pytest.mark.parametrize(
    "dtype,mode,layout",
    [
        (torch.float32, "eager", "contiguous"),
        (torch.float16, "eager", "noncontiguous"),
        (torch.bfloat16, "compile", "noncontiguous"),
        (torch.float32, "compile", "contiguous"),
    ],
    ids=["fp32", "fp16-noncontiguous", "bf16-compile", "fp32-compile"],
)
def test_class_weights_dtypes(dtype, mode, layout, monkeypatch):
    force_launch(monkeypatch, 1)
    kwargs = dict(label_smoothing=0.1, z_loss=1e-3, return_z_loss=True)
    run(class_weighted_inputs((2, 5, 301)), dtype, kwargs=kwargs, mode=mode, layout=layout)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.3])
def test_class_weights_reference_is_torch(reduction, label_smoothing):
    """The float64 reference equals torch.nn.functional.cross_entropy(weight=...)."""
    inputs = class_weighted_inputs((9, 40))
    options = dict(reduction=reduction, label_smoothing=label_smoothing)
    logits, labels, weight = inputs["logits"], inputs["labels"], inputs["weight"]
    want = torch.nn.functional.cross_entropy(logits, labels, weight=weight, **options)
    got = reference_ce(logits, labels, weight=weight, **options)
    assert_close("loss", got, want, 1e-14)


def test_class_weights_with_inplace_backward():
    inputs = class_weighted_inputs((24, 90))
    weight = inputs["weight"].float().to(DEVICE)
    options = dict(weight=weight, label_smoothing=0.1)
    logits = inputs["logits"].float().to(DEVICE).requires_grad_()
    labels = inputs["labels"].to(DEVICE)
    want = fusetune.cross_entropy(logits, labels, **options)
    (want_grad,) = torch.autograd.grad(want, logits)
    scratch = logits.detach().clone().requires_grad_()
    got = fusetune.cross_entropy(scratch * 1.0, labels, inplace_backward=True, **options)
    (grad,) = torch.autograd.grad(got, scratch)
    assert_close("loss", got, want, 1e-6)
    assert_close("grad", grad, want_grad, 1e-6)


def test_class_weights_all_ignored_or_zero_weight_mean_is_zero():
    logits = torch.randn(4, 10, device=DEVICE, requires_grad=True)
    weight = torch.ones(10, device=DEVICE)
    weight[2] = 0.0
    for labels in ([IGNORE] * 4, [2, 2, IGNORE, 2]):
        labels = torch.tensor(labels, device=DEVICE)
        loss = fusetune.cross_entropy(logits, labels, weight=weight)
        (grad,) = torch.autograd.grad(loss, logits)
        assert loss.item() == 0.0 and not grad.any()


@pytest.mark.parametrize("mode", ["eager", "compile"])
def test_class_weights_bad_input(mode):
    call = fusetune.cross_entropy
    if mode == "compile":
        call = torch.compile(
            fusetune.cross_entropy, backend="aot_eager", fullgraph=True, dynamic=True
        )
    logits = torch.randn(4, 10, device=DEVICE)
    labels = torch.randint(0, 10, (4,), device=DEVICE)
    weight = torch.ones(9, device=DEVICE)
    assert_raises(ValueError, "weight must have shape|one weight per class", call, logits,
                  labels, weight=weight)  # fmt: skip
    assert_raises(TypeError, "weight", call, logits, labels, weight=torch.ones(10, device=DEVICE,
                  dtype=torch.long))  # fmt: skip
