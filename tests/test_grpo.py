"""fusetune.selective_log_softmax and fusetune.grpo_loss against their float64 references,
across the dtype-contract matrix, every loss type and importance-sampling level, gradient
accumulation, symbolic shapes under torch.compile, and bad input; and the reference against a
plain per-token loop of the formulas."""

from __future__ import annotations

import collections
import itertools
import math
import types

import pytest
import torch

import fusetune
from fusetune.ops import linear_cross_entropy as lce_module
from fusetune.reference import grpo as reference
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
from test_cross_entropy import force_launch

# Log-ratio offsets of the old policy, at least 0.13 away from the clip bounds (log 0.8,
# log 1.2) and delta (log 1.5), so that a 16-bit matmul's rounding cannot flip a token between
# clipped and not (a flip changes that token's gradient entirely, not by a rounding).
LOG_RATIO_OFFSETS = torch.tensor([-0.6, -0.05, 0.0, 0.05, 0.6], dtype=torch.float64)
CLIP_METRICS = (
    "clip_ratio_low",
    "clip_ratio_high",
    "clip_ratio",
    "clip_ratio_low_min",
    "clip_ratio_high_max",
)
METRICS = ("kl", *CLIP_METRICS, "cispo_clip_ratio", "vespo_phi_seq_mean")
# CISPO clips the ratio itself at epsilon_high (its eps_max): log 1.2 is 0.13 from the offsets.
CISPO_EPSILON_HIGH = 1.2
# The logits are held in the matmul dtype, as F.linear's are: an absolute rounding of about
# 0.4 % of |logit| in bf16. The ratio exp(l - old) turns that absolute error of l into a
# relative one of the gradient, and k3 ~ (ref - l)^2 / 2 doubles it; the measured worst case
# over seeds is 1.5x the table's 16-bit tolerance (0.07x in fp32), hence:
GRPO_TOLERANCE_FACTOR = 2.0
# The KL metric estimates a small quantity, ~ (ref - l)^2 / 2: its relative error grows without
# bound as ref - l shrinks, so 16-bit cases leave it out; fp32 cases check it.
METRICS_16BIT = tuple(name for name in METRICS if name != "kl")


def make_inputs(
    batch,
    time,
    hidden_size,
    vocab,
    *,
    dtype=torch.float64,
    sequence_ratio=False,
    bias=False,
    **logit_options,
):
    """Hidden states whose logits spread over a few units, sampled tokens, a mask with padding
    at the end of each sequence (and one empty completion), advantages of both signs, and old /
    reference log-probs placed relative to the policy's own (computed in ``dtype``, with the
    test's ``logit_options``)."""
    inputs = {
        "hidden": torch.randn(batch, time, hidden_size, dtype=torch.float64),
        "weight": torch.randn(vocab, hidden_size, dtype=torch.float64) * 2 / hidden_size**0.5,
        "token_ids": torch.randint(0, vocab, (batch, time)),
    }
    lengths = torch.randint(1, time + 1, (batch,))
    lengths[0] = time
    if batch > 2:
        lengths[-1] = 0
    inputs["completion_mask"] = torch.arange(time)[None, :] < lengths[:, None]
    inputs["advantages"] = torch.randn(batch, dtype=torch.float32)
    if bias:
        inputs["bias"] = torch.randn(vocab, dtype=torch.float64)
    # Rounded to dtype already, so that an autocast cast is exact and the test measures the
    # op's arithmetic (the 16-bit logits), not input rounding the reference never sees.
    lm_head = {}
    for name in ("hidden", "weight", "bias"):
        if name in inputs:
            inputs[name] = lm_head[name] = inputs[name].to(dtype).double()
    with torch.no_grad():
        logps = reference.selective_log_softmax(
            token_ids=inputs["token_ids"], **lm_head, **logit_options
        )
    shape = (batch, 1) if sequence_ratio else (batch, time)
    offsets = LOG_RATIO_OFFSETS[torch.randint(0, len(LOG_RATIO_OFFSETS), shape)]
    inputs["old_logps"] = (logps - offsets).float()
    inputs["ref_logps"] = (logps + 0.3 * torch.randn(batch, time, dtype=torch.float64)).float()
    return inputs


def flat_grpo(op, metrics=METRICS, loss_shift=0.0):
    """The op with (some of) its metrics dict flattened into outputs, in a fixed order, and its
    loss shifted by a constant (see ``terms_size``)."""

    def run(**kwargs):
        loss, values = op(**kwargs)
        return (loss + loss_shift, *(values[name] for name in metrics))

    return run


def metric_names(inputs, kwargs, metrics=METRICS):
    """The names among ``metrics`` that grpo_loss returns for these inputs and options."""
    loss_type = kwargs.get("loss_type", "grpo")
    returned = {"kl"} if "ref_logps" in inputs else set()
    if loss_type in reference.CLIPPED_LOSS_TYPES:
        returned.update(CLIP_METRICS)
    returned.add({"cispo": "cispo_clip_ratio", "vespo": "vespo_phi_seq_mean"}.get(loss_type))
    return tuple(name for name in metrics if name in returned)


def loss_options(kwargs):
    """(LossOptions, logit options) from a grpo_loss keyword dict."""
    logit_names = ("temperature", "logit_softcap", "logit_scale")
    logit_options = {k: v for k, v in kwargs.items() if k in logit_names}
    names = reference.LossOptions._fields
    return reference.LossOptions(**{k: v for k, v in kwargs.items() if k in names}), logit_options


def terms_size(inputs, kwargs):
    """sum_t w_t |L_t| in float64: the size of the loss's terms. Advantages of both signs make
    the loss a cancelling sum, whose relative error says nothing; tests compare loss + 2 x this
    instead (between 1x and 3x it), which bounds the loss's absolute error by the size of its
    terms. Gradients are unaffected by the constant."""
    options, logit_options = loss_options(kwargs)
    with torch.no_grad():
        logps = reference.selective_log_softmax(
            inputs["hidden"],
            inputs["weight"],
            inputs["token_ids"],
            bias=inputs.get("bias"),
            **logit_options,
        )
        mask = inputs["completion_mask"]
        losses, _, _ = reference.loss_terms(
            logps,
            mask,
            inputs["advantages"],
            inputs.get("old_logps"),
            inputs.get("ref_logps"),
            options,
        )
        weights = reference.token_weights(
            mask,
            options.loss_type,
            options.max_completion_length,
            options.num_items_in_batch,
            torch.float64,
        )
    return float((weights * losses.abs()).sum())


def run_grpo(inputs, dtype, grad=("hidden", "weight"), kwargs=None, metrics=METRICS, **kw):
    """check_op of grpo_loss (loss and metrics) against the float64 reference."""
    kwargs = dict(kwargs or {})
    metrics = metric_names(inputs, kwargs, metrics)
    shift = 2 * terms_size(inputs, kwargs)
    return check_op(
        flat_grpo(fusetune.grpo_loss, metrics, shift),
        flat_grpo(reference.grpo_loss, metrics, shift),
        inputs,
        dtype=dtype,
        cast=[name for name in ("hidden", "weight", "bias") if name in inputs],
        grad=grad,
        output_dtypes=[torch.float32] * (1 + len(metrics)),
        kwargs=kwargs,
        tolerance_factor=GRPO_TOLERANCE_FACTOR,
        **kw,
    )


# ============================================================================ selective_log_softmax


# A thin wrapper of linear cross-entropy (whose own tests run the full matrix): every dtype
# and mode, with padded rows, plus autocast.
@pytest.mark.parametrize("mode", ["eager", "compile"])
@pytest.mark.parametrize(
    "dtype,autocast",
    [
        (torch.float32, None),
        (torch.float16, None),
        (torch.bfloat16, None),
        (torch.float32, torch.bfloat16),
    ],
    ids=["fp32", "fp16", "bf16", "fp32-amp"],
)
def test_selective_log_softmax(dtype, autocast, mode, monkeypatch):
    force_launch(monkeypatch, 2, block=64)
    inputs = make_inputs(2, 7, 24, 301)
    inputs = {k: inputs[k] for k in ("hidden", "weight", "token_ids")}
    inputs["bias"] = torch.randn(301, dtype=torch.float64)
    check_op(
        fusetune.selective_log_softmax,
        reference.selective_log_softmax,
        inputs,
        dtype=dtype,
        cast=["hidden", "weight", "bias"],
        grad=["hidden", "weight", "bias"],
        output_dtypes=[torch.float32],
        kwargs=dict(temperature=0.7, logit_softcap=3.0, logit_scale=0.8, chunk_size=5),
        mode=mode,
        autocast=autocast,
        layout="noncontiguous",
    )


@pytest.mark.parametrize(
    "options",
    [
        dict(temperature=0.6),
        dict(temperature=1.3, logit_scale=0.5),
        dict(temperature=0.9, logit_softcap=2.0),
        dict(logit_softcap=2.0, logit_scale=2.0),
    ],
)
def test_temperature_folds_into_scale_and_softcap(options):
    """The op folds the temperature into the logit scale and softcap; the reference divides
    the transformed logits by it. Both must agree."""
    inputs = make_inputs(3, 4, 16, 97)
    inputs = {k: inputs[k] for k in ("hidden", "weight", "token_ids")}
    check_op(
        fusetune.selective_log_softmax,
        reference.selective_log_softmax,
        inputs,
        dtype=torch.float32,
        cast=["hidden", "weight"],
        grad=["hidden", "weight"],
        output_dtypes=[torch.float32],
        kwargs=options,
    )


def test_ignored_token_gives_zero():
    hidden = torch.randn(2, 3, 8, device=DEVICE, requires_grad=True)
    weight = torch.randn(20, 8, device=DEVICE)
    token_ids = torch.tensor([[1, -100, 2], [-100, -100, 3]], device=DEVICE)
    logps = fusetune.selective_log_softmax(hidden, weight, token_ids, chunk_size=2)
    assert torch.equal(logps[token_ids == -100], torch.zeros(3, device=DEVICE))
    logps.sum().backward()
    assert torch.equal(hidden.grad[token_ids == -100], torch.zeros(3, 8, device=DEVICE))
    assert (logps[token_ids != -100] < 0).all()


# ============================================================================ grpo_loss


@matrix()
def test_grpo_matrix(dtype, autocast, mode, layout, monkeypatch):
    """DAPO with old and reference policies, KL and delta: every term of the loss at once."""
    force_launch(monkeypatch, 2, block=64)
    inputs = make_inputs(3, 6, 24, 301, dtype=autocast or dtype, temperature=0.8)
    kwargs = dict(beta=0.05, delta=1.5, loss_type="dapo", temperature=0.8, chunk_size=5)
    run_grpo(
        inputs,
        dtype,
        kwargs=kwargs,
        mode=mode,
        autocast=autocast,
        layout=layout,
        metrics=METRICS_16BIT,
    )


FIRST_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
LOSS_CASES = [
    (loss_type, level, beta, old)
    for loss_type, level, beta, old in itertools.product(
        reference.LOSS_TYPES, reference.IMPORTANCE_SAMPLING_LEVELS, (0.0, 0.1), (False, True)
    )
    # KL cases always with an old policy, TRL's alternatives without one only on-policy
    # without KL: keeps the count down
    if (beta == 0.0 or old) and (loss_type in FIRST_LOSS_TYPES or beta != 0.0 or not old)
]


# Options other than the defaults for the loss types that have their own.
TYPE_OPTIONS = {
    "dr_grpo": dict(max_completion_length=7),
    "dapo": dict(num_items_in_batch=23),
    "cispo": dict(epsilon_high=CISPO_EPSILON_HIGH, num_items_in_batch=23),
    "sapo": dict(sapo_temperature_pos=1.3, sapo_temperature_neg=0.8),
    "vespo": dict(vespo_k_pos=1.5, vespo_lambda_pos=2.5, vespo_k_neg=2.0, vespo_lambda_neg=1.5),
}


@pytest.mark.filterwarnings("ignore:loss_type")  # luspo at token level, vespo at sequence level
@pytest.mark.parametrize("loss_type,level,beta,old", LOSS_CASES)
def test_loss_types(loss_type, level, beta, old):
    """fp32, each loss type at each level, with and without old and reference policies (the
    KL's bias correction on at token level, where the fused gradient has its own formula)."""
    inputs = make_inputs(4, 5, 16, 61, sequence_ratio=level == "sequence")
    if not old:
        del inputs["old_logps"]
    if beta == 0.0:
        del inputs["ref_logps"]
    kwargs = dict(
        loss_type=loss_type,
        importance_sampling_level=level,
        beta=beta,
        chunk_size=3,
        use_bias_correction_kl=beta != 0.0 and level == "token",
        **TYPE_OPTIONS.get(loss_type, {}),
    )
    run_grpo(inputs, torch.float32, kwargs=kwargs)


# TRL's alternatives to the clipped surrogate, each once through the dtype contract (the full
# matrix runs on DAPO above): (loss type, level, beta, old log-probs given).
NEW_LOSS_CASES = {
    "cispo": ("token", 0.05, True),
    "sapo": ("token", 0.05, True),
    "luspo": ("sequence", 0.0, True),
    "vespo": ("token", 0.05, True),  # with old log-probs: through the log-probs, then backward
}
DTYPE_CASES = [
    (torch.float32, None, "eager", "contiguous"),
    (torch.float16, None, "eager", "noncontiguous"),
    (torch.float32, torch.bfloat16, "eager", "contiguous"),
    (torch.bfloat16, None, "compile", "noncontiguous"),
]


@pytest.mark.parametrize(
    "dtype,autocast,mode,layout",
    DTYPE_CASES,
    ids=["fp32", "fp16-noncontiguous", "fp32-amp-bf16", "bf16-compile"],
)
@pytest.mark.parametrize("loss_type", list(NEW_LOSS_CASES))
def test_new_loss_types_dtypes(loss_type, dtype, autocast, mode, layout, monkeypatch):
    force_launch(monkeypatch, 2, block=64)
    level, beta, old = NEW_LOSS_CASES[loss_type]
    if mode == "compile" and loss_type == "vespo":
        old = False  # vespo on-policy: the fused path, compiled
    inputs = make_inputs(3, 6, 24, 301, dtype=autocast or dtype, sequence_ratio=level == "sequence")
    if not old:
        del inputs["old_logps"]
    kwargs = dict(
        loss_type=loss_type,
        importance_sampling_level=level,
        beta=beta,
        use_bias_correction_kl=loss_type != "sapo",
        chunk_size=5,
        **TYPE_OPTIONS.get(loss_type, {}),
    )
    metrics = METRICS if dtype == torch.float32 and autocast is None else METRICS_16BIT
    run_grpo(
        inputs,
        dtype,
        kwargs=kwargs,
        mode=mode,
        autocast=autocast,
        layout=layout,
        metrics=metrics,
    )


@pytest.mark.parametrize("level", reference.IMPORTANCE_SAMPLING_LEVELS)
def test_bf16_with_bias_and_softcap(level):
    inputs = make_inputs(
        2,
        5,
        16,
        80,
        dtype=torch.bfloat16,
        sequence_ratio=level == "sequence",
        bias=True,
        logit_softcap=4.0,
    )
    kwargs = dict(importance_sampling_level=level, logit_softcap=4.0, chunk_size=4, beta=0.02)
    grad = ("hidden", "weight", "bias")
    run_grpo(inputs, torch.bfloat16, grad=grad, kwargs=kwargs, metrics=METRICS_16BIT)


def test_frozen_weight_skips_its_matmul(monkeypatch):
    calls = []
    original = lce_module._Grads.add_chunk

    def spy(self, *args):
        calls.append(self.weight.numel())
        return original(self, *args)

    monkeypatch.setattr(lce_module._Grads, "add_chunk", spy)
    inputs = make_inputs(2, 3, 8, 30)
    hidden = inputs["hidden"].float().to(DEVICE).requires_grad_()
    weight = inputs["weight"].float().to(DEVICE)
    args = [inputs[k].to(DEVICE) for k in ("token_ids", "completion_mask", "advantages")]
    loss, _ = fusetune.grpo_loss(hidden, weight, *args, chunk_size=2)
    loss.backward()
    if uses_kernels(hidden):
        assert calls == [0, 0, 0]
    assert weight.grad is None and hidden.grad.abs().sum() > 0


def test_gradient_accumulation_dapo():
    """Micro-batches normalised by the whole batch's active tokens (num_items_in_batch) sum to
    the loss and gradients of one call over the whole batch; .grad accumulates across calls."""
    inputs = make_inputs(4, 6, 16, 50)
    hidden = inputs["hidden"].float().to(DEVICE).requires_grad_()
    weight = inputs["weight"].float().to(DEVICE).requires_grad_()
    rest = {k: inputs[k].to(DEVICE) for k in ("token_ids", "completion_mask", "advantages")}
    old = inputs["old_logps"].to(DEVICE)
    options = dict(loss_type="dapo", chunk_size=5)
    whole, _ = fusetune.grpo_loss(hidden, weight, **rest, old_logps=old, **options)
    whole_grads = torch.autograd.grad(whole, (hidden, weight))
    active = rest["completion_mask"].sum()
    for half in (slice(0, 2), slice(2, 4)):
        part = {k: v[half] for k, v in rest.items()}
        loss, _ = fusetune.grpo_loss(
            hidden[half],
            weight,
            **part,
            old_logps=old[half],
            num_items_in_batch=active,
            **options,
        )
        loss.backward()
    assert_close("grad hidden", hidden.grad, whole_grads[0], 1e-5)
    assert_close("grad weight", weight.grad, whole_grads[1], 1e-5)


def test_upstream_gradient_scales():
    """loss * 3 gives three times the gradient (backward rescales the forward's gradients)."""
    inputs = make_inputs(2, 4, 8, 40)
    hidden = inputs["hidden"].float().to(DEVICE).requires_grad_()
    weight = inputs["weight"].float().to(DEVICE)
    args = [inputs[k].to(DEVICE) for k in ("token_ids", "completion_mask", "advantages")]
    loss, _ = fusetune.grpo_loss(hidden, weight, *args)
    (once,) = torch.autograd.grad(loss, hidden)
    loss, _ = fusetune.grpo_loss(hidden, weight, *args)
    (thrice,) = torch.autograd.grad(3 * loss, hidden)
    assert_close("grad hidden", thrice, 3 * once, 1e-6)


def test_compile_symbolic_batch_and_time():
    """One compiled function (fullgraph, dynamic) serves several (B, T): the fake gives the
    right shapes for symbolic sizes, and each result matches the reference."""

    def step(hidden, weight, token_ids, completion_mask, advantages, old_logps):
        loss, metrics = fusetune.grpo_loss(
            hidden,
            weight,
            token_ids,
            completion_mask,
            advantages,
            old_logps=old_logps,
            loss_type="bnpo",
            chunk_size=4,
        )
        return loss, metrics["clip_ratio"]

    compiled_step = compiled(step, DEVICE)
    for batch, time in ((2, 5), (3, 7), (1, 9)):
        inputs = make_inputs(batch, time, 16, 45)
        del inputs["ref_logps"]
        args = {k: v.float() if v.is_floating_point() else v for k, v in inputs.items()}
        args = {k: v.to(DEVICE) for k, v in args.items()}
        args["hidden"].requires_grad_()
        loss, clip = compiled_step(**args)
        (grad,) = torch.autograd.grad(loss, args["hidden"])
        hidden64 = inputs["hidden"].float().double().requires_grad_()
        want, metrics = reference.grpo_loss(
            hidden64,
            inputs["weight"].float().double(),
            inputs["token_ids"],
            inputs["completion_mask"],
            inputs["advantages"],
            old_logps=inputs["old_logps"],
            loss_type="bnpo",
        )
        (want_grad,) = torch.autograd.grad(want, hidden64)
        assert_close("loss", loss, want, tolerance(torch.float32))
        assert_close("clip_ratio", clip, metrics["clip_ratio"], tolerance(torch.float32))
        assert_close("grad hidden", grad, want_grad, tolerance(torch.float32))


def test_module():
    loss_fn = fusetune.nn.GRPOLoss(beta=0.1, loss_type="dr_grpo", max_completion_length=8)
    inputs = make_inputs(2, 5, 8, 40)
    args = {k: v.float() if v.is_floating_point() else v for k, v in inputs.items()}
    args = {k: v.to(DEVICE) for k, v in args.items()}
    loss, metrics = loss_fn(**args)
    want, want_metrics = reference.grpo_loss(
        **args, beta=0.1, loss_type="dr_grpo", max_completion_length=8
    )
    assert_close("loss", loss, want, tolerance(torch.float32))
    assert_close("kl", metrics["kl"], want_metrics["kl"], tolerance(torch.float32))
    assert "loss_type='dr_grpo'" in repr(loss_fn)


@pytest.mark.skipif(not ON_GPU, reason="host-device syncs exist only with a GPU")
@pytest.mark.parametrize("loss_type", ["dapo", "cispo", "sapo", "vespo"])
def test_no_host_device_sync(loss_type):
    inputs = make_inputs(4, 64, 64, 1000)
    args = {k: v.to("cuda") for k, v in inputs.items()}
    args["hidden"] = args["hidden"].bfloat16().requires_grad_()
    args["weight"] = args["weight"].bfloat16().requires_grad_()
    options = dict(
        beta=0.04,
        loss_type=loss_type,
        num_items_in_batch=torch.tensor(100).cuda(),
        use_bias_correction_kl=True,
    )
    fusetune.grpo_loss(**args, **options)[0].backward()  # warm-up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss, metrics = fusetune.grpo_loss(**args, **options, chunk_size=64)
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


# ============================================================================ the reference


def loop_reference(logps, mask, advantages, old, ref, *, loss_type, level, bias_correction):
    """The formulas, one token at a time, in Python floats (options: LOOP_OPTIONS; the sapo
    and vespo ones at their defaults)."""
    beta, eps_low, eps_high, delta = (LOOP_OPTIONS[k] for k in ("beta", "eps_low", "eps_high",
                                                                 "delta"))  # fmt: skip
    batch, time = len(logps), len(logps[0])
    per_token = [[0.0] * time for _ in range(batch)]
    for b in range(batch):
        active = [t for t in range(time) if mask[b][t]]
        seq_log_ratio = sum(logps[b][t] - old[b][t] for t in active) / max(1, len(active))
        phi = vespo_phi(sum(max(-20.0, min(20.0, logps[b][t] - old[b][t])) for t in active),
                        advantages[b])  # fmt: skip
        for t in range(time):
            log_ratio = logps[b][t] - old[b][t] if level == "token" else seq_log_ratio
            ratio, a = math.exp(log_ratio), advantages[b]
            if loss_type == "cispo":
                policy = -min(ratio, eps_high) * a * logps[b][t]
            elif loss_type == "sapo":
                tau = 1.0 if a > 0 else 1.05
                policy = -4.0 / tau / (1.0 + math.exp(-tau * (ratio - 1.0))) * a
            elif loss_type == "vespo":
                policy = -phi * a * logps[b][t]
            else:
                first = (ratio if delta is None else min(ratio, delta)) * a
                second = min(max(ratio, 1 - eps_low), 1 + eps_high) * a
                policy = -min(first, second)
            diff = ref[b][t] - logps[b][t]
            kl = (math.exp(diff) - diff - 1) * (ratio if bias_correction else 1.0)
            per_token[b][t] = policy + beta * kl
    summed = [sum(per_token[b][t] for t in range(time) if mask[b][t]) for b in range(batch)]
    counts = [sum(1 for t in range(time) if mask[b][t]) for b in range(batch)]
    if loss_type in ("grpo", "sapo"):
        return sum(s / max(1, c) for s, c in zip(summed, counts, strict=True)) / batch
    if loss_type == "luspo":
        return sum(summed) / batch
    if loss_type == "dr_grpo":
        return sum(summed) / (batch * LOOP_OPTIONS["max_len"])
    return sum(summed) / max(1, sum(counts))  # bnpo, and dapo / cispo / vespo without a count


def vespo_phi(log_w, advantage):
    """VESPO's Gamma weight at its default (k, lambda), from the clamped log-ratio sum."""
    log_w = min(max(log_w, math.log(1e-8)), 20.0)
    k, lam = (2.0, 3.0) if advantage >= 0 else (3.0, 2.0)
    return math.exp(lam + k * log_w - lam * math.exp(log_w))


LOOP_OPTIONS = dict(beta=0.07, eps_low=0.2, eps_high=0.28, delta=1.5, max_len=9)


@pytest.mark.filterwarnings("ignore:loss_type")
@pytest.mark.parametrize("loss_type", reference.LOSS_TYPES)
@pytest.mark.parametrize("level", reference.IMPORTANCE_SAMPLING_LEVELS)
def test_reference_matches_the_formulas(loss_type, level):
    batch, time = 3, 6
    logps = -torch.rand(batch, time, dtype=torch.float64) * 3
    old = logps + LOG_RATIO_OFFSETS[torch.randint(0, 5, (batch, time))]
    ref = logps + 0.3 * torch.randn(batch, time, dtype=torch.float64)
    mask = torch.rand(batch, time) < 0.7
    mask[-1] = False
    advantages = torch.randn(batch, dtype=torch.float64)
    bias_correction = level == "token"
    got, _ = reference.grpo_loss_from_logps(
        logps,
        mask,
        advantages,
        old_logps=old,
        ref_logps=ref,
        beta=LOOP_OPTIONS["beta"],
        epsilon_low=LOOP_OPTIONS["eps_low"],
        epsilon_high=LOOP_OPTIONS["eps_high"],
        delta=LOOP_OPTIONS["delta"],
        loss_type=loss_type,
        importance_sampling_level=level,
        max_completion_length=LOOP_OPTIONS["max_len"],
        use_bias_correction_kl=bias_correction,
    )
    want = loop_reference(
        logps.tolist(),
        mask.tolist(),
        advantages.tolist(),
        old.tolist(),
        ref.tolist(),
        loss_type=loss_type,
        level=level,
        bias_correction=bias_correction,
    )
    assert abs(got.item() - want) <= 1e-12 * max(1.0, abs(want))


class _Accelerator:
    """One process: TRL's reductions are identities."""

    num_processes = 1

    def reduce(self, tensor, reduction="sum"):
        return tensor

    def gather(self, tensor):
        return tensor


def trl_compute_loss(logps, inputs, options):
    """TRL 1.16's own GRPOTrainer._compute_loss on a stand-in trainer whose model returns
    ``logps`` (and zero entropy): TRL's per-token loss, normaliser and metrics, unchanged.
    Returns (loss, {TRL metric name: value})."""
    trl = pytest.importorskip("trl")
    trainer_class = trl.GRPOTrainer

    class Trainer:
        get_gamma_weights = staticmethod(trainer_class.get_gamma_weights)

        def _get_per_token_logps_and_entropies(self, *args, **kwargs):
            return logps, torch.zeros_like(logps), None

    trainer = Trainer()
    trainer.__dict__.update(
        loss_type=options.loss_type,
        importance_sampling_level=options.importance_sampling_level,
        beta=options.beta,
        epsilon_low=options.epsilon_low,
        epsilon_high=options.epsilon_high,
        max_completion_length=options.max_completion_length,
        aux_loss_enabled=False,
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        use_vllm=False,
        _entropy_bonus_enabled=False,
        current_gradient_accumulation_steps=1,
        model=types.SimpleNamespace(training=True),
        accelerator=_Accelerator(),
        _metrics={"train": collections.defaultdict(list)},
        args=types.SimpleNamespace(
            steps_per_generation=1,
            **{name: getattr(options, name) for name in TRL_ARGS},
        ),
    )
    loss = trainer_class._compute_loss(trainer, None, inputs)
    return loss, {name: values[0] for name, values in trainer._metrics["train"].items()}


TRL_ARGS = (
    "delta",
    "use_bias_correction_kl",
    "sapo_temperature_pos",
    "sapo_temperature_neg",
    "vespo_k_pos",
    "vespo_lambda_pos",
    "vespo_k_neg",
    "vespo_lambda_neg",
)


@pytest.mark.filterwarnings("ignore:loss_type")
@pytest.mark.parametrize("loss_type", reference.LOSS_TYPES)
@pytest.mark.parametrize("level", reference.IMPORTANCE_SAMPLING_LEVELS)
def test_reference_matches_trl(loss_type, level):
    """The float64 reference against TRL's own _compute_loss on the same log-probs: loss,
    gradient in the log-probs (CISPO's and VESPO's stop-gradients included) and every metric
    TRL logs but the entropy. The sapo temperatures are exact in float32: TRL builds them with
    torch.where of two Python floats, which gives the default dtype whatever the log-probs'."""
    batch, time = 4, 6
    logps = (-torch.rand(batch, time, dtype=torch.float64) * 3).requires_grad_()
    old = logps.detach() + 0.3 * torch.randn(batch, time, dtype=torch.float64)
    ref = logps.detach() + 0.3 * torch.randn(batch, time, dtype=torch.float64)
    mask = (torch.rand(batch, time) < 0.7).long()
    mask[-1] = 0
    advantages = torch.randn(batch, dtype=torch.float64)
    num_items = torch.tensor(17.0, dtype=torch.float64)
    options = reference.LossOptions(
        beta=0.07,
        epsilon_low=0.2,
        epsilon_high=CISPO_EPSILON_HIGH if loss_type == "cispo" else 0.28,
        delta=None if loss_type == "cispo" else 1.5,
        loss_type=loss_type,
        importance_sampling_level=level,
        max_completion_length=9,
        num_items_in_batch=num_items,
        sapo_temperature_pos=1.25,
        sapo_temperature_neg=0.875,
        vespo_k_pos=1.5,
        vespo_lambda_pos=2.5,
        use_bias_correction_kl=level == "token",
    )
    inputs = dict(
        prompt_ids=torch.zeros(batch, 1, dtype=torch.long),
        prompt_mask=torch.ones(batch, 1, dtype=torch.long),
        completion_ids=torch.zeros(batch, time, dtype=torch.long),
        completion_mask=mask,
        advantages=advantages,
        old_per_token_logps=old,
        ref_per_token_logps=ref,
        num_items_in_batch=num_items,
    )
    want, want_metrics = trl_compute_loss(logps, inputs, options)
    (want_grad,) = torch.autograd.grad(want, logps)
    got, metrics = reference.grpo_loss_from_logps(
        logps, mask, advantages, old_logps=old, ref_logps=ref, **options._asdict()
    )
    (grad,) = torch.autograd.grad(got, logps)
    assert abs(got.item() - want.item()) <= 1e-12 * max(1.0, abs(want.item()))
    assert_close("grad logps", grad, want_grad, 1e-12)
    want_metrics.pop("entropy")
    assert {reference.TRL_METRIC_NAMES[name] for name in metrics} == set(want_metrics)
    for name, value in metrics.items():  # TRL's clip fractions are float32
        assert value.item() == pytest.approx(want_metrics[reference.TRL_METRIC_NAMES[name]], 1e-7)


def test_metrics_count_clipped_tokens():
    logps = torch.zeros(2, 3)
    old = torch.log(torch.tensor([[1.0, 1 / 0.7, 1 / 1.5], [1.0, 1 / 0.7, 1 / 1.5]]))
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    advantages = torch.tensor([-1.0, 1.0])  # row 0 is clipped low, row 1 high
    ref = torch.full((2, 3), -0.5)
    _, metrics = reference.grpo_loss_from_logps(
        logps, mask, advantages, old_logps=old, ref_logps=ref
    )
    assert metrics["clip_ratio_low"].item() == pytest.approx(1 / 5)  # ratio 0.7, A < 0
    assert metrics["clip_ratio_high"].item() == pytest.approx(0.0)  # ratio 1.5 is masked
    assert metrics["clip_ratio"].item() == pytest.approx(1 / 5)
    assert metrics["kl"].item() == pytest.approx(math.exp(-0.5) + 0.5 - 1)


# ============================================================================ bad input

SHAPES = dict(
    hidden=(2, 3, 16),
    weight=(50, 16),
    token_ids=(2, 3),
    completion_mask=(2, 3),
    advantages=(2,),
    old_logps=None,
    ref_logps=None,
)
BAD_INPUTS = {
    "logits-for-hidden": (dict(hidden=(2, 3, 50)), "(2, 3, 50)|(50, 16)|looks like logits"),
    "hidden-2d": (dict(hidden=(6, 16)), "hidden|[B, T, H]"),
    "ids-shape": (dict(token_ids=(2, 4)), "token_ids|must have shape|(2, 3)|(2, 4)"),
    "mask-shape": (dict(completion_mask=(3, 3)), "completion_mask|must have shape|(3, 3)"),
    "advantages-shape": (dict(advantages=(2, 3)), "advantages|must have shape|(2,)|(2, 3)"),
    "old-shape": (dict(old_logps=(2, 2)), "old_logps|must have shape|(2, 3)|(2, 2)"),
    "ref-shape": (dict(ref_logps=(1, 3)), "ref_logps|must have shape|(2, 3)|(1, 3)"),
}
BAD_OPTIONS = {
    "loss-type": (dict(loss_type="ppo"), "loss_type|ppo"),
    "level": (dict(importance_sampling_level="batch"), "importance_sampling_level|batch"),
    "dr-grpo-length": (dict(loss_type="dr_grpo"), "dr_grpo|max_completion_length"),
    "beta-without-ref": (dict(beta=0.04), "beta|ref_logps"),
    "epsilon-low": (dict(epsilon_low=1.5), "epsilon_low"),
    "delta": (dict(delta=0.5), "delta"),
    "temperature": (dict(temperature=0.0), "temperature"),
    "num-items": (dict(num_items_in_batch=0), "num_items_in_batch"),
    "sapo-temperature": (
        dict(loss_type="sapo", sapo_temperature_neg=0.0),
        "sapo_temperature_neg|(0.0, inf]",
    ),
}


def bad_call(shapes):
    shapes = {**SHAPES, **shapes}
    tensors = {}
    for name, shape in shapes.items():
        if shape is None:
            continue
        if name in ("token_ids", "completion_mask"):
            tensors[name] = torch.randint(0, 2, shape, device=DEVICE)
        else:
            tensors[name] = torch.randn(*shape, device=DEVICE)
    return tensors


@pytest.mark.parametrize("mode", ["eager", "compile"])
@pytest.mark.parametrize("case", list(BAD_INPUTS) + list(BAD_OPTIONS))
def test_bad_input(case, mode):
    shapes, match = BAD_INPUTS.get(case, ({}, None))
    options, option_match = BAD_OPTIONS.get(case, ({}, None))
    tensors = bad_call(shapes)
    fn = fusetune.grpo_loss
    match = match or option_match
    if mode == "compile":
        # The options are traced as constants; under dynamic shapes the message prints sizes
        # symbolically (s0), so check the words only.
        fn = compiled(lambda **kw: fusetune.grpo_loss(**kw, **options), DEVICE)
        match = "|".join(w for w in match.split("|") if not any(c.isdigit() for c in w))
        assert_raises(ValueError, match, fn, **tensors)
    else:
        assert_raises(ValueError, match, fn, **tensors, **options)


def test_bad_types():
    tensors = bad_call({})
    assert_raises(
        TypeError,
        "token_ids",
        fusetune.grpo_loss,
        **{**tensors, "token_ids": tensors["token_ids"].float()},
    )
    assert_raises(
        TypeError,
        "advantages",
        fusetune.grpo_loss,
        **{**tensors, "advantages": tensors["advantages"].long()},
    )


def test_bad_option_types():
    tensors = bad_call({})
    for options in (dict(use_bias_correction_kl=1), dict(vespo_k_pos="2")):
        assert_raises(TypeError, next(iter(options)), fusetune.grpo_loss, **tensors, **options)


@pytest.mark.parametrize(
    "loss_type,level", [("luspo", "token"), ("vespo", "sequence")], ids=["luspo", "vespo"]
)
def test_level_mismatch_warns_as_trl_does(loss_type, level):
    """TRL warns for these and computes them; so does grpo_loss (the values are checked in
    test_loss_types and test_reference_matches_trl)."""
    tensors = bad_call({})
    with pytest.warns(UserWarning, match=f"loss_type '{loss_type}'.*importance_sampling_level"):
        loss, _ = fusetune.grpo_loss(
            **tensors, loss_type=loss_type, importance_sampling_level=level
        )
    assert torch.isfinite(loss)


def test_out_of_range_token_on_cpu():
    hidden, weight = torch.randn(1, 3, 8), torch.randn(20, 8)
    token_ids = torch.tensor([[1, 20, 2]])
    assert_raises(
        ValueError,
        "token_ids|[0, 20)|20",
        fusetune.selective_log_softmax,
        hidden,
        weight,
        token_ids,
    )
