"""fusetune.linear_cross_entropy against its float64 reference, across the dtype-contract
matrix, the loss options, mixed precision, frozen weights and bad input."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fusetune
from fusetune.ops import cross_entropy as ce_module
from fusetune.ops import linear_cross_entropy as lce_module
from fusetune.reference import linear_cross_entropy as reference_lce
from harness import (
    DEVICE,
    ON_GPU,
    assert_close,
    assert_raises,
    check_op,
    compiled,
    matrix,
    tolerance,
    uses_kernels,
)
from test_cross_entropy import OPTION_CASES, OPTIONS, force_launch

IGNORE = -100


def make_inputs(lead: tuple[int, ...], hidden_size: int, vocab: int, *, bias: bool = False):
    """hidden and weight scaled so the logits spread over a few units (as a trained lm_head's
    do), labels with some positions ignored."""
    inputs = {
        "hidden": torch.randn(*lead, hidden_size, dtype=torch.float64),
        "weight": torch.randn(vocab, hidden_size, dtype=torch.float64) * 2 / hidden_size**0.5,
        "labels": torch.randint(0, vocab, lead),
    }
    inputs["labels"][torch.rand(lead) < 0.2] = IGNORE
    if bias:
        inputs["bias"] = torch.randn(vocab, dtype=torch.float64)
    return inputs


def run(inputs, dtype, *, grad=None, **kw):
    outputs = 2 if kw.get("kwargs", {}).get("return_z_loss") else 1
    names = [name for name in ("hidden", "weight", "bias") if name in inputs]
    return check_op(
        fusetune.linear_cross_entropy,
        reference_lce,
        inputs,
        dtype=dtype,
        cast=names,
        grad=names if grad is None else grad,
        output_dtypes=[torch.float32] * outputs,
        **kw,
    )


# Each variant forces several row chunks (chunk_size) and one launch shape of the
# cross-entropy kernels, so that the CPU and the GPU pass test the same paths.
VARIANTS = {
    "3d-shift-mean-bias-all-options": (
        (2, 9),
        24,
        301,
        True,
        1,
        dict(
            shift=True,
            chunk_size=4,
            label_smoothing=0.1,
            logit_softcap=3.0,
            logit_scale=0.7,
            z_loss=1e-3,
            return_z_loss=True,
        ),
    ),
    "2d-none-split-rows": (
        (11,),
        40,
        517,
        False,
        3,
        dict(reduction="none", chunk_size=5, logit_softcap=30.0),
    ),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
@matrix()
def test_matrix(variant, dtype, autocast, mode, layout, monkeypatch):
    lead, hidden_size, vocab, bias, ce_chunks, kwargs = VARIANTS[variant]
    force_launch(monkeypatch, ce_chunks, block=64)
    assert uses_kernels(torch.empty(0, dtype=dtype, device=DEVICE))
    inputs = make_inputs(lead, hidden_size, vocab, bias=bias)
    run(inputs, dtype, kwargs=kwargs, mode=mode, autocast=autocast, layout=layout)


@pytest.mark.parametrize("option,reduction", OPTION_CASES)
def test_options(option, reduction):
    kwargs = dict(OPTIONS[option], reduction=reduction, chunk_size=3)
    if isinstance(kwargs.get("num_items"), torch.Tensor):
        kwargs["num_items"] = kwargs["num_items"].to(DEVICE)
    inputs = make_inputs((7,), 16, 97)
    if "ignore_index" in kwargs:
        inputs["labels"][inputs["labels"] == IGNORE] = kwargs["ignore_index"]
    run(inputs, torch.bfloat16, kwargs=kwargs)


@pytest.mark.parametrize(
    "hidden_dtype,weight_dtype,expected",
    [
        (torch.bfloat16, torch.float32, torch.bfloat16),
        (torch.float32, torch.float16, torch.float16),
        (torch.float32, torch.float32, torch.float32),
    ],
)
def test_mixed_dtypes_without_autocast(hidden_dtype, weight_dtype, expected):
    """The documented rule: fp32 mixed with a 16-bit dtype computes in the 16-bit one; each
    gradient comes back in its own input's dtype."""
    inputs = make_inputs((2, 6), 32, 200, bias=True)
    inputs["bias"] = inputs["bias"].to(torch.float32)
    assert reference_lce.__module__  # the oracle casts by the same rule
    run(
        inputs,
        hidden_dtype,
        input_dtypes={"weight": weight_dtype, "bias": torch.float32},
        compute_dtype=expected,
        kwargs=dict(chunk_size=5),
    )
    hidden = torch.randn(3, 8, device=DEVICE, dtype=hidden_dtype)
    weight = torch.randn(10, 8, device=DEVICE, dtype=weight_dtype)
    assert lce_module.matmul_dtype(hidden, weight) == expected


@pytest.mark.parametrize("mode", ["eager", "compile"])
def test_autocast_fp32_weights_as_hf_trainer(mode):
    """HF Trainer with bf16=True: fp32 parameters and hidden states under autocast. The matmul
    runs in bf16 and the gradients come back in fp32 (no 'mat1 and mat2' dtype error)."""
    inputs = make_inputs((2, 7), 32, 150, bias=True)
    run(inputs, torch.float32, autocast=torch.bfloat16, mode=mode, kwargs=dict(chunk_size=4))


def test_float16_with_bfloat16_is_an_error():
    hidden = torch.randn(3, 8, device=DEVICE, dtype=torch.float16)
    weight = torch.randn(10, 8, device=DEVICE, dtype=torch.bfloat16)
    labels = torch.zeros(3, dtype=torch.long, device=DEVICE)
    assert_raises(
        TypeError,
        "float16|bfloat16|autocast",
        fusetune.linear_cross_entropy,
        hidden,
        weight,
        labels,
    )


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("frozen", ["weight", "weight+bias", "hidden"])
def test_frozen_inputs_get_no_gradient(frozen, reduction):
    """A frozen lm_head (LoRA) gets no gradient and costs none; the others stay exact."""
    inputs = make_inputs((9,), 16, 120, bias=True)
    trainable = [n for n in ("hidden", "weight", "bias") if n not in frozen.split("+")]
    result = run(
        inputs, torch.bfloat16, grad=trainable, kwargs=dict(reduction=reduction, chunk_size=4)
    )
    assert set(result.grads) == set(trainable)


def test_frozen_weight_skips_its_matmul(monkeypatch):
    """The weight-gradient matmul is not run at all, not run and dropped."""
    calls = []
    original = lce_module._Grads.add_chunk

    def spy(self, *args):
        calls.append(self.weight.numel())
        return original(self, *args)

    monkeypatch.setattr(lce_module._Grads, "add_chunk", spy)
    hidden = torch.randn(6, 8, device=DEVICE, requires_grad=True)
    weight = torch.randn(30, 8, device=DEVICE)
    labels = torch.randint(0, 30, (6,), device=DEVICE)
    fusetune.linear_cross_entropy(hidden, weight, labels, chunk_size=2).backward()
    if uses_kernels(hidden):
        assert calls == [0, 0, 0]
    assert weight.grad is None and hidden.grad is not None


def test_matches_torch_linear_plus_cross_entropy():
    """Plain options: the same as F.linear + F.cross_entropy, the computation it replaces."""
    inputs = make_inputs((4, 5), 16, 64)
    hidden, weight, labels = (inputs[k].to(DEVICE) for k in ("hidden", "weight", "labels"))
    hidden, weight = hidden.float(), weight.float()
    got = fusetune.linear_cross_entropy(hidden, weight, labels, shift=True, chunk_size=3)
    logits = F.linear(hidden[:, :-1], weight)
    want = F.cross_entropy(logits.reshape(-1, 64), labels[:, 1:].reshape(-1), ignore_index=IGNORE)
    assert_close("loss", got, want, tolerance(torch.float32))


def test_shift_does_not_copy_hidden(monkeypatch):
    """shift=True hands the op hidden's own storage (a view), however it is chunked."""
    seen = []
    original = lce_module._forward_op

    def spy(hidden, *args):
        seen.append(hidden.data_ptr())
        return original(hidden, *args)

    monkeypatch.setattr(lce_module, "_forward_op", spy)
    hidden = torch.randn(2, 6, 8, device=DEVICE, requires_grad=True)
    weight = torch.randn(30, 8, device=DEVICE)
    labels = torch.randint(0, 30, (2, 6), device=DEVICE)
    fusetune.linear_cross_entropy(hidden, weight, labels, shift=True)
    if uses_kernels(hidden):
        assert seen == [hidden.data_ptr()]


@pytest.mark.parametrize("lead", [(1,), (1, 1), (1, 2), (3, 1)])
def test_tiny_shapes(lead):
    """One row; with shift, a sequence of one token has nothing to predict (loss 0, no NaN)."""
    inputs = make_inputs(lead, 8, 33)
    shift = len(lead) == 2
    result = run(inputs, torch.float32, kwargs=dict(shift=shift))
    assert torch.isfinite(result.outputs[0]).all()


def test_int32_labels_and_gradient_accumulation():
    """Two micro-batches normalised by the whole batch's token count (num_items) sum to the
    loss and gradient of one call over both."""
    inputs = make_inputs((2, 8), 16, 90)
    hidden = inputs["hidden"].float().to(DEVICE).requires_grad_()
    weight = inputs["weight"].float().to(DEVICE).requires_grad_()
    labels = inputs["labels"].to(DEVICE).int()
    whole = fusetune.linear_cross_entropy(hidden, weight, labels, shift=True)
    whole_grads = torch.autograd.grad(whole, (hidden, weight))
    count = (labels[:, 1:] != IGNORE).sum()
    parts = sum(
        fusetune.linear_cross_entropy(
            hidden[i : i + 1], weight, labels[i : i + 1], shift=True, num_items=count
        )
        for i in range(2)
    )
    part_grads = torch.autograd.grad(parts, (hidden, weight))
    assert_close("loss", parts, whole, 1e-6)
    for got, want in zip(part_grads, whole_grads, strict=True):
        assert_close("grad", got, want, 1e-5)


def test_module():
    loss_fn = fusetune.nn.LinearCrossEntropyLoss(shift=True, logit_softcap=5.0, chunk_size=3)
    inputs = make_inputs((2, 5), 8, 40)
    hidden, weight = (inputs[k].float().to(DEVICE) for k in ("hidden", "weight"))
    labels = inputs["labels"].to(DEVICE)
    got = loss_fn(hidden, weight, labels)
    want = reference_lce(hidden, weight, labels, shift=True, logit_softcap=5.0)
    assert_close("loss", got, want, tolerance(torch.float32))
    assert "logit_softcap=5.0" in repr(loss_fn)


def test_chunk_rows_memory_rule(monkeypatch):
    """Chunks are sized from the weight and the free memory, never from N x V: 1/8 of the
    weight's bytes, at least 1024 rows and 256 MiB, at most a quarter of the free memory."""
    weight = torch.empty(128_256, 4096, dtype=torch.bfloat16, device="meta")
    assert lce_module.chunk_rows(8192, weight) == 1024  # 1/8 of the weight is 512 rows
    assert lce_module.chunk_rows(1 << 20, weight) == 1024  # independent of N
    assert lce_module.chunk_rows(10, weight) == 10
    assert lce_module.chunk_rows(8192, weight, override=100) == 100
    big = torch.empty(128_256, 16384, dtype=torch.bfloat16, device="meta")
    assert lce_module.chunk_rows(1 << 20, big) == 2048  # 1/8 of its bytes
    small_vocab = torch.empty(32_000, 512, dtype=torch.bfloat16, device="meta")
    rows = lce_module.chunk_rows(1 << 20, small_vocab)  # 256 MiB of logits
    assert rows % lce_module.ROW_ALIGN == 0 and 4096 <= rows <= 256 * 2**20 // 64_000
    monkeypatch.setattr(lce_module, "_free_bytes", lambda device: 256 * 2**20)
    assert lce_module.chunk_rows(8192, weight) * 128_256 * 2 <= 64 * 2**20


BAD_INPUTS = {
    "in-features": (dict(hidden=(4, 12)), "hidden's last dim|(4, 12)|(50, 16)"),
    "logits-for-hidden": (dict(hidden=(4, 50)), "(4, 50)|(50, 16)|looks like logits"),
    "labels-shape": (dict(labels=(5,)), "labels must have shape (4,)|(5,)"),
    "bias-length": (dict(bias=(49,)), "bias must have shape (50,)|(49,)"),
    "weight-1d": (dict(weight=(50,)), "weight|must be|[V, H]"),
    "hidden-4d": (
        dict(hidden=(1, 1, 4, 16), labels=(1, 1, 4)),
        "hidden|must be|[N, H] or [B, T, H]",
    ),
}


@pytest.mark.parametrize("mode", ["eager", "compile"])
@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input(case, mode):
    shapes, match = BAD_INPUTS[case]
    shapes = {"hidden": (4, 16), "weight": (50, 16), "labels": (4,), "bias": None, **shapes}
    hidden = torch.randn(*shapes["hidden"], device=DEVICE)
    weight = torch.randn(*shapes["weight"], device=DEVICE)
    labels = torch.randint(0, 50, shapes["labels"], device=DEVICE)
    bias = None if shapes["bias"] is None else torch.randn(*shapes["bias"], device=DEVICE)
    fn = fusetune.linear_cross_entropy
    if mode == "compile":
        # Under dynamic shapes the message prints sizes symbolically (s0): check the words.
        fn = compiled(fn, DEVICE)
        match = "|".join(w for w in match.split("|") if not any(c.isdigit() for c in w))
    assert_raises(ValueError, match, fn, hidden, weight, labels, bias)


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(reduction="avg"), ValueError, "reduction"),
        (dict(chunk_size=0), ValueError, "chunk_size"),
        (dict(reduction="none", num_items=3), ValueError, "num_items"),
        (dict(logit_softcap=-1.0), ValueError, "logit_softcap"),
        (dict(labels_float=True), TypeError, "labels"),
    ],
)
def test_bad_options(kwargs, error, match):
    hidden = torch.randn(4, 16, device=DEVICE)
    weight = torch.randn(50, 16, device=DEVICE)
    labels = torch.randint(0, 50, (4,), device=DEVICE)
    if kwargs.pop("labels_float", False):
        labels = labels.float()
    assert_raises(error, match, fusetune.linear_cross_entropy, hidden, weight, labels, **kwargs)


def test_out_of_range_label_on_cpu():
    hidden, weight = torch.randn(3, 8), torch.randn(20, 8)
    labels = torch.tensor([1, 20, 2])
    assert_raises(ValueError, "[0, 20)|20", fusetune.linear_cross_entropy, hidden, weight, labels)


@pytest.mark.skipif(not ON_GPU, reason="peak memory of large shapes: GPU pass")
def test_peak_memory_does_not_grow_with_rows():
    """Extra memory above the inputs and gradients is one chunk of logits, whatever N."""
    vocab, hidden_size = 32_000, 1024
    weight = torch.randn(vocab, hidden_size, device="cuda", dtype=torch.bfloat16) * 0.03
    weight.requires_grad_()
    extras = []
    for n_rows in (4096, 16384):
        hidden = torch.randn(n_rows, hidden_size, device="cuda", dtype=torch.bfloat16)
        hidden.requires_grad_()
        labels = torch.randint(0, vocab, (n_rows,), device="cuda")
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fusetune.linear_cross_entropy(hidden, weight, labels).backward()
        torch.cuda.synchronize()
        grads = hidden.grad.nbytes + weight.grad.nbytes
        extras.append(torch.cuda.max_memory_allocated() - base - grads)
        hidden.grad = weight.grad = None
    rows = lce_module.chunk_rows(16384, weight)
    assert extras[1] <= rows * vocab * 2 + 64 * 2**20, extras
    assert extras[1] <= extras[0] + 8 * 2**20, extras  # per-row fp32 stats only


def test_launch_shapes_reused_from_cross_entropy(monkeypatch):
    """The split-row cross-entropy path also works in place on a chunk buffer."""
    force_launch(monkeypatch, 4, block=32)
    assert ce_module._launch_plan(4, 300, DEVICE).chunks == 4
    run(make_inputs((6,), 16, 300, bias=True), torch.float16, kwargs=dict(chunk_size=4))


def test_no_grad_forward_matches():
    """Evaluation / a reference policy: no gradient work, the same loss."""
    inputs = make_inputs((10,), 16, 77)
    hidden, weight = (inputs[k].float().to(DEVICE) for k in ("hidden", "weight"))
    labels = inputs["labels"].to(DEVICE)
    with torch.no_grad():
        got = fusetune.linear_cross_entropy(hidden, weight, labels, reduction="none", chunk_size=3)
    want = reference_lce(hidden, weight, labels, reduction="none")
    assert_close("loss", got, want, tolerance(torch.float32))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_ignored_gives_zero_loss_and_gradient(reduction):
    hidden = torch.randn(5, 8, device=DEVICE, requires_grad=True)
    weight = torch.randn(40, 8, device=DEVICE, requires_grad=True)
    labels = torch.full((5,), IGNORE, device=DEVICE)
    loss = fusetune.linear_cross_entropy(hidden, weight, labels, reduction=reduction, chunk_size=2)
    loss.sum().backward()
    assert torch.equal(loss, torch.zeros_like(loss))
    assert torch.equal(hidden.grad, torch.zeros_like(hidden))
    assert torch.equal(weight.grad, torch.zeros_like(weight))


def test_gradients_accumulate_across_calls():
    inputs = make_inputs((6,), 8, 50)
    hidden, weight = (inputs[k].float().to(DEVICE).requires_grad_() for k in ("hidden", "weight"))
    labels = inputs["labels"].to(DEVICE)
    fusetune.linear_cross_entropy(hidden, weight, labels, chunk_size=4).backward()
    first = weight.grad.clone()
    fusetune.linear_cross_entropy(hidden, weight, labels, chunk_size=4).backward()
    assert_close("grad weight", weight.grad, 2 * first, 1e-6)


@pytest.mark.skipif(not ON_GPU, reason="host-device syncs exist only with a GPU")
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("weights", [False, True], ids=["plain", "class+token-weights"])
def test_no_host_device_sync(reduction, weights):
    hidden = torch.randn(300, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(1000, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, 1000, (300,), device="cuda")
    options = {}
    if weights:
        options = dict(class_weight=torch.rand(1000, device="cuda"),
                       token_weight=torch.rand(300, device="cuda"))  # fmt: skip
    fusetune.linear_cross_entropy(hidden, weight, labels, reduction=reduction, **options)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss = fusetune.linear_cross_entropy(
            hidden,
            weight,
            labels,
            reduction=reduction,
            chunk_size=128,
            num_items=None,
            **options,
        )
        loss.sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


# ============================================================================ loss weights


def weighted_inputs(lead, hidden_size, vocab, *, which=("class", "token")):
    """make_inputs plus float64 class weights in [0.1, 2.1) with one class at 0 (and a label
    of it present) and token weights in [0, 2) shaped like labels."""
    inputs = make_inputs(lead, hidden_size, vocab)
    if "class" in which:
        class_weight = torch.rand(vocab, dtype=torch.float64) * 2 + 0.1
        class_weight[3] = 0.0
        inputs["labels"].view(-1)[0] = 3
        inputs["class_weight"] = class_weight
    if "token" in which:
        inputs["token_weight"] = torch.rand(lead, dtype=torch.float64) * 2
    return inputs


WEIGHT_KINDS = {"class": ("class",), "token": ("token",), "both": ("class", "token")}
WEIGHT_CASES = [
    (kind, reduction, chunks)
    for kind in WEIGHT_KINDS
    for reduction in ("mean", "sum", "none")
    for chunks in (1, 3)
    if chunks == 1 or kind == "both"
]


@pytest.mark.parametrize("kind,reduction,chunks", WEIGHT_CASES)
def test_loss_weights(kind, reduction, chunks, monkeypatch):
    """Class and token weights against the float64 reference in every reduction, over several
    row chunks, with smoothing and z-loss; both cross-entropy launch shapes."""
    force_launch(monkeypatch, chunks, block=64)
    kwargs = dict(reduction=reduction, chunk_size=4, label_smoothing=0.1, z_loss=1e-3)
    inputs = weighted_inputs((11,), 16, 200, which=WEIGHT_KINDS[kind])
    run(inputs, torch.bfloat16, kwargs=kwargs)


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
def test_loss_weights_dtypes(dtype, mode, layout, monkeypatch):
    """Both weights with shift, bias, num_items and return_z_loss, in each dtype and compiled."""
    force_launch(monkeypatch, 1, block=64)
    inputs = weighted_inputs((2, 6), 16, 130)
    inputs["bias"] = torch.randn(130, dtype=torch.float64)
    kwargs = dict(shift=True, chunk_size=5, z_loss=1e-3, return_z_loss=True, num_items=7)
    run(inputs, dtype, kwargs=kwargs, mode=mode, layout=layout)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.3])
def test_class_weight_reference_is_torch(reduction, label_smoothing):
    """The float64 reference equals F.cross_entropy(hidden @ W.T, weight=...)."""
    inputs = weighted_inputs((9,), 16, 40, which=("class",))
    hidden, weight, labels = inputs["hidden"], inputs["weight"], inputs["labels"]
    options = dict(reduction=reduction, label_smoothing=label_smoothing)
    want = F.cross_entropy(hidden @ weight.T, labels, weight=inputs["class_weight"], **options)
    got = reference_lce(hidden, weight, labels, class_weight=inputs["class_weight"], **options)
    assert_close("loss", got, want, 1e-14)


def test_token_weight_reference_is_weighted_sum():
    """Token weights in the reference: sum(t * loss) / sum(t) over the non-ignored tokens."""
    inputs = weighted_inputs((12,), 8, 30, which=("token",))
    hidden, weight, labels = inputs["hidden"], inputs["weight"], inputs["labels"]
    token_weight = inputs["token_weight"]
    per_token = F.cross_entropy(hidden @ weight.T, labels, reduction="none")
    valid = labels != IGNORE
    want = (per_token * token_weight).sum() / token_weight[valid].sum()
    got = reference_lce(hidden, weight, labels, token_weight=token_weight)
    assert_close("loss", got, want, 1e-14)


def test_unit_token_weights_change_nothing():
    inputs = weighted_inputs((2, 7), 16, 50, which=())
    hidden, weight = (inputs[k].float().to(DEVICE) for k in ("hidden", "weight"))
    labels = inputs["labels"].to(DEVICE)
    ones = torch.ones(labels.shape, device=DEVICE)
    want = fusetune.linear_cross_entropy(hidden, weight, labels, shift=True, chunk_size=3)
    got = fusetune.linear_cross_entropy(hidden, weight, labels, shift=True, chunk_size=3,
                                        token_weight=ones)  # fmt: skip
    assert_close("loss", got, want, 1e-6)


def test_zero_weights_give_zero_mean_and_gradient():
    """All token weights 0, or every label of a class weighted 0: loss 0, not NaN."""
    hidden = torch.randn(4, 8, device=DEVICE, requires_grad=True)
    weight = torch.randn(10, 8, device=DEVICE)
    class_weight = torch.ones(10, device=DEVICE)
    class_weight[2] = 0.0
    labels = torch.tensor([2, 2, IGNORE, 2], device=DEVICE)
    for options in (dict(class_weight=class_weight),
                    dict(token_weight=torch.zeros(4, device=DEVICE))):  # fmt: skip
        loss = fusetune.linear_cross_entropy(hidden, weight, labels, **options)
        (grad,) = torch.autograd.grad(loss, hidden)
        assert loss.item() == 0.0 and not grad.any()


def test_unweighted_call_takes_the_plain_path(monkeypatch):
    """Without token weights the gradient comes from the statistics pass alone (no second
    kernel), and the kernels get no class weights."""
    seen = []
    original_write, original_stats = ce_module._write_grad, ce_module._forward_stats
    monkeypatch.setattr(ce_module, "_write_grad", lambda *a: seen.append("write") or
                        original_write(*a))  # fmt: skip
    monkeypatch.setattr(ce_module, "_forward_stats", lambda *a: seen.append(a[2].class_weight)
                        or original_stats(*a))  # fmt: skip
    hidden = torch.randn(6, 8, device=DEVICE, requires_grad=True)
    weight = torch.randn(30, 8, device=DEVICE)
    labels = torch.randint(0, 30, (6,), device=DEVICE)
    fusetune.linear_cross_entropy(hidden, weight, labels, chunk_size=4).backward()
    if uses_kernels(hidden):
        assert seen == [None, None]


@pytest.mark.parametrize("mode", ["eager", "compile"])
def test_loss_weights_bad_input(mode):
    fn = compiled(fusetune.linear_cross_entropy, DEVICE) if mode == "compile" else (
        fusetune.linear_cross_entropy
    )  # fmt: skip
    hidden, weight = torch.randn(4, 16, device=DEVICE), torch.randn(50, 16, device=DEVICE)
    labels = torch.randint(0, 50, (4,), device=DEVICE)
    assert_raises(ValueError, "class_weight must have shape", fn, hidden, weight, labels,
                  class_weight=torch.ones(49, device=DEVICE))  # fmt: skip
    assert_raises(ValueError, "token_weight must have shape", fn, hidden, weight, labels,
                  token_weight=torch.ones(5, device=DEVICE))  # fmt: skip
    assert_raises(TypeError, "class_weight", fn, hidden, weight, labels,
                  class_weight=torch.ones(50, device=DEVICE, dtype=torch.long))  # fmt: skip


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_fp32_weight_gradient_is_summed_in_fp32(reduction):
    """fp32 master weights under bf16 autocast: the weight gradient is summed over the row
    chunks in fp32 (one bf16 rounding a chunk would drift with the chunk count), so many
    chunks give one chunk's gradient to fp32 accuracy."""
    inputs = make_inputs((64,), 32, 200)
    hidden, weight = (inputs[k].float().to(DEVICE).requires_grad_() for k in ("hidden", "weight"))
    labels = inputs["labels"].to(DEVICE)
    upstream = torch.randn(64, device=DEVICE) if reduction == "none" else torch.ones(())
    grads = []
    for chunk_size in (64, 4):
        with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
            loss = fusetune.linear_cross_entropy(hidden, weight, labels, reduction=reduction,
                                                 chunk_size=chunk_size)  # fmt: skip
        grads.append(torch.autograd.grad(loss, (hidden, weight), upstream.to(DEVICE)))
    for one, many in zip(*grads, strict=True):
        assert many.dtype == torch.float32
        assert_close("gradient over 16 chunks", many, one, 1e-5)
